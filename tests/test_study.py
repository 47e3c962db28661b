"""The study runner (minpro_jax/study/): intervals and per-run figures against hand computations, grid expansion
and naming (the grid files: test_study_grids.py), the study.json guard, skip-finished logic, the executor's failures
and signals, the dry run, the aggregation outputs; and (slow) the smoke grid end to end: dry run, a run stopped and
restarted, aggregation."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from train_helpers import REPO, cli_env

from minpro_jax.config_lib import files
from minpro_jax.config_lib.files import load_module
from minpro_jax.study import __main__ as study_cli
from minpro_jax.study import aggregate, commands, grid, runner
from minpro_jax.study.aggregate import Interval, curve_auc, eval_curve, falls_below, largest_drop, mean_ci
from minpro_jax.study.grid import Grid, Run

SMOKE = os.path.join(REPO, "configs", "studies", "smoke.py")
LONG = os.path.join(REPO, "configs", "studies", "minpro_long.py")
MIPU_LONG = os.path.join(REPO, "configs", "studies", "mipu_long.py")
minpro_long, mipu_long = map(load_module, (LONG, MIPU_LONG))
T_975 = {1: 12.706204736174698, 2: 4.302652729749462, 3: 3.182446305284263}  # Student-t quantiles (tables)


# ------------------------------------------------------------------------------------------------ intervals
def test_t_interval_matches_the_hand_computation():
  iv = mean_ci([1.0, 2.0, 3.0, 4.0])
  half = T_975[3] * math.sqrt(5 / 3) / 2  # s^2 = 5/3 (ddof 1), n = 4
  assert iv.mean == 2.5 and iv.n == 4 and iv.method == "t"
  np.testing.assert_allclose([iv.low, iv.high], [2.5 - half, 2.5 + half], rtol=1e-12)
  np.testing.assert_allclose([iv.low, iv.high], [0.44573974, 4.55426026], rtol=1e-7)
  iv3 = mean_ci([0.20, 0.25, 0.24])  # three seeds: t_{0.975, 2} = 4.30
  s = np.std([0.20, 0.25, 0.24], ddof=1)
  np.testing.assert_allclose(iv3.high - iv3.mean, T_975[2] * s / math.sqrt(3), rtol=1e-12)


def test_one_value_has_no_interval_and_constant_values_a_zero_width_one():
  for method in ("t", "bootstrap"):
    one = mean_ci([0.3], method=method)
    assert (one.mean, one.low, one.high, one.n) == (0.3, None, None, 1) and not one.excludes(0.0)
    const = mean_ci([0.25, 0.25, 0.25], method=method)
    assert (const.low, const.high) == (0.25, 0.25)


def test_bootstrap_of_large_normal_data_is_close_to_the_analytic_interval_and_deterministic():
  x = np.random.default_rng(7).normal(0.3, 0.05, size=400)
  iv = mean_ci(x, method="bootstrap")
  half = 1.959963984540054 * x.std(ddof=1) / math.sqrt(x.size)
  assert iv.mean == pytest.approx(x.mean(), abs=1e-15)
  assert iv.low == pytest.approx(x.mean() - half, abs=0.1 * half)
  assert iv.high == pytest.approx(x.mean() + half, abs=0.1 * half)
  assert mean_ci(x, method="bootstrap") == iv  # seeded: the same files give the same summary
  # at n = 4 the bootstrap is far narrower than the t-interval (why t is the default)
  b, t = mean_ci([1.0, 2.0, 3.0, 4.0], method="bootstrap"), mean_ci([1.0, 2.0, 3.0, 4.0])
  assert t.high - t.low > 1.8 * (b.high - b.low)


@pytest.mark.parametrize(
    "values, kw, match",
    [
        ([], {}, "no values"),
        ([0.1, float("nan")], {}, "finite"),
        ([1, 2], {"method": "z"}, "method"),
        ([1, 2], {"level": 1.0}, "level"),
    ],
)
def test_mean_ci_refuses_bad_input(values, kw, match):
  with pytest.raises(ValueError, match=match):
    mean_ci(values, **kw)


# ------------------------------------------------------------------------------------------------ one run
CURVE = [(0, 0.10), (10, 0.30), (20, 0.20), (40, 0.20)]


def test_curve_figures_on_a_hand_made_curve():
  assert curve_auc(CURVE) == pytest.approx((0.2 * 10 + 0.25 * 10 + 0.2 * 20) / 40)  # 0.2125
  assert largest_drop(CURVE) == pytest.approx(0.10)
  assert largest_drop([(0, 0.1), (5, 0.2), (10, 0.3)]) == 0.0
  assert not falls_below(CURVE, 0.10) and falls_below(CURVE + [(50, 0.05)], 0.10)
  assert aggregate.fall_rate(CURVE) == pytest.approx(1 / 3)  # 0.3 -> 0.2 falls; 0.2 -> 0.2 does not
  assert aggregate.fall_rate([(0, 0.1)]) == 0.0
  assert curve_auc([(0, 0.4)]) == 0.4
  with pytest.raises(ValueError, match="increase"):
    curve_auc([(0, 0.1), (0, 0.2)])


def _records(curve, total):
  """metrics.jsonl records of a run with this held-out curve: step 0 logged as -1, step s as s - 1, the final as
  total_steps; training records without evaluations in between."""
  recs = []
  for s, y in curve:
    recs.append({"step": s - 1 if s < total else total, "eval/pass@1": y, "eval/avg_score": y})
  recs.insert(1, {"step": 0, "reward/mean": 0.5})
  return recs


def _summary(curve, total, delay=0):
  best = max(curve, key=lambda sy: (sy[1], -sy[0]))  # the first evaluation with the highest pass@1
  return {
      "config": {"total_steps": total, "delay": delay},
      "eval_after_sft": {"pass@1": curve[0][1]},
      "eval_final": {"pass@1": curve[-1][1]},
      "best": {"score": best[1], "step": best[0]},
  }


def test_eval_curve_maps_logged_steps_to_policy_steps():
  assert eval_curve(_records(CURVE, 40), 40) == CURVE
  with pytest.raises(ValueError, match="two evaluations at policy step 10"):
    eval_curve(_records(CURVE, 40) + [{"step": 9, "eval/pass@1": 0.3}], 40)


def test_run_metrics_and_files_of_two_runs():
  m = aggregate.run_metrics(_summary(CURVE, 40), _records(CURVE, 40))
  assert m["initial"] == 0.10 and m["best"] == 0.30 and m["best_step"] == 10 and m["final"] == 0.20
  assert m["peak"] == 0.30 and m["learning_curve"] == [list(p) for p in CURVE]  # delay 0: every evaluation
  assert m["auc"] == pytest.approx(0.2125) and m["largest_drop"] == pytest.approx(0.1) and not m["below_initial"]
  assert m["fall_rate"] == pytest.approx(1 / 3) and m["rollback_rate"] is None and m["k3_mean"] is None
  # a MIPU run: its rollback share from summary.json, K3 averaged over the steps that log it, rollbacks per check
  mipu_summary = {**_summary(CURVE, 40), "mipu": {"checks": 4, "rollbacks": 1}}
  recs = _records(CURVE, 40)
  recs[1].update({"sampler_learner/mismatch_k3": 2e-5, "mipu/accepted": 1})
  recs.insert(2, {"step": 1, "sampler_learner/mismatch_k3": 4e-5, "mipu/accepted": 0})
  m = aggregate.run_metrics(mipu_summary, recs)
  assert m["rollback_rate"] == 0.25 and m["k3_mean"] == pytest.approx(3e-5) and m["rollbacks"] == [[0, 0], [1, 1]]
  bad = _summary(CURVE, 40)
  bad["eval_final"]["pass@1"] = 0.5
  with pytest.raises(ValueError, match="eval_final pass@1 0.5 differs"):
    aggregate.run_metrics(bad, _records(CURVE, 40))
  with pytest.raises(ValueError, match="from policy step 0 to total_steps=40"):
    aggregate.run_metrics(_summary(CURVE, 40), _records(CURVE[:-1], 40))


# ------------------------------------------------------------------------------------------------ cells
def _ablation_grid(seeds=(0, 1, 2)):
  return Grid(
      base="configs/default.py",
      axes={"loss.method": ["minpro", "grpo"], "delay": [0, 16]},
      cells=[{"loss.method": "minpro", "delay": 16, "loss.prefix_statistic": "mean"}],
      seeds=seeds,
      comparisons=(("loss.method", "minpro"), ("loss.prefix_statistic", "min")),
      panel="delay",
  )


def _metrics(best, final=None, warm_start=(0.5, 0.1)):
  final = best if final is None else final
  return {
      "warm_start": list(warm_start),
      "initial": 0.1,
      "best": best,
      "peak": best,
      "final": final,
      "auc": best,
      "largest_drop": 0.0,
      "fall_rate": 0.0,
      "below_initial": False,
  }


def test_paired_differences_on_the_same_seeds():
  runs = grid.expand(_ablation_grid())
  best = {  # (cell name, seed) -> best
      ("method-minpro_delay-16", 0): 0.30,
      ("method-minpro_delay-16", 1): 0.32,
      ("method-minpro_delay-16", 2): 0.28,
      ("method-grpo_delay-16", 0): 0.20,
      ("method-grpo_delay-16", 1): 0.25,
      ("method-grpo_delay-16", 2): 0.24,
      ("method-minpro_delay-16_prefix_statistic-mean", 0): 0.29,
      ("method-minpro_delay-16_prefix_statistic-mean", 1): 0.31,
  }  # the prefix ablation lacks seed 2; the delay-0 cells have no result at all
  per_run = {r.name: _metrics(best[(r.cell_name, r.seed)]) for r in runs if (r.cell_name, r.seed) in best}
  paired = {p["cell"]: p for p in aggregate.paired_differences(per_run, runs, _ablation_grid().comparisons)}
  assert set(paired) == {"method-grpo_delay-16", "method-minpro_delay-16_prefix_statistic-mean"}
  g = paired["method-grpo_delay-16"]
  assert g["reference_cell"] == "method-minpro_delay-16" and g["seeds"] == [0, 1, 2]
  assert g["label"] == "method: minpro - grpo (delay=16)"
  d = np.asarray([0.10, 0.07, 0.04])
  half = T_975[2] * d.std(ddof=1) / math.sqrt(3)
  got = g["metrics"]["best"]
  np.testing.assert_allclose([got["mean"], got["low"], got["high"]], [d.mean(), d.mean() - half, d.mean() + half])
  # three positive differences, yet 0.07 +- 0.0745 includes 0: with 3 seeds t_{0.975, 2} = 4.30 is wide
  assert not Interval(**got).excludes(0.0) and Interval(**got).excludes(-0.01)
  # the ablation pairs with the MinPRO cell that leaves prefix_statistic at its default, on the 2 seeds both ran
  a = paired["method-minpro_delay-16_prefix_statistic-mean"]
  assert a["reference_cell"] == "method-minpro_delay-16" and a["seeds"] == [0, 1]
  np.testing.assert_allclose(a["metrics"]["best"]["mean"], 0.01)
  # a (field, reference, values) triple keeps the cells of those values alone: grpo - minpro, not the ablation
  only = aggregate.paired_differences(per_run, runs, [("loss.method", "grpo", ("minpro",))])
  assert [(p["reference_cell"], p["cell"]) for p in only] == [("method-grpo_delay-16", "method-minpro_delay-16")]
  np.testing.assert_allclose(only[0]["metrics"]["best"]["mean"], -0.07)


def test_runs_of_one_seed_from_different_warm_starts_are_not_paired():
  """A grid continued on another CPU type: seed 1 of the grpo cell started from another SFT result."""
  runs = grid.expand(_ablation_grid())
  per_run = {}
  for r in runs:
    if r.cell_name in ("method-minpro_delay-16", "method-grpo_delay-16"):
      other = r.cell_name == "method-grpo_delay-16" and r.seed == 1
      per_run[r.name] = _metrics(
          0.3 - 0.1 * (r.cell_name == "method-grpo_delay-16"), warm_start=(0.56, 0.12) if other else (0.62, 0.08)
      )
  (g,) = [
      p
      for p in aggregate.paired_differences(per_run, runs, _ablation_grid().comparisons)
      if p["cell"] == "method-grpo_delay-16"
  ]
  assert g["seeds"] == [0, 2] and g["unpaired_seeds"] == [1]
  md = aggregate.to_markdown({"level": 0.95, "interval_method": "t", "cells": [], "paired": [g], "unfinished": []})
  assert "| method: minpro - grpo (delay=16) | 2 (+1) |" in md
  summary = _summary(CURVE, 40)
  assert aggregate.run_metrics(summary, _records(CURVE, 40))["warm_start"] == [None, 0.10]  # no SFT
  summary["sft"] = {"final_loss": 0.62}  # the SFT loss alone: an fp8 and an fp32 sampler evaluate it differently
  assert aggregate.run_metrics(summary, _records(CURVE, 40))["warm_start"] == [0.62]


def test_cell_stats_one_seed_cell_has_no_interval():
  runs = grid.expand(_ablation_grid(seeds=(0, 1)))
  per_run = {r.name: _metrics(0.2 + 0.01 * r.seed) for r in runs if r.cell_name != "method-grpo_delay-0" or r.seed == 0}
  cells = {c["cell"]: c for c in aggregate.cell_stats(per_run, runs)}
  one = cells["method-grpo_delay-0"]
  assert one["seeds"] == [0] and one["missing_seeds"] == [1]
  assert one["metrics"]["best"]["low"] is None and one["metrics"]["best"]["high"] is None
  two = cells["method-minpro_delay-0"]["metrics"]["best"]
  np.testing.assert_allclose([two["mean"], two["high"] - two["mean"]], [0.205, T_975[1] * 0.01 / 2])  # s = .01/sqrt 2
  md = aggregate.to_markdown(
      {"level": 0.95, "interval_method": "t", "cells": list(cells.values()), "paired": [], "unfinished": []}
  )
  assert "| method=grpo, delay=0 | 1 (+1 unfinished) | 10.0 (n=1) | 20.0 (n=1) |" in md


# ------------------------------------------------------------------------------------------------ grids
def test_grid_expansion_names_and_order():
  runs = grid.expand(_ablation_grid(seeds=(0, 1)))
  assert [r.name for r in runs[:5]] == [
      "method-minpro_delay-0_seed-0",
      "method-minpro_delay-16_seed-0",
      "method-grpo_delay-0_seed-0",
      "method-grpo_delay-16_seed-0",
      "method-minpro_delay-16_prefix_statistic-mean_seed-0",
  ]  # seed-major: every cell at seed 0 first
  assert runs[3].label == "loss.method=grpo,delay=16,seed=0" and runs[3].cell_name == "method-grpo_delay-16"
  assert len(runs) == 10 and runs[5].seed == 1
  assert Run.from_json(json.loads(json.dumps(runs[4].to_json()))) == runs[4]
  assert grid.short_names(["a.lr", "b.lr", "delay"]) == {"a.lr": "a.lr", "b.lr": "b.lr", "delay": "delay"}


# ------------------------------------------------------------------------------------------------ workdir
def test_study_json_of_another_grid_is_refused_unless_forced(tmp_path):
  g = grid.load_grid(SMOKE)
  rec = runner.study_record(SMOKE, g, grid.expand(g))
  runner.check_study(str(tmp_path), rec)  # nothing stored yet
  runner.write_study(str(tmp_path), rec)
  runner.check_study(str(tmp_path), rec)  # the same grid
  g2 = grid.load_grid(SMOKE + ":2")
  rec2 = runner.study_record(SMOKE + ":2", g2, grid.expand(g2))
  with pytest.raises(
      runner.StudyError, match=r"holds the study of --grid=.*smoke.py with other runs \(4 run\(s\) only here .*--force"
  ):
    runner.check_study(str(tmp_path), rec2)
  runner.check_study(str(tmp_path), rec2, force=True)
  rec3 = json.loads(json.dumps(rec))
  rec3["fixed"]["total_steps"] = 9
  with pytest.raises(runner.StudyError, match=r"fixed total_steps: 3 there, 9 here"):
    runner.check_study(str(tmp_path), rec3)


def test_paths_into_the_configs_old_folder_name_the_moved_files(tmp_path, capsys):
  """Issue 39 moved `minpro_jax/configs/` to `configs/`: a study.json written before (its base and grid paths) is
  the same study, its grid still loads, the trainer still reads an old --config path, and config files that share
  settings see one module (a test's monkeypatch reaches them)."""
  from minpro_jax.config_lib.parse import parse_config

  assert files.canonical("minpro_jax/configs/default.py") == "configs/default.py"
  assert files.canonical("/r/minpro_jax/configs/studies/x.py:stage1") == "/r/configs/studies/x.py:stage1"
  assert files.canonical("./minpro_jax/configs/mipu.py:tis") == "./configs/mipu.py:tis"
  for same in ("configs/default.py", "/r/my_minpro_jax/configs/a.py", "minpro_jax/configsx/a.py"):
    assert files.canonical(same) == same
  assert files.resolve("minpro_jax/configs/default.py") == os.path.join(REPO, "configs", "default.py")
  assert files.resolve("minpro_jax/configs/nonexistent.py") is None
  g = grid.load_grid(os.path.join(REPO, "minpro_jax", "configs", "studies", "smoke.py"))
  assert g.base == "configs/default.py"
  rec = runner.study_record(SMOKE, g, grid.expand(g))
  old = {**rec, "grid": "minpro_jax/configs/studies/smoke.py", "base": "minpro_jax/configs/default.py"}
  runner.write_study(str(tmp_path), old)
  runner.check_study(str(tmp_path), rec)  # the same study under its old paths
  assert runner.study_differences({**old, "base": "minpro_jax/configs/mipu.py"}, rec) == [
      "base config 'minpro_jax/configs/mipu.py' there, 'configs/default.py' here"
  ]
  c = parse_config(["x", "--config=minpro_jax/configs/mipu.py:tis"])
  assert (c.loss.rollout_is, c.mipu.rollback) == ("token", False)
  assert "the configs moved to configs/; reading " + os.path.join(REPO, "configs", "mipu.py") in capsys.readouterr().err
  assert files.load_module(LONG) is minpro_long and mipu_long.long is minpro_long
  assert files.load_module("minpro_long.py", relative_to=MIPU_LONG) is minpro_long
  with pytest.raises(FileNotFoundError, match="config file 'nope.py': not found"):
    files.load_module("nope.py", relative_to=MIPU_LONG)


def test_one_runner_per_study_workdir(tmp_path):
  held = runner.lock_study(str(tmp_path))
  with pytest.raises(runner.StudyError, match=rf"another study runner \(pid {os.getpid()}\) is using it"):
    runner.lock_study(str(tmp_path))
  held.close()  # the runner exits
  runner.lock_study(str(tmp_path)).close()


def test_run_status_of_fake_workdirs(tmp_path):
  """A run is done when its summary.json reads back, whatever config it holds: a finished run is never compared with
  today's defaults (the study is a record of its commit)."""
  assert runner.run_status(str(tmp_path / "nothing")) == "new"
  (tmp_path / "p").mkdir()
  (tmp_path / "p" / "metrics.jsonl").write_text('{"step": -1}\n')
  assert runner.run_status(str(tmp_path / "p")) == "partial"
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "summary.json").write_text(json.dumps({"config": {"total_steps": 3, "no_longer_a_field": 1}}))
  assert runner.run_status(str(tmp_path / "d")) == "done"
  (tmp_path / "d" / "summary.json").write_text("{")
  assert runner.run_status(str(tmp_path / "d")) == "partial"


