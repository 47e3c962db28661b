"""The study grid files (configs/studies/): each grid's runs, names and overrides as the study docs state them, the
long grids' stage arguments and placeholders, and a grid's mistakes named by field or variant."""

import functools
import json
import os

import pytest
from train_helpers import REPO

from minpro_jax.config_lib.files import load_module
from minpro_jax.run import config_checks, run_config
from minpro_jax.study import commands, grid, runner
from minpro_jax.study.grid import Grid, GridError

STALENESS = os.path.join(REPO, "configs", "studies", "minpro_staleness.py")
MIPU_GRID = os.path.join(REPO, "configs", "studies", "mipu.py")
LONG = os.path.join(REPO, "configs", "studies", "minpro_long.py")
MIPU_LONG = os.path.join(REPO, "configs", "studies", "mipu_long.py")
minpro_staleness, minpro_long, mipu_long = map(load_module, (STALENESS, LONG, MIPU_LONG))


def test_the_staleness_grid():
  g = grid.load_grid(STALENESS)
  runs = grid.expand(g)
  assert len(runs) == 72 and len({r.name for r in runs}) == 72
  cells = {r.cell_name for r in runs}
  assert len(cells) == 24 and "method-minpro_delay-16_prefix_statistic-geomean" in cells
  learn = minpro_staleness.LEARN_STEPS
  assert {dict(r.extra)["total_steps"] - dict(r.cell)["delay"] for r in runs} == {learn}  # equal updates per delay
  assert len(grid.expand(grid.load_grid(STALENESS + ":5"))) == 120
  planned = commands.plan(g, "/tmp/study", validate=False)  # every value reads back from the command line
  cfg = dict((r.name, c) for r, _, c in planned)["method-minpro_delay-16_prefix_statistic-prod_seed-2"]
  assert (cfg.loss.prefix_statistic, cfg.delay, cfg.total_steps, cfg.seed) == ("prod", 16, learn + 16, 2)
  assert cfg.num_updates_per_step == minpro_staleness.UPDATES_PER_STEP and cfg.data.task_config.min_terms == 3


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"axes": {"loss.methd": ["grpo"]}},
            r"grid\.axes: loss\.methd: the base config .* no such field; did you mean loss\.method\?",
        ),
        ({"axes": {"delay": ["8"]}}, r"grid\.axes: delay='8' is of type str, the config field takes type int"),
        (
            {"fixed": {"optimizer.learning_rate": "3e-4"}},
            r"grid\.fixed: optimizer\.learning_rate='3e-4' .* takes type float",
        ),
        ({"axes": {"seed": [0, 1]}}, r"grid\.axes: 'seed' is set by the runner"),
        ({"axes": {"delay": [0, 0]}}, r"grid\.axes: delay lists a value twice"),
        ({"axes": {"delay": [None]}}, r"delay=None .* leave the field out"),
        ({"cells": [{"delay": 0}], "axes": {"delay": [0]}}, r"grid\.cells\[0\]: \{'delay': 0\} is already a cell"),
        (
            {"comparisons": (("loss.method", "minpro"),)},
            r"grid\.comparisons\[0\]: 'loss.method' is no field of any cell",
        ),
        ({"axes": {"loss": ["x"]}}, r"grid\.axes: loss is a group of fields"),
        (
            {"comparisons": (("delay", 0, (2, 16)),)},
            r"grid\.comparisons\[0\]: the values compared must be a non-empty tuple of values of 'delay' \(\['0', '2'\]\)",
        ),
        ({"comparisons": (("delay", 0, 2),)}, r"grid\.comparisons\[0\]: the values compared must be"),
        ({"comparisons": (("delay", 0, 2, 3),)}, r"grid\.comparisons\[0\]: must be a \(field, reference value\) pair"),
    ],
)
def test_grid_mistakes_name_the_field(change, match):
  g = Grid(**{"base": "configs/default.py", "axes": {"delay": [0, 2]}, **change})
  with pytest.raises(GridError, match=match):
    grid.check_grid(g)
    commands.plan(g, "/tmp/study", validate=False)


