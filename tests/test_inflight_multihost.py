"""The in-flight mode (`config.staleness.mode = "inflight"`, `minpro_jax.run.inflight_runner`) as several real JAX
processes on this machine, started with `python -m minpro_jax.launch_local` as tests/test_multihost.py does:

* 2 processes x 2 CPU devices on the mesh data=2,fsdp=2 give the per-step metrics of 1 process x 4 devices on the
  same mesh, with parameter swaps in the middle of responses (`inflight_every` 2 < `max_new_tokens` 6): every
  sampled token's statistics, reward, advantage, segment count, occupancy and (per-token) staleness equal; the float
  statistics of the log-probs within 1e-5 (the collectives' reduction order, as in delay mode);
* the two-process run resumed from its step-1 checkpoint (mid-response; each process wrote its shards of the pool
  and its rows of the graded batches) ends with the metrics of the uninterrupted two-process run, exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from test_multihost import ROUNDOFF, _close, _env, _launch_args, run_side_by_side
from train_helpers import checkpoint_steps, metrics_records, tiny_overrides

pytestmark = pytest.mark.slow

STEPS = 3


def _overrides(tmp, name):
  return tiny_overrides(
      tmp,
      workdir=str(tmp / name),
      total_steps=STEPS,
      micro_batch_size=4,  # splits over data x fsdp = 4 (run_config.check_micro_batch_split)
      **{"mesh.shape": "data=2,fsdp=2", "checkpoint.every": 1, "checkpoint.keep": 3, "eval.num_problems": 4},
      **{"staleness.mode": "inflight", "staleness.inflight_every": 2, "sampling.kv_cache": "dense"},
      **{"optimizer.learning_rate": 1e-2},  # versions far enough apart that a swap changes what is drawn
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The two-process run and the one-process, four-device run of the same in-flight config, side by side."""
  tmp = tmp_path_factory.mktemp("inflight_multihost")
  one, two = _overrides(tmp, "one"), _overrides(tmp, "two")
  run_side_by_side(tmp, one, two)
  return tmp, one["workdir"], two["workdir"]


def test_two_process_inflight_run_equals_the_one_process_run(runs):
  _, one, two = runs
  ref, got = metrics_records(one), metrics_records(two)
  assert sorted(ref) == sorted(got) == list(range(-1, STEPS + 1))
  assert max(ref[s]["staleness/spread_max"] for s in range(1, STEPS)) >= 1  # responses drawn by several versions
  assert ref[STEPS - 1]["policy_version"] == got[STEPS - 1]["policy_version"] > 0
  for step in ref:
    assert sorted(got[step]) == sorted(ref[step]), step  # the per-token staleness metrics too
    for k, v in ref[step].items():
      if k.startswith(ROUNDOFF) and k not in ("learn/updates", "learn/skipped_updates"):
        assert _close(v, got[step][k]), (step, k, v, got[step][k])
      else:
        assert got[step][k] == v, (step, k, v, got[step][k])


def _bytes_under(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_two_process_inflight_run_resumes_mid_response(runs):
  tmp, _, two = runs
  assert checkpoint_steps(two) == [0, 1, 2]
  # each process wrote its own shards of the pool (KV cache, rows' state) and rows of the graded batches: nothing was
  # gathered to process 0 (measured: 21 and 18 kB; before, the pool whole from process 0 and nothing from process 1)
  buffer = os.path.join(two, "checkpoints", "1", "buffer")
  written = [_bytes_under(os.path.join(buffer, f"ocdbt.process_{i}")) for i in (0, 1)]
  assert written[1] > 0.5 * written[0] > 0, written
  ov = _overrides(tmp, "resumed")
  shutil.copytree(two, ov["workdir"])
  shutil.rmtree(os.path.join(ov["workdir"], "checkpoints", "2"))  # resume after step 1: rows are mid-response
  r = subprocess.run(_launch_args(ov), env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "resumed from global step 1" in r.stdout + r.stderr
  assert metrics_records(ov["workdir"]) == metrics_records(two)