def _job(tmp_path, name, code):
  return runner.Job(name, [sys.executable, "-c", code], str(tmp_path / name))


def _ok_job(tmp_path, name, sleep):
  """A job that records when it ran in times.txt and writes a summary.json."""
  d = str(tmp_path / name)
  code = (
      f"import json, os, time; t0 = time.time(); time.sleep({sleep}); "
      f"open(os.path.join({d!r}, 'times.txt'), 'w').write(f'{{t0}} {{time.time()}}'); "
      f"json.dump({{}}, open(os.path.join({d!r}, 'summary.json'), 'w'))"
  )
  return _job(tmp_path, name, code)


def test_a_study_is_a_record_of_its_commit(tmp_path):
  """study.json records the commit and the resolved base config; a study with runs left is refused at another
  commit (naming the worktree command) unless continued at head, which is recorded; a finished study is not."""
  g = grid.load_grid(SMOKE)
  runs = grid.expand(g)
  base = commands.resolved_base(g)
  assert base["loss"]["method"] == "minpro" and "sampling" in base  # every field of the base config, resolved
  rec = runner.study_record(SMOKE, g, runs, "a" * 40, base)
  assert (rec["commit"], rec["base_config"]["seed"]) == ("a" * 40, base["seed"])
  runner.check_commit(str(tmp_path), rec, "a" * 40, left=3)  # the same commit: goes on
  runner.check_commit(str(tmp_path), rec, "b" * 40, left=0)  # every run done: nothing to launch
  with pytest.raises(runner.StudyError) as e:
    runner.check_commit(str(tmp_path), rec, "b" * 40, left=3)
  msg = str(e.value)
  assert f"a study of commit {'a' * 40}, with 3 run(s) left, and this code is at {'b' * 40}" in msg
  assert f"git worktree add /tmp/study-aaaaaaaa {'a' * 40}" in msg and "--continue-at-head" in msg
  with pytest.raises(runner.StudyError, match=r"commit a+\+dirty"):  # uncommitted code is no record
    runner.check_commit(str(tmp_path), {**rec, "commit": "a" * 40 + "+dirty"}, "a" * 40 + "+dirty", left=1)
  old = {k: v for k, v in rec.items() if k not in ("commit", "base_config")}  # a study.json from before records
  with pytest.raises(runner.StudyError, match=r"a commit it did not record \(a study from before 2026-12-07\)"):
    runner.check_commit(str(tmp_path), old, "b" * 40, left=1)
  # --continue-at-head: the launch is recorded; the study keeps its commit and base config
  later = runner.record_launch(rec, runner.study_record(SMOKE, g, runs, "b" * 40, {"x": 1}), "b" * 40, ["r1"])
  assert (later["commit"], later["base_config"]) == (rec["commit"], rec["base_config"])
  assert [(x["commit"], x["runs"]) for x in later["launches"]] == [("b" * 40, ["r1"])]
  runner.check_commit(str(tmp_path), later, "b" * 40, left=2)  # continued at b before: b goes on
  assert runner.record_launch(None, rec, "a" * 40, ["r1"]) == rec  # a new study: its own record
  assert "launches" not in runner.record_launch(rec, rec, "a" * 40, ["r1"])  # a launch at the study's commit