def test_variants_are_a_named_first_axis_whose_overrides_reach_the_command():
  g = Grid(
      base="configs/default.py",
      variants={"plain": {}, "tis": {"loss.rollout_is": "token", "loss.tis_cap": 2.0}},
      axes={"delay": [0, 2]},
      cells=[{"variant": "tis", "delay": 8}],
      seeds=(3,),
      derived=lambda cell: {"total_steps": 10 + cell["seed"]} if cell["variant"] == "tis" else {},
      comparisons=(("variant", "plain"),),
  )
  grid.check_grid(g)
  runs = grid.expand(g)
  assert [dict(r.extra) for r in runs] == [{}, {}, {"total_steps": 13}, {"total_steps": 13}, {"total_steps": 13}]
  assert [r.name for r in runs] == [
      "variant-plain_delay-0_seed-3",
      "variant-plain_delay-2_seed-3",
      "variant-tis_delay-0_seed-3",
      "variant-tis_delay-2_seed-3",
      "variant-tis_delay-8_seed-3",
  ]
  cfg = {r.name: c for r, _, c in commands.plan(g, "/tmp/study", validate=False)}
  assert (cfg["variant-tis_delay-8_seed-3"].loss.rollout_is, cfg["variant-tis_delay-8_seed-3"].delay) == ("token", 8)
  assert cfg["variant-plain_delay-2_seed-3"].loss.rollout_is is None
  argv = commands.train_argv(g, runs[2], "/tmp/w")
  assert "--config.loss.rollout_is=token" in argv and not any("variant" in a for a in argv)
  # study.json records the variants: changing one is another study
  rec = runner.study_record("g.py", g, runs)
  rec2 = json.loads(json.dumps(rec))
  rec2["variants"]["tis"]["loss.tis_cap"] = 3.0
  assert runner.study_differences(rec, rec2) == [
      "variant tis: {'loss.rollout_is': 'token', 'loss.tis_cap': 2.0} there, "
      "{'loss.rollout_is': 'token', 'loss.tis_cap': 3.0} here"
  ]


def test_the_mipu_grid():
  g = grid.load_grid(MIPU_GRID)
  planned = {r.name: c for r, _, c in commands.plan(g, "/tmp/study", validate=False)}
  assert len(planned) == 24 and list(planned)[:2] == ["variant-fp32_seed-1", "variant-grpo_seed-1"]
  fp32, tis, rnd = (planned[f"variant-{v}_seed-2"] for v in ("fp32", "tis", "random"))
  assert fp32.sampling.precision == "fp32" and fp32.loss.rollout_is is None and not fp32.mipu.rollback
  assert (tis.sampling.precision, tis.sampling.fp8_activations, tis.loss.rollout_is) == ("fp8", "tensor", "token")
  assert (rnd.mipu.mode, rnd.mipu.match_rate_of, rnd.loss.method) == ("random", "variant-mipu_seed-2", "grpo")
  names = list(planned)
  assert names.index("variant-mipu_seed-2") < names.index("variant-random_seed-2")  # its rate exists by then
  assert planned["variant-lr-decay_seed-1"].optimizer.lr_decay_on_length_surge


def test_the_mipu_delta_j_grid():
  g = grid.load_grid(os.path.join(REPO, "configs", "studies", "mipu_delta_j.py"))
  planned = {r.name: c for r, _, c in commands.plan(g, "/tmp/study", validate=False)}
  assert list(planned)[:3] == ["variant-grpo_seed-1", "variant-mipu-dj_seed-1", "variant-random_seed-1"]
  assert len(planned) == 15 and list(planned)[-1] == "variant-random_seed-5"
  base, dj, rnd = (planned[f"variant-{v}_seed-4"] for v in ("grpo", "mipu-dj", "random"))
  assert (base.sampling.precision, base.sampling.fp8_format, base.loss.rollout_is, base.mipu.rollback) == (
      "fp8",
      "e5m2",
      None,
      False,
  )
  m = dj.mipu
  assert (m.rollback, m.mode, m.statistic, m.tolerance, m.gap_tolerance) == (True, "gap", "delta_j", "fixed", 0.0)
  assert (m.val_prompts * m.val_group_size, dj.loss.rollout_is, dj.loss.tis_cap) == (512, "token", 2.0)
  assert (rnd.mipu.mode, rnd.mipu.match_rate_of, rnd.loss.rollout_is) == ("random", "variant-mipu-dj_seed-4", "token")
  for c in (base, dj, rnd):  # the MIPU study's setting
    assert (c.num_updates_per_step, c.prompts_per_step, c.total_steps, c.loss.method) == (8, 32, 32, "grpo")


