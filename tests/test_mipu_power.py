"""The MIPU power study's runner (minpro_jax/lab/mipu_power.py) at a toy size: the worked-step setting's config,
a rerun that goes on from the kept trajectory state, a pair killed between its chunks resuming to the same record,
and the side-by-side report of two studies."""

import functools
import json
import os

import numpy as np
import pytest
from test_mipu_statistics import _pair
from train_helpers import coin_grade, kill_at_call, tiny_overrides

from minpro_jax.lab import mipu_power as mp
from minpro_jax.lab import mipu_power_report as mpr

# 2 checkpoints x 2 candidates; draws in chunks of 2 prompts: validation 2 chunks of 2 x 8, truth 3 chunks (2, 2, 1)
PLAN = mp.Plan(checkpoints=(0, 1), candidates=2, val_prompts=4, truth=5, sizes=(8, 32), seed=0, chunk_prompts=2)


def test_worked_setting_config(tmp_path):
  c = mp.study_config(str(tmp_path), 1, "worked")
  # the MIPU study's GRPO at delay 0 with its fp8 e5m2 sampler (configs/studies/mipu.py) ...
  assert (c.loss.method, c.delay, c.seed, c.workdir, c.eval.every) == ("grpo", 0, 1, str(tmp_path), 0)
  assert (c.sampling.precision, c.sampling.fp8_format, c.sampling.fp8_weight_scale) == ("fp8", "e5m2", "tensor")
  assert c.sampling.fp8_activations == "tensor" and c.sampling.decode_rows == mp.DECODE_ROWS
  assert (c.num_updates_per_step, c.prompts_per_step, c.group_size) == (8, 32, 8)
  # ... on configs/studies/minpro_long.py's task: eight-term chain_sum, worked-step warm start, 128 new tokens, lr 3e-5
  assert (c.data.task_config.min_terms, c.data.task_config.max_terms) == (8, 8)
  assert (c.data.task_config.min_digits, c.data.task_config.max_digits) == (1, 2)
  assert (c.sft.target, c.sft.max_len, c.sft.steps) == ("worked", 136, 600)
  assert (c.data.max_prompt_tokens, c.sampling.max_new_tokens, c.optimizer.learning_rate) == (48, 128, 3e-5)
  short = mp.study_config(str(tmp_path), 1)
  assert (short.sampling.max_new_tokens, short.data.task_config.max_terms, short.sft.target) != (128, 8, "worked")
  assert short.optimizer.learning_rate == 1e-4 and short.sampling.precision == "fp8"
  with pytest.raises(ValueError, match="choose one of"):
    mp.study_config(str(tmp_path), 1, "long")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("mipu_power")
  ov = {k: v for k, v in tiny_overrides(tmp).items() if k != "workdir"}
  ov.update({"delay": 0, "sampling.decode_rows": 16})
  out = str(tmp / "out")
  with pytest.MonkeyPatch.context() as m:  # mixed rewards for the tiny model: nonzero advantages and updates
    m.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
    mp.run(out, PLAN, ov)
  return out, ov


def test_records(study):
  out, _ = study
  pairs = mpr.load(out)
  assert [(p["checkpoint"], p["candidate"]) for p in pairs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  for p in pairs:
    assert [len(p["by_n"][n]) for n in ("8", "32")] == [4, 1]
    assert p["plan"]["chunk_prompts"] == 2 and p["plan"]["truth"] == 5 and p["plan"]["setting"] == "short"
    assert 0 < p["response_len"] <= 6  # tokens at theta_k, at most max_new_tokens
  assert sorted(os.listdir(os.path.join(out, "trajectory"))) == ["k0.npz", "k1.npz", "key.json"]
  assert os.listdir(os.path.join(out, "partial")) == []  # every pair's chunks removed once its record is written
  with np.load(os.path.join(out, "trajectory", "k0.npz")) as a, np.load(os.path.join(out, "trajectory", "k1.npz")) as b:
    assert a.files == b.files and any(not np.array_equal(a[f], b[f]) for f in a.files)  # one global step apart


@pytest.mark.slow  # two more runs of the study
def test_a_pair_killed_between_chunks_resumes_to_the_same_record(study, capsys, monkeypatch):
  out, ov = study
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  kept = json.load(open(os.path.join(out, "k1_u1.json")))
  os.remove(os.path.join(out, "k1_u1.json"))
  real_draw, calls = mp.draw, []
  draw_until = functools.partial(kill_at_call, real_draw, calls=calls)

  # theta_1's draws: 2 validation + 3 truth chunks; theta'_1's: 2 validation chunks, then killed in its truth
  monkeypatch.setattr(mp, "draw", draw_until(5 + 2 + 2))
  capsys.readouterr()
  with pytest.raises(RuntimeError, match="killed"):
    mp.run(out, PLAN, ov)
  log = capsys.readouterr().out
  assert "trajectory: resuming at step 1" in log and "trajectory step" not in log  # the kept state at k = 1
  assert sorted(os.listdir(os.path.join(out, "partial"))) == ["k1_old.npz", "k1_u1.npz"]
  calls.clear()
  monkeypatch.setattr(mp, "draw", draw_until(0))  # never killed
  mp.run(out, PLAN, ov)
  assert "k=1 u=1: resuming after 3 chunks" in capsys.readouterr().out
  assert len(calls) == 2  # only theta'_1's last 2 truth chunks were drawn again
  assert os.listdir(os.path.join(out, "partial")) == []
  got = json.load(open(os.path.join(out, "k1_u1.json")))
  for k in ("seconds", "date"):
    got.pop(k), kept.pop(k)
  assert got == kept
  with pytest.raises(ValueError, match="made with the plan"):  # a partial file of another plan is refused
    part = mp._Partial(os.path.join(out, "partial", "k9_old.npz"), mp._key(PLAN))
    part.get("truth0", lambda: {"rewards": np.zeros(2)})
    mp._Partial(part.path, mp._key(mp.Plan(truth=6)))
  os.remove(part.path)


def test_compare_report_puts_studies_side_by_side(study, tmp_path):
  out, _ = study
  short = tmp_path / "short"
  short.mkdir()
  for k in (0, 8):
    for j, truth in enumerate((-0.01, 0.01, 0.02, -0.02)):
      (short / f"k{k}_u{j}.json").write_text(json.dumps(_pair(k, j, truth, stat_shift=0.0)))
  doc = tmp_path / "doc.md"
  doc.write_text(f"a\n<!-- {mpr.COMPARE}:begin (x) -->\nold\n<!-- {mpr.COMPARE}:end -->\nb\n")
  table = mpr.compare_report({"T~6": str(short), "toy": out}, doc=str(doc))
  rows = table.splitlines()
  assert rows[0] == (
      "| study | task, pairs, truth | statistic | AUC, n = 8 | AUC, n = 32 | AUC, n = 128 | AUC, n = 512 | n_half |"
  )
  assert len(rows) == 2 + 2 * 3 and rows[2].startswith("| T~6 | short; 8 pairs; truth of 1024")
  assert rows[4].startswith("| | | `delta_j` | – | – | 1.00 [1.00, 1.00] |")  # the fake study has n = 128 only
  assert rows[5].startswith("| toy | short, T = ") and "4 pairs; truth of 5" in rows[5]
  assert "old" not in doc.read_text() and table in doc.read_text()
  assert mpr.block_of("results/mipu_power") == "mipu-power" and mpr.block_of("results/mipu_power_worked/") == (
      "mipu-power-worked"
  )
  with pytest.raises(SystemExit, match="no finished pair"):
    mpr.compare_report({"none": str(tmp_path / "missing")}, doc=str(doc))