def test_a_field_added_to_the_defaults_changes_no_committed_study(monkeypatch, capsys):
  """Issue 56: a new, unset config field is not a reason to relaunch, refuse or re-validate a finished study."""
  from minpro_jax.config_lib import defaults

  real = defaults.base_config

  def with_new_field():
    c = real()
    c.loss.brand_new_coefficient = 0.0
    return c

  monkeypatch.setattr(defaults, "base_config", with_new_field)
  workdir = os.path.join(REPO, "results", "mipu")
  spec = json.load(open(os.path.join(workdir, "study.json")))["grid"]
  assert study_cli.main([f"--grid={os.path.join(REPO, spec)}", f"--workdir={workdir}", "--dry-run"]) == 0
  out = capsys.readouterr().out
  assert "24 done (skipped), 0 partial (resumed), 0 new" in out and "--config.loss.brand_new_coefficient" not in out


def test_executor_runs_jobs_at_once_records_failures_and_goes_on(tmp_path):
  lines = []
  ex = runner.Executor(jobs=2, log=lines.append, study_log=str(tmp_path / "study.log"), poll_s=0.02)
  fail = _job(tmp_path, "b", "import sys; print('error: config.x: bad; fix it'); sys.exit(2)")
  out = ex.run([_ok_job(tmp_path, "a", 2.0), fail, _ok_job(tmp_path, "c", 0.1)])
  assert [o.status for o in out] == ["done", "failed", "done"]
  assert out[1].returncode == 2 and out[1].message.startswith("error: config.x: bad; fix it (see ")
  a0, a1 = map(float, (tmp_path / "a" / "times.txt").read_text().split())
  c0, _ = map(float, (tmp_path / "c" / "times.txt").read_text().split())
  assert a0 < c0 < a1  # two at once: c took b's place while a was still running
  log = (tmp_path / "b" / "study.log").read_text()
  assert "=== " in log and "launch: " in log and "error: config.x: bad" in log and "exit 2" in log
  assert "failed   b" in (tmp_path / "study.log").read_text()


