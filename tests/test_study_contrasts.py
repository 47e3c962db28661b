"""The difference-in-differences contrasts of a study (`minpro_jax.study.contrasts`, issue 55) against a hand
computation on five made-up seeds; where they sit in summary.md; a grid's `contrasts` checked and carried into
study.json as a reporting field."""

import json
import os

import numpy as np
import pytest
from train_helpers import REPO

from minpro_jax.config_lib.files import load_module
from minpro_jax.study import __main__ as study_cli
from minpro_jax.study import aggregate, grid, runner
from minpro_jax.study.contrasts import difference_in_differences
from minpro_jax.study.grid import Grid

T_975_4 = 2.7764451051977987  # Student-t quantile, 4 degrees of freedom (tables)
FINAL = {  # (method, delay) -> final pass@1 of seeds 0..4
    ("minpro", 8): [0.10, 0.12, 0.08, 0.15, 0.11],
    ("grpo", 8): [0.20, 0.18, 0.19, 0.22, 0.17],
    ("minpro", 0): [0.15, 0.16, 0.12, 0.18, 0.14],
    ("grpo", 0): [0.21, 0.20, 0.22, 0.21, 0.19],
    ("cispo", 8): [0.05, 0.05, 0.05, 0.05, 0.05],  # no delay-0 partner: no contrast
}
# by hand: gaps at delay 8 [-.10, -.06, -.11, -.07, -.06], at delay 0 [-.06, -.04, -.10, -.03, -.05]; their
# differences [-.04, -.02, -.01, -.04, -.01]: mean -0.024, s = sqrt(0.00092 / 4) = 0.0151658, half-width
# t(0.975, 4) * s / sqrt(5) = 0.0188308
DID_FINAL = [-0.04, -0.02, -0.01, -0.04, -0.01]
MEAN, HALF = -0.024, 0.0188308


def _grid(seeds=(0, 1, 2, 3, 4)) -> Grid:
  return Grid(
      base="configs/default.py",
      axes={"loss.method": ["minpro", "grpo", "cispo"], "delay": [8]},
      cells=[{"loss.method": "minpro", "delay": 0}, {"loss.method": "grpo", "delay": 0}],
      seeds=seeds,
      comparisons=(("loss.method", "minpro"),),
      contrasts=(("loss.method", "grpo", "delay", 0),),
  )


def _per_run(runs, warm=lambda r: [0.5]):
  out = {}
  for r in runs:
    d = dict(r.cell)
    final = FINAL[(d["loss.method"], d["delay"])][r.seed]
    out[r.name] = {"warm_start": warm(r), "final": final, "peak": final + 0.01, "auc": final / 2, "best": final}
    out[r.name]["largest_drop"] = 0.0
  return out


def test_contrast_against_the_hand_computation_on_five_seeds():
  runs = grid.expand(_grid())
  (c,) = difference_in_differences(_per_run(runs), runs, _grid().contrasts)
  assert c["cell"] == "method-minpro_delay-8" and c["seeds"] == [0, 1, 2, 3, 4] and c["unpaired_seeds"] == []
  assert c["cells"] == ["method-minpro_delay-8", "method-grpo_delay-8", "method-minpro_delay-0", "method-grpo_delay-0"]
  assert c["label"] == "method: (minpro - grpo) at delay=8 - at delay=0"
  got = c["metrics"]["final"]
  np.testing.assert_allclose([got["mean"], got["low"], got["high"]], [MEAN, MEAN - HALF, MEAN + HALF], atol=1e-7)
  np.testing.assert_allclose(HALF, T_975_4 * np.std(DID_FINAL, ddof=1) / np.sqrt(5), atol=1e-7)
  np.testing.assert_allclose(c["metrics"]["peak"]["mean"], MEAN, atol=1e-12)  # a constant shift cancels
  np.testing.assert_allclose(
      [c["metrics"]["auc"][k] for k in ("mean", "low", "high")],
      np.divide([MEAN, MEAN - HALF, MEAN + HALF], 2),
      atol=1e-7,
  )
  boot = difference_in_differences(_per_run(runs), runs, _grid().contrasts, method="bootstrap")[0]["metrics"]["final"]
  f = [FINAL[k] for k in (("minpro", 8), ("grpo", 8), ("minpro", 0), ("grpo", 0))]
  did = [(a - b) - (c - e) for a, b, c, e in zip(*f)]  # as summed in float, for the (discrete) BCa bootstrap
  assert boot == aggregate.mean_ci(did, method="bootstrap").to_json()  # the study's other interval