def test_the_long_staleness_grid_stage0_and_its_placeholder_rate(monkeypatch):
  planned = {r.name: c for r, _, c in commands.plan(grid.load_grid(LONG + ":stage0"), "/tmp/study", validate=False)}
  assert list(planned) == ["learning_rate-0.0001_seed-0", "learning_rate-3e-05_seed-0", "learning_rate-1e-05_seed-0"]
  c = planned["learning_rate-3e-05_seed-0"]
  assert (c.loss.method, c.delay, c.total_steps, c.optimizer.learning_rate) == ("grpo", 0, 32, 3e-5)
  assert (c.sft.target, c.sft.max_len, c.sampling.max_new_tokens, c.data.max_prompt_tokens) == ("worked", 136, 128, 48)
  assert (c.data.task_config.min_terms, c.data.task_config.max_terms, c.num_updates_per_step) == (8, 8, 8)
  assert minpro_long.LEARNING_RATE == 3e-5  # stage 0's choice (the grid file's header)
  monkeypatch.setattr(minpro_long, "LEARNING_RATE", None)
  for spec in ("stage0b", "stage1"):  # the rate is stage 0's to choose: refused until it is set
    with pytest.raises(ValueError, match="LEARNING_RATE is still the placeholder None; run stage 0"):
      minpro_long.get_grid(spec)
  for bad in ("", ":stage3", ":stage1:x"):
    with pytest.raises(
        GridError, match=r"pass a stage: .* one of \('stage0', 'stage0b', 'stage1', 'rate', 'lr', 'stage2'\)"
    ):
      grid.load_grid(LONG + bad)
  monkeypatch.setattr(minpro_long, "LEARNING_RATE", 3e-5)
  runs = grid.expand(minpro_long.get_grid("stage0b"))
  assert [r.name for r in runs] == ["method-minpro_seed-0", "method-grpo_seed-0", "method-cispo_seed-0"]
  g = minpro_long.get_grid("stage1")
  grid.check_grid(g)
  assert g.contrasts == (("loss.method", "grpo", "delay", 0),)  # the staleness contrast (issue 55)
  runs = grid.expand(g)
  cells = list(dict.fromkeys(r.cell_name for r in runs))
  assert len(runs) == 75 and len(cells) == 15 and {r.seed for r in runs} == {0, 1, 2, 3, 4}
  assert cells[:2] == ["method-minpro_delay-2", "method-minpro_delay-8"] and cells[10:12] == [
      "method-minpro_delay-0",
      "method-grpo_delay-0",
  ]
  assert cells[12:] == [f"method-minpro_delay-8_prefix_statistic-{s}" for s in ("prod", "geomean", "mean")]
  assert {dict(r.extra)["total_steps"] - dict(r.cell)["delay"] for r in runs} == {32}  # equal updates per delay
  assert len(grid.expand(minpro_long.get_grid("stage1:2"))) == 30
  cfg = {r.name: c for r, _, c in commands.plan(g, "/tmp/study", validate=False)}["method-m2po_delay-8_seed-4"]
  assert (cfg.loss.method, cfg.delay, cfg.total_steps, cfg.optimizer.learning_rate) == ("m2po", 8, 40, 3e-5)
  rate = {r.name: c for r, _, c in commands.plan(grid.load_grid(LONG + ":rate"), "/tmp/study", validate=False)}
  assert len(rate) == 12 and {c.optimizer.learning_rate for c in rate.values()} == {1e-5}
  cfg = rate["method-minpro_delay-8_seed-2"]  # stage 1's run of that name but for the rate: paired by warm start
  assert (cfg.loss.method, cfg.delay, cfg.total_steps, cfg.seed, cfg.sft.target) == ("minpro", 8, 40, 2, "worked")