def test_executor_stops_children_on_sigterm(tmp_path):
  child = (
      "import signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))\n"
      "print('started', flush=True)\n"
      "time.sleep(30)\n"
  )
  ex = runner.Executor(jobs=1, log=lambda s: None, poll_s=0.02)
  timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
  timer.start()
  t0 = time.time()
  out = ex.run([_job(tmp_path, "a", child), _job(tmp_path, "b", child)])
  timer.cancel()
  assert time.time() - t0 < 10 and ex.stop_signal == signal.SIGTERM
  assert [o.status for o in out] == ["stopped", "not started"] and out[0].returncode == 143
  assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------------------ the CLI
def test_dry_run_prints_every_run_and_writes_nothing(tmp_path, capsys):
  wd = tmp_path / "study"
  assert study_cli.main([f"--grid={SMOKE}:2", f"--workdir={wd}", "--dry-run"]) == 0
  out = capsys.readouterr().out
  assert "8 run(s), 8 selected" in out and out.count("\nnew      method-") == 8
  assert "--config.loss.method=grpo --config.delay=1 --config.seed=1" in out
  assert "8 new; dry run: nothing was written" in out and not wd.exists()
  assert study_cli.main([f"--grid={SMOKE}", f"--workdir={wd}", "--dry-run", "--only=method-grpo"]) == 0
  assert "2 selected" in capsys.readouterr().out
  assert study_cli.main([f"--grid={SMOKE}", f"--workdir={wd}", "--dry-run", "--only=nope"]) == 2
  assert "error: --only=nope: no run's name or label contains it" in capsys.readouterr().err