def test_a_seed_whose_four_runs_do_not_share_a_warm_start_is_left_out():
  runs = grid.expand(_grid())
  other = lambda r: [0.7] if (r.seed == 4 and r.cell_name == "method-grpo_delay-0") else [0.5]  # noqa: E731
  per_run = _per_run(runs, other)
  del per_run["method-minpro_delay-0_seed-3"]  # seed 3 unfinished in one of the four cells
  (c,) = difference_in_differences(per_run, runs, _grid().contrasts)
  assert c["seeds"] == [0, 1, 2] and c["unpaired_seeds"] == [4]
  np.testing.assert_allclose(c["metrics"]["final"]["mean"], np.mean(DID_FINAL[:3]))
  md = "".join(f"{line}\n" for line in aggregate.contrasts_markdown([c], 95))
  # by hand: [-.04, -.02, -.01], mean -0.0233, half-width t(0.975, 2) 4.3027 * 0.015275 / sqrt(3) = 0.0379
  assert "| method: (minpro - grpo) at delay=8 - at delay=0 | 3 (+1) | -2.3 [-6.1, +1.5] | -2.3 [-6.1, +1.5] |" in md


def test_summary_places_the_contrasts_before_the_paired_differences_and_only_where_set(tmp_path):
  runs = grid.expand(_grid())
  per_run = _per_run(runs)
  base = {"level": 0.95, "interval_method": "t", "cells": [], "unfinished": []}
  paired = aggregate.paired_differences(per_run, runs, _grid().comparisons)
  contrasts = difference_in_differences(per_run, runs, _grid().contrasts)
  md = aggregate.to_markdown({**base, "paired": paired, "contrasts": contrasts})
  row = "| method: (minpro - grpo) at delay=8 - at delay=0 | 5 | -2.4 [-4.3, -0.5] * | -2.4 [-4.3, -0.5] * | -1.2 ["
  assert md.index(row) < md.index("Paired differences")
  assert "Contrasts" not in aggregate.to_markdown({**base, "paired": paired})


def test_grid_contrasts_are_checked_and_kept_in_study_json_as_a_reporting_field(tmp_path, capsys):
  for bad in [("loss.method", "grpo", "delay")], [("loss.method", "ppo", "delay", 0)], [("delay", 8, "delay", 0)]:
    with pytest.raises(grid.GridError, match=r"grid\.contrasts\[0\]: must be a \(field, reference value, across"):
      grid.check_grid(Grid(**{**_grid().__dict__, "contrasts": tuple(bad)}))
  g = _grid()
  runs = grid.expand(g)
  assert "contrasts" not in runner.study_record("x.py", Grid(**{**g.__dict__, "contrasts": ()}), runs)
  record = runner.study_record("x.py", g, runs)
  assert record["contrasts"] == [["loss.method", "grpo", "delay", 0]]
  study = str(tmp_path)
  runner.write_study(study, {k: v for k, v in record.items() if k != "contrasts"})  # written before contrasts
  study_cli._update_reporting_fields(study, record)
  assert runner.read_study(study) == record
  assert "updated study.json: the grid's contrasts" in capsys.readouterr().err
  study_cli._update_reporting_fields(study, {k: v for k, v in record.items() if k != "contrasts"})  # dropped again
  assert "contrasts" not in json.load(open(f"{study}/study.json"))


def test_the_long_grids_contrast_every_objective_with_grpo_across_delay(monkeypatch):
  """Stage 2 of configs/studies/minpro_long.py (issue 55): its primary estimand, per objective and delay > 0."""
  long = load_module(os.path.join(REPO, "configs", "studies", "minpro_long.py"))
  monkeypatch.setattr(long, "CHOSEN_RATES", {k: 1e-5 for k in long.OBJECTIVES})
  g = long.get_grid("stage2")
  grid.check_grid(g)
  assert g.contrasts == (("variant", "grpo", "delay", 0),)
  runs = grid.expand(g)
  per_run = {r.name: {"warm_start": [r.seed], "peak": 0.2, "final": 0.1 * r.seed, "auc": 0.1} for r in runs}
  got = difference_in_differences(per_run, runs, g.contrasts)
  want = [f"variant-{v}_delay-{d}" for v in long.OBJECTIVES if v != "grpo" for d in (2, 8)]
  assert [c["cell"] for c in got] == want and all(c["seeds"] == list(long.SEEDS) for c in got)
  assert got[0]["label"] == "variant: (minpro - grpo) at delay=2 - at delay=0"
  assert all(c["metrics"]["final"]["mean"] == 0 for c in got)