def test_the_long_mipu_grid(monkeypatch):
  monkeypatch.setattr(minpro_long, "LEARNING_RATE", None)
  with pytest.raises(GridError, match="LEARNING_RATE is still the placeholder"):
    grid.load_grid(MIPU_LONG + ":pilot")
  monkeypatch.setattr(minpro_long, "LEARNING_RATE", 3e-5)  # the grid file reads minpro_long's rate
  pilot = {r.name: c for r, _, c in commands.plan(grid.load_grid(MIPU_LONG + ":pilot"), "/tmp/study", validate=False)}
  assert list(pilot) == ["variant-fp32_seed-0", "variant-grpo_seed-0"]
  fp32, fp8 = pilot.values()
  assert (fp32.sampling.precision, fp8.sampling.precision, fp8.sampling.fp8_format) == ("fp32", "fp8", "e5m2")
  assert (fp8.sft.target, fp8.delay, fp8.optimizer.learning_rate, fp8.loss.rollout_is) == ("worked", 0, 3e-5, None)
  monkeypatch.setattr(mipu_long, "FP8_CONFIRMED", False)
  with pytest.raises(ValueError, match="FP8_CONFIRMED is still the placeholder False"):
    mipu_long.get_grid("main")
  monkeypatch.setattr(mipu_long, "FP8_CONFIRMED", True)
  planned = {r.name: c for r, _, c in commands.plan(mipu_long.get_grid("main"), "/tmp/study", validate=False)}
  assert len(planned) == 30 and list(planned)[:6] == [
      f"variant-{v}_seed-0" for v in ("fp32", "grpo", "tis", "mipu", "random", "mipu-dj")
  ]
  dj = planned["variant-mipu-dj_seed-1"]
  assert (dj.mipu.statistic, dj.mipu.val_prompts, dj.mipu.gap_tolerance, dj.loss.rollout_is) == (
      "delta_j",
      64,
      0,
      "token",
  )
  mipu, rnd = planned["variant-mipu_seed-3"], planned["variant-random_seed-3"]
  assert (mipu.loss.rollout_is, mipu.mipu.rollback, mipu.mipu.mode, mipu.mipu.gap_tolerance) == (
      "token",
      True,
      "gap",
      1e-4,
  )
  assert (rnd.mipu.mode, rnd.mipu.match_rate_of, rnd.sampling.max_new_tokens) == ("random", "variant-mipu_seed-3", 128)


def test_the_random_rollback_at_delta_js_rate_reads_the_committed_mipu_dj_runs(monkeypatch):
  """Issue 55: `random-dj` rolls back at random at the rate of results/mipu_long's `mipu-dj` run of its seed."""
  from minpro_jax.run.run_config import random_rollback_rate

  monkeypatch.chdir(REPO)  # the rate's path is from the repository root, where study commands run
  planned = commands.plan(grid.load_grid(MIPU_LONG + ":random-dj"), "/tmp/study", validate=False)
  assert [r.name for r, _, _ in planned] == [f"variant-random-dj_seed-{s}" for s in range(5)]
  main = {r.name: c for r, _, c in commands.plan(grid.load_grid(MIPU_LONG + ":main"), "/tmp/study", validate=False)}
  for run, _, c in planned:
    dj = main[f"variant-mipu-dj_seed-{run.seed}"]
    assert c.mipu.match_rate_of == f"results/mipu_long/variant-mipu-dj_seed-{run.seed}"
    assert (c.mipu.mode, c.loss.rollout_is, c.loss.tis_cap, c.sampling.precision) == ("random", "token", 2.0, "fp8")
    same = ("sampling.fp8_format", "sampling.fp8_activations", "optimizer.learning_rate", "sft.target", "seed")
    get = lambda cfg, f: functools.reduce(lambda node, k: node[k], f.split("."), cfg)  # noqa: E731
    assert all(get(c, f) == get(dj, f) for f in same)  # the setting and warm start of the mipu-dj run
    with open(os.path.join(REPO, c.mipu.match_rate_of, "summary.json")) as f:
      m = json.load(f)["mipu"]
    assert random_rollback_rate(c) == m["rollbacks"] / m["checks"]
  assert [random_rollback_rate(c) for _, _, c in planned] == [0.5625, 0.375, 0.4375, 0.4375, 0.40625]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"variants": {"a": {"loss.rollout_iz": "token"}}}, r"grid\.variants\['a'\]: loss\.rollout_iz: .*did you mean"),
        ({"variants": {"a b": {}}}, r"grid\.variants\['a b'\]: a variant name must be"),
        ({"variants": {"a": {"delay": 2}}}, r"grid\.variants\['a'\]: delay is also in grid\.fixed or grid\.axes"),
        ({"variants": {"a": {"seed": 2}}}, r"'seed' is set by the runner"),
        ({"variants": {"a": {}}, "cells": [{"variant": "b"}]}, r"grid\.cells\[0\]: variant 'b' is none of"),
    ],
)
def test_variant_mistakes_name_the_variant(change, match):
  g = Grid(**{"base": "configs/default.py", "axes": {"delay": [0, 2]}, **change})
  with pytest.raises(GridError, match=match):
    grid.check_grid(g)
    commands.plan(g, "/tmp/study", validate=False)