def test_with_a_delay_only_evaluations_of_updated_policies_count():
  # delay 10: policy steps 0..10 are the initial policy; 0.05 at step 5 and 0.12 at step 10 are evaluation noise
  curve = [(0, 0.10), (5, 0.05), (10, 0.12), (20, 0.20), (30, 0.15), (40, 0.20)]
  assert aggregate.learning_curve(curve, 10) == [(0, 0.10), (10, 0.20), (20, 0.15), (30, 0.20)]
  m = aggregate.run_metrics(_summary(curve, 40, delay=10), _records(curve, 40))
  assert m["best"] == 0.20 and m["best_step"] == 20 and m["peak"] == 0.20
  assert m["auc"] == pytest.approx((0.15 * 10 + 0.175 * 10 + 0.175 * 10) / 30)
  assert m["largest_drop"] == pytest.approx(0.05) and not m["below_initial"]  # not 0.10 -> 0.05, which is noise
  m = aggregate.run_metrics(_summary(curve[:3], 10, delay=10), _records(curve[:3], 10))  # no update at all
  assert (m["peak"], m["auc"], m["largest_drop"], m["below_initial"]) == (0.10, 0.10, 0.0, False)


def test_training_dynamics_by_hand():
  """Steps to collapse (5 points below the initial), the train-accuracy AUC on the learning curve's axis, the
  by-position profiles averaged over steps (bins a step did not reach skipped) and over a cell's runs."""
  from minpro_jax.study import dynamics

  assert dynamics.steps_to_collapse([(0, 0.20), (4, 0.17), (8, 0.15), (12, 0.02)]) == 8  # 0.15 = 0.20 - 0.05
  assert dynamics.steps_to_collapse([(0, 0.20), (4, 0.16), (8, 0.25)]) is None
  recs = [
      {"step": 0, "reward/accuracy": 0.1},  # delay 2: steps 0, 1 sample the initial policy
      {"step": 1, "reward/accuracy": 0.1},
      {"step": 2, "reward/accuracy": 0.2, "learn/abs_log_ratio_by_position_bin": [0.1, 0.3, None]},
      {
          "step": 3,
          "reward/accuracy": 0.4,
          "learn/abs_log_ratio_by_position_bin": [0.3, None, None],
          "learn/weight_by_position_bin": [0.9, None, None],
      },
      {"step": 4, "reward/accuracy": 0.3, "eval/pass@1": 0.2},
  ]
  assert dynamics.train_curve(recs, delay=2) == [(0, 0.2), (1, 0.4), (2, 0.3)]
  run = dynamics.run_dynamics(recs, [(0, 0.2), (3, 0.1)], delay=2)
  assert run["train_auc"] == pytest.approx((0.3 + 0.35) / 2) and run["steps_to_collapse"] == 3
  assert run["abs_log_ratio_by_position"] == pytest.approx([0.2, 0.3, None])
  assert run["ess_frac_by_position"] is None  # a run that predates the ESS metric
  other = {"steps_to_collapse": None, "abs_log_ratio_by_position": [0.4, None, None], "ess_frac_by_position": None}
  cell = dynamics.cell_dynamics([run, other])
  assert cell["collapsed"] == 1 and cell["steps_to_collapse_mean"] == 3.0
  assert cell["abs_log_ratio_by_position"] == pytest.approx([0.3, 0.3, None]) and cell["ess_frac_by_position"] is None
  assert (
      run["weight_by_position"] == pytest.approx([0.9, None, None])
      and cell["weight_by_position"] == run["weight_by_position"]
  )  # the other run has no weights: the cell's profile is this run's
  lines = dynamics.dynamics_markdown([{"label": "m", "seeds": [0, 1], "metrics": {}, "dynamics": cell}], 95)
  assert "| m | - | 1/2 (3.0) | 0.300 | 0.300 | - | - |" in lines
  assert lines[-3:] == ["| cell | weight 0-7 |", "|---|---:|", "| m | 0.90 |"]  # only the bins with a weight
  assert not any("Per-update diagnostics" in x for x in lines) and "grad_cosine" not in run  # predates them
  # the per-update diagnostics: step means over the run (steps without one skipped), then over the cell's runs
  recs[2].update({"learn/ess/seq_is_frac": 0.5, "learn/grad_cosine": 0.2})
  recs[3].update({"learn/ess/seq_is_frac": 0.3, "learn/grad_cosine": None, "learn/ess/token_frac": 0.9})
  run = dynamics.run_dynamics(recs, [(0, 0.2), (3, 0.1)], delay=2)
  assert (run["ess_seq_is"], run["grad_cosine"], run["ess_token"], run.get("ess_seq")) == (0.4, 0.2, 0.9, None)
  cell = dynamics.cell_dynamics([run, {**other, "ess_seq_is": 0.2, "grad_cosine": 0.6}])
  assert cell["ess_seq_is"] == pytest.approx(0.3) and cell["grad_cosine"] == pytest.approx(0.4)
  lines = dynamics.dynamics_markdown([{"label": "m", "seeds": [0, 1], "metrics": {}, "dynamics": cell}], 95)
  at = next(i for i, x in enumerate(lines) if x.startswith("| cell | ESS tokens"))
  assert lines[at + 2] == "| m | 0.900 | - | 0.300 | 0.400 |"


