"""Logging a researcher reads: TensorBoard event files hold the scalars of metrics.jsonl, and the progress bar prints
its step counter.

The event files are read back without TensorFlow or tensorboard: a TFRecord reader over `workdir/tb/events.*`
(u64 length, masked crc32c of it, the `Event` protobuf, masked crc32c of it; both checksums verified) decoding
`tensorboardX.proto.event_pb2.Event`.
"""

import glob
import math
import os
import re
import struct

import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c
from train_helpers import make_config, tiny_overrides

from minpro_jax.run.metrics_log import MetricsWriter, read_metrics


def read_tb_scalars(tb_dir: str) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of every simple-value scalar in the event files under `tb_dir`.

  Raises AssertionError on a torn record or a checksum mismatch.
  """
  out: dict[str, dict[int, float]] = {}
  files = sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")))
  assert files, f"no event file in {tb_dir}"
  for path in files:
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      header = data[i : i + 8]
      (n,) = struct.unpack("<Q", header)
      (crc_len,) = struct.unpack("<I", data[i + 8 : i + 12])
      assert crc_len == masked_crc32c(header), f"{path}: bad length checksum at byte {i}"
      body = data[i + 12 : i + 12 + n]
      (crc_body,) = struct.unpack("<I", data[i + 12 + n : i + 16 + n])
      assert len(body) == n and crc_body == masked_crc32c(body), f"{path}: bad record at byte {i}"
      i += 16 + n
      ev = Event.FromString(body)
      if ev.HasField("summary"):
        for v in ev.summary.value:
          if v.HasField("simple_value"):
            out.setdefault(v.tag, {})[int(ev.step)] = float(v.simple_value)
  return out


def _numeric(rec: dict) -> dict[str, float]:
  return {
      k.replace("@", "_at_"): float(v)
      for k, v in rec.items()
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
  }


def _assert_tb_matches_jsonl(workdir: str) -> int:
  """Every numeric metric of every metrics.jsonl line is in TensorBoard at its step (fp32); returns the count."""
  tb = read_tb_scalars(os.path.join(workdir, "tb"))
  count = 0
  for rec in read_metrics(workdir):
    for tag, v in _numeric(rec).items():
      assert tag in tb and rec["step"] in tb[tag], f"{tag} at step {rec['step']} is not in TensorBoard"
      assert math.isclose(tb[tag][rec["step"]], v, rel_tol=1e-6, abs_tol=1e-6), (tag, rec["step"])
      count += 1
  return count


def test_metrics_writer_tensorboard_roundtrip(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=True)
  w.write(0, {"reward/mean": 0.25, "eval/pass@1": 0.5, "n": 3, "flag": True, "name": "x", "nan": float("nan")})
  w.write(1, {"reward/mean": 0.75, "eval/pass@1": 0.625, "n": 4})
  w.close()
  tb = read_tb_scalars(str(tmp_path / "tb"))
  assert tb == {
      "reward/mean": {0: 0.25, 1: 0.75},
      "eval/pass_at_1": {0: 0.5, 1: 0.625},
      "n": {0: 3.0, 1: 4.0},
  }  # bools, strings and non-finite values (None in metrics.jsonl) are not scalars
  assert read_metrics(str(tmp_path))[0]["nan"] is None
  assert _assert_tb_matches_jsonl(str(tmp_path)) == 6


@pytest.mark.slow
def test_run_logs_tensorboard_and_progress_bar(tmp_path, capfd):
  from minpro_jax.run.trainer import Trainer

  ov = tiny_overrides(tmp_path, **{"log.tensorboard": True, "log.progress": True, "total_steps": 3})
  Trainer.from_config(make_config(ov)).run()
  workdir = ov["workdir"]
  recs = read_metrics(workdir)
  # -1: the evaluation before RL; 0..2 the global steps; 3 (= total_steps): the final evaluation
  assert [r["step"] for r in recs] == [-1, 0, 1, 2, 3]
  assert _assert_tb_matches_jsonl(workdir) > 3 * 10
  tb = read_tb_scalars(os.path.join(workdir, "tb"))
  assert set(tb["time/step"]) == {0, 1, 2}
  err = capfd.readouterr().err
  counters = re.findall(r"RL:\s+\d+%\|[^|]*\|\s*(\d+)/3", err)
  assert counters and counters[-1] == "3", err[-2000:]
