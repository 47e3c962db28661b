"""MIPU Step 2's statistics beside T_post (issue 38 part 2): the paired delta_t / delta_j, the calibrated
tolerance, their config checks, and the power study's analysis."""

import json
import math

import jax
import numpy as np
import pytest
from train_helpers import coin_grade, make_config, tiny_overrides

from minpro_jax.lab import mipu_power, mipu_power_report
from minpro_jax.rl import mipu
from minpro_jax.run import run_config


def test_paired_difference_by_hand():
  # 3 groups of 2; new: T' = (1 + 3 + 2 - 1 + 5) / 5 = 2 (row 3 has no tokens); old: T = (0+1+1+1+0+3) / 6 = 1
  t_new = np.array([1.0, 3.0, 2.0, 0.0, -1.0, 5.0])
  h_new = np.array([True, True, True, False, True, True])
  t_old = np.array([0.0, 1.0, 1.0, 1.0, 0.0, 3.0])
  h_old = np.ones(6, bool)
  gid = np.array([4, 4, 9, 9, 7, 7])  # any labels; the order of groups does not matter
  # per group (in label order 4, 7, 9): new S' = 4, 4, 2 with n' = 2, 2, 1; old S = 1, 3, 2 with n = 2, 2, 2
  u = (np.array([4.0, 4.0, 2.0]) - 2.0 * np.array([2.0, 2.0, 1.0])) / 5.0 - (
      np.array([1.0, 3.0, 2.0]) - 1.0 * np.array([2.0, 2.0, 2.0])
  ) / 6.0
  d, se = mipu.paired_difference(t_new, h_new, t_old, h_old, gid)
  assert d == pytest.approx(1.0, rel=1e-12)
  assert se == pytest.approx(math.sqrt(3 / 2 * np.sum(u**2)), rel=1e-12)
  # with every row present: the sd of the per-group differences of means over sqrt(G)
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=24), rng.normal(size=24)
  g = np.repeat(np.arange(6), 4)
  diffs = (a - b).reshape(6, 4).mean(1)
  d, se = mipu.paired_difference(a, np.ones(24, bool), b, np.ones(24, bool), g)
  assert d == pytest.approx(diffs.mean(), rel=1e-12) and se == pytest.approx(diffs.std(ddof=1) / math.sqrt(6))
  # against a zero draw it is T_post's own standard error
  _, se_alone = mipu.paired_difference(t_new, h_new, np.zeros(6), h_old, gid)
  assert se_alone == pytest.approx(mipu.t_post_standard_error(t_new, h_new, gid), rel=1e-12)
  assert mipu.paired_difference(a, np.ones(24, bool), a, np.ones(24, bool), g) == (0.0, 0.0)
  assert math.isnan(mipu.paired_difference(a[:4], np.ones(4, bool), b[:4], np.ones(4, bool), g[:4])[1])
  with pytest.raises(ValueError, match="must be"):
    mipu.paired_difference(a, np.ones(23, bool), b, np.ones(24, bool), g)


def test_paired_difference_se_is_calibrated_and_pairing_shrinks_it():
  """Over many coupled draws the mean paired SE matches the spread of D, far below an unpaired SE."""
  rng = np.random.default_rng(1)
  groups, size = 16, 8
  g = np.repeat(np.arange(groups), size)
  ds, ses, unpaired = [], [], []
  for _ in range(2000):
    shared = np.repeat(rng.normal(0, 1.0, groups), size) + rng.normal(0, 1.0, groups * size)
    new = shared + 0.1 + rng.normal(0, 0.2, groups * size)
    d, se = mipu.paired_difference(new, np.ones_like(new, bool), shared, np.ones_like(new, bool), g)
    ds.append(d)
    ses.append(se)
    unpaired.append(math.hypot(*(mipu.t_post_standard_error(x, np.ones_like(x, bool), g) for x in (new, shared))))
  assert np.mean(ds) == pytest.approx(0.1, abs=3 * np.std(ds) / math.sqrt(2000))
  assert np.mean(ses) == pytest.approx(np.std(ds), rel=0.06)
  assert np.mean(ses) < 0.2 * np.mean(unpaired)


def test_calibrated_tolerance_by_hand():
  t = [-2e-3, -1e-3, 0.0]  # mean -1e-3, sd 1e-3
  assert mipu.calibrated_tolerance(t, 2.0) == pytest.approx(2e-3 + 1e-3)
  assert mipu.accept_update(-3e-3, mipu.calibrated_tolerance(t, 2.0))
  assert not mipu.accept_update(-3.1e-3, mipu.calibrated_tolerance(t, 2.0))
  for bad in ([1.0], [1.0, math.nan]):
    with pytest.raises(ValueError, match="calibration needs"):
      mipu.calibrated_tolerance(bad, 2.0)