def _fake_run(study_dir, run, curve, total):
  d = os.path.join(study_dir, run.name)
  os.makedirs(d)
  with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump(_summary(curve, total, delay=dict(run.cell)["delay"]), f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in _records(curve, total))


def test_aggregation_outputs_from_fake_run_files(tmp_path, capsys):
  g = grid.load_grid(SMOKE + ":2")
  runs = grid.expand(g)
  study = str(tmp_path)
  runner.write_study(study, runner.study_record(SMOKE + ":2", g, runs))
  finals = {}
  for i, r in enumerate(runs[:-1]):  # the last run is unfinished
    finals[r.name] = 0.1 + 0.01 * i
    _fake_run(study, r, [(0, 0.1), (2, 0.3 if r.seed else 0.05), (3, finals[r.name])], 3)
  assert study_cli.main([f"--workdir={study}", "--aggregate-only"]) == 0
  for name in ("summary.json", "summary.md", "curves.png", "bar_peak.png", "bar_final.png", "paired.png"):
    assert os.path.getsize(os.path.join(study, name)) > 0, name
  res = json.load(open(os.path.join(study, "summary.json")))
  assert res["unfinished"] == [runs[-1].name]
  cell = {c["cell"]: c for c in res["cells"]}["method-minpro_delay-0"]
  mine = [finals[r.name] for r in runs if r.cell_name == "method-minpro_delay-0"]
  assert cell["seeds"] == [0, 1] and cell["metrics"]["final"]["mean"] == pytest.approx(np.mean(mine))
  assert cell["below_initial"] == 1  # seed 0 dips to 0.05 < 0.1
  assert res["runs"][runs[0].name]["auc"] == pytest.approx((0.075 * 2 + (0.05 + 0.1) / 2) / 3)
  d1 = res["runs"]["method-minpro_delay-1_seed-0"]  # delay 1: policy steps 2, 3 are 1, 2 steps with updates
  assert d1["learning_curve"] == [[0, 0.1], [1, 0.05], [2, 0.11]]
  assert d1["auc"] == pytest.approx((0.075 + 0.08) / 2)
  assert cell["dynamics"]["collapsed"] == 1  # seed 0's 0.05 is 5 points below its initial 0.1
  md = open(os.path.join(study, "summary.md")).read()
  assert "| method=minpro, delay=0 | 2 |" in md and "method: minpro - grpo (delay=0)" in md
  assert "| method=minpro, delay=0 | - | 1/2 (2.0) |" in md
  # with --grid, the grid's reporting fields (changed since the study.json was written) go into study.json
  old = {**runner.read_study(study), "comparisons": [], "description": "old"}
  runner.write_study(study, old)
  capsys.readouterr()
  assert study_cli.main([f"--grid={SMOKE}:2", f"--workdir={study}", "--aggregate-only"]) == 0
  assert runner.read_study(study) == {
      **old,
      "comparisons": [list(c) for c in g.comparisons],
      "description": g.description,
  }
  assert "updated study.json: the grid's description, comparisons" in capsys.readouterr().err
  assert "method: minpro - grpo (delay=0)" in open(os.path.join(study, "summary.md")).read()