def test_a_grid_file_that_returns_no_grid(tmp_path):
  p = tmp_path / "g.py"
  p.write_text("def get_grid(arg=None):\n  return 3\n")
  with pytest.raises(GridError, match="returned a int; return a minpro_jax.study.grid.Grid"):
    grid.load_grid(str(p))
  with pytest.raises(GridError, match="no such file"):
    grid.load_grid(str(tmp_path / "missing.py"))


def test_a_missing_grid_names_the_repository_root_once(monkeypatch):
  monkeypatch.chdir(grid.REPO)
  with pytest.raises(GridError) as e:
    grid.load_grid("configs/studies/nope.py")
  assert str(e.value).endswith(f"no such file 'configs/studies/nope.py' (from {grid.REPO}); pass a grid .py file")


def test_stage2_runs_each_objective_at_the_rate_the_lr_study_chose(monkeypatch):
  """Issue 55: CHOSEN_RATES is the rule's answer on the committed lr study (45 runs), the rule keeps the smallest of
  the rates within LR_TIE_POINTS of the best mean AUC (a hand vector) and refuses an incomplete study; stage 2 is 5
  objectives x delays {0, 2, 8} x 5 seeds at those rates, and refuses before they are set."""
  with open(os.path.join(REPO, "results", "minpro_long_lr", "summary.json")) as f:
    cells = json.load(f)["cells"]
  assert len(cells) == 15 and minpro_long.CHOSEN_RATES == minpro_long.choose_rates(cells)
  hand = [
      {"cell": f"variant-{o}_learning_rate-{r}", "metrics": {"auc": {"mean": a, "n": 3}}}
      for o in minpro_long.OBJECTIVES
      for r, a in zip(minpro_long.LR_RATES, (0.150, 0.161, 0.170))  # 2e-5 within 1 point of 3e-5's best
  ]
  assert set(minpro_long.choose_rates(hand).values()) == {2e-5}
  with pytest.raises(ValueError, match="lacks seeds of variant-minpro_learning_rate-1e-05"):
    minpro_long.choose_rates([{**hand[0], "metrics": {"auc": {"mean": 0.2, "n": 2}}}, *hand[1:]])
  g = minpro_long.get_grid("stage2")
  runs = grid.expand(g)
  assert len(runs) == 75 and {dict(r.cell)["delay"] for r in runs} == {0, 2, 8}
  planned = {r.name: c for r, _, c in commands.plan(g, "/tmp/study", validate=False)}
  for objective, rate in minpro_long.CHOSEN_RATES.items():
    cfg = planned[f"variant-{objective}_delay-8_seed-4"]
    assert (cfg.optimizer.learning_rate, cfg.delay, cfg.total_steps) == (rate, 8, minpro_long.LEARN_STEPS + 8)
  assert planned["variant-minpro-ppo_delay-2_seed-0"].loss.surrogate == "ppo"
  monkeypatch.setattr(minpro_long, "CHOSEN_RATES", None)
  with pytest.raises(ValueError, match="CHOSEN_RATES is still the placeholder"):
    minpro_long.get_grid("stage2")