@pytest.mark.parametrize(
    "fields,msg",
    [
        ({"mipu.rollback": True, "mipu.statistic": "delta"}, r"mipu.statistic: must be one of \('t_post'"),
        ({"mipu.rollback": True, "mipu.tolerance": "auto"}, r"mipu.tolerance: must be one of \('fixed'"),
        (
            {"mipu.rollback": True, "mipu.statistic": "delta_t", "mipu.tolerance": "calibrated"},
            "mipu.tolerance: calibrated sets c against the standing gap",
        ),
        ({"mipu.rollback": True, "mipu.tolerance": "calibrated", "mipu.calibration_draws": 1}, "calibration_draws"),
        ({"mipu.statistic": "delta_j"}, "mipu.statistic: 'delta_j' needs mipu.rollback=True"),
        (
            {"mipu.rollback": True, "mipu.mode": "random", "mipu.random_rate": 0.5, "mipu.statistic": "delta_t"},
            "mipu.statistic: is for mode=gap",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path, fields, msg):
  c = make_config(tiny_overrides(tmp_path, **fields))
  with pytest.raises(run_config.ConfigError, match=msg):
    run_config.validate_config(c)


@pytest.mark.slow
def test_delta_t_is_exactly_zero_at_equal_weights_and_logs_the_pair(tmp_path, monkeypatch):
  """theta' = theta_k: the coupled draws are the same tokens, so delta_t, delta_j and their SEs are exactly 0; after
  an update the check logs T(theta_k) and tests delta_t; a calibrated c is measured once and kept."""
  from flax import nnx

  from minpro_jax.run.trainer import RunProgress, Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  ov = {"mipu.rollback": True, "mipu.statistic": "delta_t", "mipu.gap_tolerance": 0.0, "sampling.precision": "fp8"}
  tr = Trainer.from_config(make_config(tiny_overrides(tmp_path, **ov)))
  state = tr.learner.init_state(nnx.split(tr.model)[1])
  check, metrics, _ = tr.mipu_step.check(state, 3, before=state)
  assert check.t_post != 0.0 and check.t_before == check.t_post  # the fp8 gap is there, the same on both sides
  assert (check.delta_t, check.delta_t_se, check.delta_j, check.delta_j_se) == (0.0, 0.0, 0.0, 0.0)
  assert check.statistic == 0.0 and check.accepted and metrics["mipu/delta_t"] == 0.0
  with pytest.raises(ValueError, match="pass its state as `before`"):
    tr.mipu_step.check(state, 3)

  batch, _ = tr.sample_step(state, 0)
  before = mipu.snapshot(state)
  state, _ = tr.learn_step(state, batch)
  progress = RunProgress()
  kept, m = tr.mipu_step(state, before, 0, progress)
  assert m["mipu/delta_t"] == pytest.approx(m["mipu/t_post"] - m["mipu/t_before"], abs=1e-7)
  assert m["mipu/delta_t"] != 0.0 and m["mipu/delta_t_se"] > 0
  assert m["mipu/accepted"] == int(m["mipu/delta_t"] >= 0.0) and (kept is state) == bool(m["mipu/accepted"])

  tr.mipu_step.cfg.statistic, tr.mipu_step.cfg.tolerance = "t_post", "calibrated"
  tr.mipu_step.cfg.calibration_draws = 3
  state = kept
  before = mipu.snapshot(state)
  _, m = tr.mipu_step(state, before, 1, progress)
  c_cal = progress.mipu_tolerance
  assert c_cal is not None and m["mipu/tolerance"] == c_cal
  assert m["mipu/accepted"] == int(m["mipu/t_post"] >= -c_cal)
  t_start = [tr.mipu_step._draw(before, _val(tr, d), tr.step_seed(d, 6)).t for d in range(3)]
  assert c_cal == pytest.approx(mipu.calibrated_tolerance(t_start, 2.0), rel=1e-6)
  _, m = tr.mipu_step(state, mipu.snapshot(state), 2, progress)
  assert progress.mipu_tolerance == c_cal and m["mipu/tolerance"] == c_cal  # measured once
  jax.block_until_ready(state.params)


def _val(tr, d):
  idx = mipu.validation_indices(len(tr.train_problems), tr.c.mipu.val_prompts, tr.step_seed(d, 5))
  return [tr.train_problems[i] for i in idx]


def _pair(k, j, truth, stat_shift, n_sub=(("128", 4), ("512", 1))):
  rng = np.random.default_rng(100 * k + j)
  by_n = {}
  for n, count in n_sub:
    by_n[n] = [
        {
            "t_post": -1e-3 + stat_shift + rng.normal(0, 1e-4),
            "t_post_se": 1e-4,
            "t_before": -1e-3 + rng.normal(0, 1e-4),
            "delta_t": stat_shift + rng.normal(0, 1e-4),
            "delta_t_se": 1e-4,
            "delta_j": truth + rng.normal(0, 1e-3),
            "delta_j_se": 1e-3,
        }
        for _ in range(count)
    ]
  return {
      "checkpoint": k,
      "candidate": j,
      "truth": truth,
      "truth_se": 1e-3,
      "j_before": 0.2,
      "j_after": 0.2 + truth,
      "by_n": by_n,
      "date": "2026-12-04 14:00 UTC",
      "cpu": "test",
      "plan": {"val_prompts": 64, "val_group": 8, "truth": 1024, "seed": 1},
  }


def test_auc_by_hand_and_report_regenerates(tmp_path):
  assert mipu_power_report.auc(np.array([3.0, 2.0, 1.0]), np.array([True, False, False])) == 1.0
  assert mipu_power_report.auc(np.array([1.0, 1.0, 0.0]), np.array([True, False, False])) == 0.75
  assert math.isnan(mipu_power_report.auc(np.array([1.0]), np.array([True])))
  for k in (0, 8):
    for j, truth in enumerate((-0.01, 0.01, 0.02, -0.02)):
      (tmp_path / f"k{k}_u{j}.json").write_text(json.dumps(_pair(k, j, truth, stat_shift=0.0)))
  (tmp_path / "docs").mkdir()
  doc = tmp_path / "docs" / "doc.md"
  doc.write_text(f"before\n{mipu_power_report.BEGIN}\nold\n{mipu_power_report.END}\nafter\n")
  md = mipu_power_report.report(str(tmp_path), doc=str(doc))
  text = doc.read_text()
  assert "old" not in text and md in text and text.startswith("before") and text.endswith("after\n")
  # delta_j carries the truth (noise 1e-3 against changes of 1e-2): AUC 1; delta_t is pure noise here
  row = next(line for line in md.splitlines() if line.startswith("| `delta_j` | 1.00"))
  assert row.count("1.00 [1.00, 1.00]") == 2
  # the plot is linked from where each file is: the doc's block and the study's summary.md
  tables, link = md.rsplit("\n\n", 1)
  assert link == "![ROC and SE vs n](../power.png)" and (tmp_path / "power.png").is_file()
  assert (tmp_path / "summary.md").read_text().endswith(tables + "\n\n![ROC and SE vs n](power.png)\n")


def test_power_study_statistics_on_a_coupled_draw():
  rng = np.random.default_rng(0)
  g = np.repeat(np.arange(4), 8)
  old = {"terms": rng.normal(size=32), "has": np.ones(32, bool), "group_ids": g, "rewards": rng.random(32)}
  old["tokens"] = rng.integers(0, 5, (32, 6))
  res = mipu_power.evaluate_pair(old, old, np.ones(10), np.ones(10), (8, 32))
  assert res["same_response_frac"] == 1.0
  new = {**old, "tokens": np.concatenate([old["tokens"][:8], old["tokens"][8:] + 1])}
  assert mipu_power.evaluate_pair(new, old, np.ones(10), np.ones(10), (32,))["same_response_frac"] == 0.25
  assert [len(res["by_n"][n]) for n in ("8", "32")] == [4, 1] and res["truth"] == 0.0
  assert all(d["delta_t"] == 0.0 and d["delta_j"] == 0.0 for d in res["by_n"]["8"])
  whole = res["by_n"]["32"][0]
  assert whole["t_post"] == pytest.approx(old["terms"].mean()) and whole["t_post"] == whole["t_before"]
  assert whole["group_share"] == 1.0  # every group of uniform rewards has a spread
  flat = {**old, "rewards": np.where(g < 3, 0.0, old["rewards"])}  # groups 0-2 all fail: no advantage
  assert mipu_power.evaluate_pair(flat, old, np.ones(10), np.ones(10), (32,))["by_n"]["32"][0]["group_share"] == 0.25


def test_auc_within_checkpoints_by_hand():
  """Checkpoint 0: the statistic ranks its two updates right; checkpoint 1: wrong; checkpoint 2: one side only. The
  pooled AUC also compares updates across checkpoints, whose statistic levels differ (a drifting T)."""
  pairs = []
  for k, (first, second) in enumerate(((-1.0, 1.0), (3.0, 2.0), (5.0, 6.0))):
    for j, (stat, truth) in enumerate(((first, -0.01 if k < 2 else 0.01), (second, 0.02))):
      pairs.append({"checkpoint": k, "candidate": j, "truth": truth, "by_n": {"8": [{"t_post": stat}]}})
  a = mipu_power_report.checkpoint_aucs(pairs, "t_post", "8", np.random.default_rng(0))
  assert a["per_checkpoint"][0] == 1.0 and a["per_checkpoint"][1] == 0.0 and math.isnan(a["per_checkpoint"][2])
  assert a["within"][0] == 0.5  # (1 + 0) / (1 + 1)
  # pooled: lowered -1, 3 against raised 1, 2, 5, 6: by -stat, -1 beats all four, 3 beats 5 and 6: 6 / 8
  assert a["pooled"][0] == pytest.approx(6 / 8)
  assert 0.0 <= a["within"][1] <= 0.5 <= a["within"][2] <= 1.0
  assert mipu_power_report.normalised_t(pairs) is None  # records from before group_share
  for p in pairs:
    p["by_n"]["8"][0]["group_share"] = 0.5
  norm = mipu_power_report.normalised_t(pairs)
  assert norm[0]["by_n"]["8"][0]["t_post_norm"] == -2.0