# ------------------------------------------------------------------------------------------------ end to end
def _study(args):
  return [sys.executable, "-m", "minpro_jax.study", f"--grid={SMOKE}", *args]


def _checkpointed_unfinished(wd):
  """Runs with a run checkpoint and no summary.json yet."""
  return [
      d.name
      for d in wd.glob("method-*")
      if not (d / "summary.json").exists() and any(c.name.isdigit() for c in d.glob("checkpoints/*"))
  ]


@pytest.mark.slow
@pytest.mark.xdist_group("study_smoke")  # its own group: the longest test of the file
def test_smoke_grid_end_to_end_stopped_and_restarted(tmp_path):
  """Dry run; a real run stopped by SIGTERM once its first run finished and its second checkpointed; a restart
  that skips the finished run and resumes the stopped one; an aggregation whose numbers are the runs' files'."""
  wd = tmp_path / "study"
  kw = dict(cwd=tmp_path, env=cli_env(), text=True)  # the runs' SFT, tokenizer and compilation caches: tmp_path/cache
  dry = subprocess.run(_study([f"--workdir={wd}", "--dry-run"]), capture_output=True, timeout=120, **kw)
  assert dry.returncode == 0, dry.stderr[-2000:]
  assert "0 partial (resumed), 4 new" in dry.stdout and not wd.exists()

  proc = subprocess.Popen(_study([f"--workdir={wd}"]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
  try:
    t0 = time.time()
    while not (list(wd.glob("*/summary.json")) and _checkpointed_unfinished(wd)):
      assert proc.poll() is None, proc.stdout.read()[-3000:]
      assert time.time() - t0 < 400, "no run finished and another checkpointed in time"
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  assert "stopped by signal 15" in out
  first_done = sorted(p.parent.name for p in wd.glob("*/summary.json"))
  stopped = _checkpointed_unfinished(wd)
  assert len(first_done) == 1 and len(stopped) == 1

  again = subprocess.run(_study([f"--workdir={wd}"]), capture_output=True, timeout=400, **kw)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert f"skip     {first_done[0]} (finished)" in again.stdout
  assert (wd / first_done[0] / "study.log").read_text().count("launch: ") == 1  # never relaunched
  log = (wd / stopped[0] / "study.log").read_text()
  assert log.count("launch: ") == 2 and "resumed from global step" in log
  runs = grid.expand(grid.load_grid(SMOKE))
  assert sorted(p.parent.name for p in wd.glob("*/summary.json")) == sorted(r.name for r in runs)
  res = json.loads((wd / "summary.json").read_text())
  assert res["unfinished"] == [] and len(res["cells"]) == 4 and len(res["paired"]) == 2
  for r in runs:
    s = json.loads((wd / r.name / "summary.json").read_text())
    got = res["runs"][r.name]
    want = (s["best"]["score"], s["eval_final"]["pass@1"], s["eval_after_sft"]["pass@1"])
    assert (got["best"], got["final"], got["initial"]) == want
    assert [p[0] for p in got["curve"]] == [0, 2, 3]
    assert [p[0] for p in got["learning_curve"]] == ([0, 2, 3] if dict(r.cell)["delay"] == 0 else [0, 1, 2])
    cell = {c["cell"]: c for c in res["cells"]}[r.cell_name]
    assert cell["metrics"]["final"]["mean"] == s["eval_final"]["pass@1"] and cell["metrics"]["final"]["low"] is None
  for name in ("summary.md", "curves.png", "bar_peak.png", "paired.png"):
    assert (wd / name).stat().st_size > 0
  # the aggregation alone, from the run files and study.json only
  cmd = [sys.executable, "-m", "minpro_jax.study", f"--workdir={wd}", "--aggregate-only"]
  only = subprocess.run(cmd, capture_output=True, timeout=60, **kw)
  assert only.returncode == 0, only.stderr[-2000:]
  assert json.loads((wd / "summary.json").read_text()) == res