def test_the_toolbox_grid(monkeypatch):
  """Issue 57: five arms x delays 0 and 8 x 3 seeds on the long-response setting, each arm at the rate the lr stage
  chose for its objective (GRPO's for DPPO, decoupled PPO and VCPO's step) and refused before that rate is set,
  decoupled PPO scoring pi_prox, VCPO's arm GRPO with learner.ess_step; every value reads back from the command
  line and passes the loss and step checks."""
  path = os.path.join(REPO, "configs", "studies", "toolbox.py")
  toolbox = load_module(path)
  monkeypatch.setattr(minpro_long, "CHOSEN_RATES", None)
  with pytest.raises(GridError, match="CHOSEN_RATES is still the placeholder"):
    grid.load_grid(path)
  chosen = {"minpro": 1e-5, "minpro-ppo": 2e-5, "cispo": 1e-5, "grpo": 2e-5, "gspo": 3e-5}
  monkeypatch.setattr(minpro_long, "CHOSEN_RATES", chosen)
  g = grid.load_grid(path)
  runs = grid.expand(g)
  assert len(runs) == 30 and {dict(r.cell)["delay"] for r in runs} == {0, 8}
  learn = minpro_long.LEARN_STEPS
  assert {dict(r.extra)["total_steps"] - dict(r.cell)["delay"] for r in runs} == {learn}
  planned = dict((r.name, c) for r, _, c in commands.plan(g, "/tmp/study", validate=False))
  dec, vcpo = planned["variant-decoupled-ppo_delay-8_seed-2"], planned["variant-grpo-vcpo_delay-0_seed-0"]
  assert run_config.loss_config(dec).reads_proximal_logp and run_config.ess_step(vcpo)  # the loss and step checks
  assert (dec.loss.method, dec.loss.proximal, dec.delay, dec.total_steps) == ("decoupled_ppo", "score", 8, learn + 8)
  assert (vcpo.loss.method, vcpo.learner.ess_step) == ("grpo", True)
  rates = {arm: planned[f"variant-{arm}_delay-0_seed-1"].optimizer.learning_rate for arm in toolbox.ARMS}
  assert rates == {"minpro": 1e-5, "grpo": 2e-5, "dppo": 2e-5, "decoupled-ppo": 2e-5, "grpo-vcpo": 2e-5}
  assert dec.sft.target == "worked" and dec.sampling.max_new_tokens == minpro_long.MAX_NEW_TOKENS
  assert len(grid.expand(grid.load_grid(path + ":2"))) == 20
  with pytest.raises(GridError, match="pass the number of seeds"):
    grid.load_grid(path + ":x")


def test_the_inflight_grid():
  """Issue 59: four token-level objectives x in-flight updates at two cadences and delay mode at the two delays that
  bracket their token staleness x 3 seeds, each objective at its own rate; every value reads back from the command
  line and passes the staleness checks (GSPO would be refused)."""
  path = os.path.join(REPO, "configs", "studies", "inflight.py")
  g = grid.load_grid(path)
  runs = grid.expand(g)
  assert len(runs) == 48 and {dict(r.cell)["variant"] for r in runs} == {
      "inflight-k8",
      "inflight-k32",
      "delay-0",
      "delay-1",
  }
  planned = dict((r.name, c) for r, _, c in commands.plan(g, "/tmp/study", validate=False))
  fast = planned["variant-inflight-k8_method-m2po_seed-2"]
  assert (fast.staleness.mode, fast.staleness.inflight_every, fast.delay) == ("inflight", 8, 1)
  assert fast.total_steps == minpro_long.LEARN_STEPS + 1 and fast.sampling.kv_cache == "dense"
  on_policy = planned["variant-delay-0_method-grpo_seed-0"]
  assert (on_policy.staleness.mode, on_policy.delay, on_policy.total_steps) == ("delay", 0, minpro_long.LEARN_STEPS)
  # each objective at the lr stage's rate for it; M2PO (no lr stage) at GRPO's
  rates = {c.loss.method: c.optimizer.learning_rate for c in planned.values()}
  chosen = minpro_long.CHOSEN_RATES
  assert rates == {"minpro": chosen["minpro"], "grpo": chosen["grpo"], "cispo": chosen["cispo"], "m2po": chosen["grpo"]}
  for cfg in planned.values():
    config_checks.check_staleness(cfg)
  assert len(grid.expand(grid.load_grid(path + ":2"))) == 32
  with pytest.raises(GridError, match="pass a seed count"):
    grid.load_grid(path + ":x")
