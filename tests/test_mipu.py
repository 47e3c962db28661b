"""MIPU Step 2: the acceptance rule, validation draws, snapshots that survive donation, and the trainer's
rollback (reject-all keeps the warm-start parameters; accept-all equals a run without the test)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import coin_grade, make_config, tiny_overrides

from minpro_jax.config_lib.mipu_variants import VARIANTS
from minpro_jax.rl import mipu
from minpro_jax.run import run_config


@pytest.mark.parametrize(
    "t_post,tol,want",
    [
        (0.0, 1e-4, True),
        (-1e-4, 1e-4, True),
        (-2e-4, 1e-4, False),
        (5e-5, -1e-4, False),
        (2e-4, -1e-4, True),
        (0.0, 0.0, True),
        (-1e-12, 0.0, False),
        (math.nan, 1.0, False),
        (-math.inf, 1.0, False),
        (math.inf, 1.0, False),
    ],
)
def test_accept_update_rule(t_post, tol, want):
  assert mipu.accept_update(t_post, tol) is want


def test_accept_update_rejects_nan_tolerance():
  with pytest.raises(ValueError, match="config.mipu.gap_tolerance"):
    mipu.accept_update(0.0, math.nan)


def test_validation_indices_deterministic_distinct_in_range():
  a = mipu.validation_indices(50, 8, seed=7)
  assert np.array_equal(a, mipu.validation_indices(50, 8, seed=7))
  assert not np.array_equal(a, mipu.validation_indices(50, 8, seed=8))
  assert len(set(a.tolist())) == 8 and a.min() >= 0 and a.max() < 50 and np.all(np.diff(a) > 0)
  assert sorted(mipu.validation_indices(5, 5, seed=0).tolist()) == [0, 1, 2, 3, 4]
  for bad in (0, 6):
    with pytest.raises(ValueError, match=r"config.mipu.val_prompts=.* must lie in \[1, 5\]"):
      mipu.validation_indices(5, bad, seed=0)


def test_snapshot_survives_donation():
  state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.zeros((), jnp.int32)}
  snap = mipu.snapshot(state)
  step = jax.jit(lambda s: {"w": s["w"] * 2, "step": s["step"] + 1}, donate_argnums=(0,))
  new = step(state)
  np.testing.assert_array_equal(snap["w"], np.arange(6.0).reshape(2, 3))
  assert int(snap["step"]) == 0 and int(new["step"]) == 1


def test_config_validation_names_mipu_fields(tmp_path):
  for field, value, msg in (
      ("val_group_size", 1, "mipu.val_group_size: must be >= 2"),
      ("val_prompts", 0, "mipu.val_prompts: must be >= 1"),
      ("gap_tolerance", math.inf, "mipu.gap_tolerance: must be a finite number"),
  ):
    c = make_config(tiny_overrides(tmp_path, **{"mipu.rollback": True, f"mipu.{field}": value}))
    with pytest.raises(run_config.ConfigError, match=msg):
      run_config.validate_config(c)


def test_t_post_standard_error_by_hand_and_equal_groups():
  # groups 0: terms (1, 3), 1: (2, no tokens), 2: (-1, 5); T = 10 / 5 = 2
  terms = np.array([1.0, 3.0, 2.0, 0.0, -1.0, 5.0])
  has = np.array([True, True, True, False, True, True])
  gid = np.array([0, 0, 1, 1, 2, 2])
  s_g, n_g = np.array([4.0, 2.0, 4.0]), np.array([2.0, 1.0, 2.0])
  want = math.sqrt(3 / 2 * np.sum((s_g - 2.0 * n_g) ** 2)) / 5.0
  assert mipu.t_post_standard_error(terms, has, gid) == pytest.approx(want, rel=1e-12)
  # equal groups: the standard deviation of the group means over sqrt(G)
  rng = np.random.default_rng(0)
  t = rng.normal(size=24)
  g = np.repeat(np.arange(6), 4)
  means = t.reshape(6, 4).mean(1)
  se = mipu.t_post_standard_error(t, np.ones(24, bool), g)
  assert se == pytest.approx(means.std(ddof=1) / math.sqrt(6), rel=1e-12)
  assert math.isnan(mipu.t_post_standard_error(t[:4], np.ones(4, bool), g[:4]))  # one group: no spread to measure
  with pytest.raises(ValueError, match="must be"):
    mipu.t_post_standard_error(t, np.ones(23, bool), g)


def test_t_post_standard_error_is_calibrated():
  """Over many validation draws with a shared group effect, the mean estimated SE matches the spread of T_post."""
  rng = np.random.default_rng(1)
  num_groups, size = 8, 4
  g = np.repeat(np.arange(num_groups), size)
  t_post, ses = [], []
  for _ in range(3000):
    terms = np.repeat(rng.normal(0, 1.0, num_groups), size) + rng.normal(0, 0.5, num_groups * size)
    t_post.append(terms.mean())
    ses.append(mipu.t_post_standard_error(terms, np.ones_like(terms, bool), g))
  assert np.mean(ses) == pytest.approx(np.std(t_post), rel=0.06)
  assert np.std(t_post) > 1.5 * 0.5 / math.sqrt(num_groups * size)  # ignoring the groups would understate it


def test_random_rollback_rate_and_purity():
  for rate in (0.0, 0.3, 1.0):
    draws = [mipu.random_rollback(11, s, rate) for s in range(4000)]
    assert abs(np.mean(draws) - rate) <= 4 * math.sqrt(rate * (1 - rate) / 4000)
  assert [mipu.random_rollback(11, s, 0.5) for s in range(64)] == [mipu.random_rollback(11, s, 0.5) for s in range(64)]
  assert [mipu.random_rollback(11, s, 0.5) for s in range(64)] != [mipu.random_rollback(12, s, 0.5) for s in range(64)]
  with pytest.raises(ValueError, match="random_rate must lie in"):
    mipu.random_rollback(0, 0, 1.5)


def test_reference_rollback_rate(tmp_path):
  (tmp_path / "summary.json").write_text(json.dumps({"mipu": {"checks": 8, "rollbacks": 3}}))
  assert mipu.reference_rollback_rate(str(tmp_path)) == 3 / 8
  assert mipu.reference_rollback_rate(str(tmp_path / "summary.json")) == 3 / 8
  with pytest.raises(ValueError, match="no summary.json"):
    mipu.reference_rollback_rate(str(tmp_path / "nope"))
  (tmp_path / "summary.json").write_text(json.dumps({"mipu": {"checks": 0, "rollbacks": 0}}))
  with pytest.raises(ValueError, match="made no MIPU check"):
    mipu.reference_rollback_rate(str(tmp_path))


def test_ground_truth_agreement_by_hand():
  got = mipu.ground_truth_agreement([0.1, -0.2, 0.3, -0.1], [0.2, -0.1, -0.1, 0.0])
  assert got["checks"] == 4 and got["sign_agreement"] == 0.5
  assert got["pearson_r"] == pytest.approx(np.corrcoef([0.1, -0.2, 0.3, -0.1], [0.2, -0.1, -0.1, 0.0])[0, 1])
  assert mipu.ground_truth_agreement([0.1, 0.2], [0.1, 0.2])["pearson_r"] is None
  assert mipu.ground_truth_agreement([], []) == {"checks": 0, "sign_agreement": None, "pearson_r": None}


def test_config_validation_of_modes_and_mis_bounds(tmp_path):
  on = {"mipu.rollback": True}
  for extra, msg in (
      ({"mipu.mode": "coin"}, "mipu.mode: must be one of"),
      ({"mipu.mode": "random"}, "mipu.random_rate: mode=random needs exactly one of"),
      ({"mipu.mode": "random", "mipu.random_rate": 0.2, "mipu.match_rate_of": str(tmp_path)}, "exactly one of"),
      ({"mipu.mode": "random", "mipu.random_rate": 1.5}, "mipu.random_rate: must lie in"),
      ({"mipu.mode": "random", "mipu.random_rate": 0.2, "mipu.ground_truth": True}, "mipu.ground_truth: needs"),
      ({"mipu.random_rate": 0.2}, "mipu.random_rate: is for mode=random"),
  ):
    c = make_config(tiny_overrides(tmp_path, **on, **extra))
    with pytest.raises(run_config.ConfigError, match=msg):
      run_config.validate_config(c)
  # the reference run is read at the start (in a study it runs just before): from the current directory, then
  # next to the run's workdir
  rnd = {"mipu.mode": "random", "mipu.match_rate_of": "x"}
  c = make_config(tiny_overrides(tmp_path, **on, **rnd))
  run_config.validate_config(c)
  with pytest.raises(run_config.ConfigError, match="match_rate_of='x': no summary.json"):
    run_config.random_rollback_rate(c)
  sibling = os.path.join(os.path.dirname(os.path.abspath(c.workdir)), "x")
  os.makedirs(sibling)
  with open(os.path.join(sibling, "summary.json"), "w") as f:
    json.dump({"mipu": {"checks": 5, "rollbacks": 2}}, f)
  assert run_config.random_rollback_rate(c) == 0.4
  assert (
      run_config.random_rollback_rate(
          make_config(tiny_overrides(tmp_path, **on, **{"mipu.mode": "random", "mipu.random_rate": 0.3}))
      )
      == 0.3
  )
  for extra, msg in (
      ({"loss.rollout_mis_bounds": (0.5, 2.0)}, "rollout_mis_bounds: is set but loss.rollout_mis is not"),
      ({"loss.rollout_mis": "token", "loss.rollout_mis_bounds": (2.0, 0.5)}, "0 < low <= high"),
      ({"loss.rollout_mis": "token", "loss.rollout_mis_bounds": (1.0,)}, "must be two numbers"),
  ):
    with pytest.raises(run_config.ConfigError, match=msg):
      run_config.loss_config(make_config(tiny_overrides(tmp_path, **extra)))
  c = make_config(tiny_overrides(tmp_path, **{"loss.rollout_mis": "geometric", "loss.rollout_mis_bounds": (0.8, 1.25)}))
  assert dict(run_config.loss_config(c).hparams) == {"rollout_mis": "geometric", "rollout_mis_bounds": (0.8, 1.25)}


def _run(tmp_path, name, **extra):
  from minpro_jax.run.trainer import Trainer

  ov = tiny_overrides(tmp_path, workdir=str(tmp_path / name), total_steps=3, delay=1, **extra)
  tr = Trainer.from_config(make_config(ov))
  summary = tr.run()
  recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return tr, summary, [r for r in recs if 0 <= r["step"] < 3]


def test_trainer_rollback_reject_all_and_accept_all(tmp_path, monkeypatch):
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  # reject every update (accept iff T_post >= 1e9): the run ends on the warm-start parameters, version 0
  tr, summary, recs = _run(tmp_path, "reject", **{"mipu.rollback": True, "mipu.gap_tolerance": -1e9})
  assert summary["mipu"] == {"checks": 2, "rollbacks": 2} and summary["policy_version"] == 0
  assert [r["policy_version"] for r in recs] == [0, 0, 0]
  assert [r.get("mipu/accepted") for r in recs] == [None, 0, 0] and recs[2]["mipu/rollbacks_total"] == 2
  assert int(tr.final_state.step) == 0
  # the rejected batch is dropped, not learned again: each step learns a different batch at the same parameters
  assert recs[1]["learn/loss"] != recs[2]["learn/loss"]
  from flax import nnx

  from minpro_jax.run.run_setup import build_model, build_tokenizer, train_and_eval_problems, warm_start

  c = make_config(tiny_overrides(tmp_path, workdir=str(tmp_path / "fresh")))
  problems, _ = train_and_eval_problems(c)
  tok = build_tokenizer(c, problems)
  fresh_model = build_model(c, tok, None)
  warm_start(c, fresh_model, tok, problems)
  for a, b in zip(jax.tree.leaves(nnx.split(fresh_model)[1]), jax.tree.leaves(tr.final_state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # accept every update: same trajectory as the run without the test; at fp32 the sampler is the learner,
  # so rho = 1 and T_post = -mean(group-normalised advantages) = 0
  _, s_on, on = _run(tmp_path, "accept", **{"mipu.rollback": True, "mipu.gap_tolerance": 1e9})
  _, s_off, off = _run(tmp_path, "off")
  assert s_on["mipu"] == {"checks": 2, "rollbacks": 0} and s_off["mipu"] == {"checks": 0, "rollbacks": 0}
  assert s_on["policy_version"] == s_off["policy_version"] == 4
  assert "learn/loss" in off[1] and "sampler_learner/mismatch_abs_mean" in off[1]
  for a, b in zip(on, off):
    for k in ("reward/mean", "learn/loss", "learn/grad_norm", "policy_version", "sampler_learner/mismatch_abs_mean"):
      if k in b:
        assert a[k] == b[k], (k, a[k], b[k])
  assert all(abs(r["mipu/t_post"]) < 1e-5 for r in on[1:])
  assert all(0 < r["mipu/val_reward"] < 1 for r in on[1:])  # mixed rewards: the advantages are not all zero


@pytest.mark.slow
def test_trainer_t_post_nonzero_with_fp8_sampler(tmp_path, monkeypatch):
  # fp8 sampler vs fp32 learner: rho != 1, so T_post is a small non-zero number, and the verdict follows it
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  _, summary, recs = _run(
      tmp_path,
      "fp8",
      **{"mipu.rollback": True, "mipu.gap_tolerance": 0.0, "sampling.precision": "fp8", "loss.rollout_is": "token"},
  )
  t_post = [r["mipu/t_post"] for r in recs[1:]]
  assert all(1e-7 < abs(t) < 0.5 for t in t_post), t_post
  assert [r["mipu/accepted"] for r in recs[1:]] == [int(t >= 0) for t in t_post]
  assert summary["mipu"]["rollbacks"] == sum(t < 0 for t in t_post)


def test_trainer_random_rollback_matches_a_reference_rate_and_samples_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  ref = tmp_path / "reference"
  ref.mkdir()
  (ref / "summary.json").write_text(json.dumps({"mipu": {"checks": 4, "rollbacks": 2}}))
  ov = {"mipu.rollback": True, "mipu.mode": "random", "mipu.match_rate_of": str(ref)}
  tr, summary, recs = _run(tmp_path, "random", **ov)
  want = [not mipu.random_rollback(tr.c.seed, r["step"], 0.5) for r in recs[1:]]
  assert [bool(r["mipu/accepted"]) for r in recs[1:]] == want
  assert summary["mipu"] == {"checks": 2, "rollbacks": want.count(False)}
  assert not any("mipu/t_post" in r for r in recs)  # nothing sampled for the decision
  # the policy version counts the kept updates (2 per step)
  assert summary["policy_version"] == 2 * sum(want)


@pytest.mark.slow
def test_step2_under_fp8_direct_t_post_ground_truth_and_bitwise_restore(tmp_path, monkeypatch):
  """One Step-2 check under an fp8 sampler, driven by hand: T_post equals the formula on the recorded mu' log-probs
  and the learner's pi' log-probs of the same tokens, recomputed here by teacher forcing; J(mu') - J(pi') is
  logged; a rejection returns the snapshot, bit-equal to the parameters and optimizer state before the update."""
  from flax import nnx

  from minpro_jax.models.logprobs import token_logprobs
  from minpro_jax.run.trainer import RunProgress, Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  ov = {"mipu.rollback": True, "mipu.ground_truth": True, "mipu.gap_tolerance": -1e9, "sampling.precision": "fp8"}
  tr = Trainer.from_config(make_config(tiny_overrides(tmp_path, **ov)))
  state = tr.learner.init_state(nnx.split(tr.model)[1])
  batch, _ = tr.sample_step(state, 0)
  before = mipu.snapshot(state)
  want_before = jax.tree.map(np.asarray, (before.params, before.opt_state))
  state, _ = tr.learn_step(state, batch)
  assert int(state.step) == tr.c.num_updates_per_step
  updated = jax.tree.map(np.asarray, state.params)

  progress = RunProgress()
  kept, metrics = tr.mipu_step(state, before, 0, progress)
  vb = tr.mipu_step.last_batch
  model = nnx.merge(nnx.graphdef(tr.model), jax.tree.map(jnp.asarray, updated))
  pi = np.asarray(token_logprobs(model, *map(jnp.asarray, (vb.tokens, vb.segment_ids, vb.positions))).logp)
  mask = vb.response_mask
  assert np.abs(np.where(mask, pi - vb.behavior_logp, 0.0)).max() > 1e-4  # mu' != pi': the fp8 sampler differs
  rho = np.exp(np.where(mask, pi - vb.behavior_logp, 0.0).sum(1) / mask.sum(1))
  assert metrics["mipu/t_post"] == pytest.approx(-np.mean(rho * vb.advantages), abs=1e-5)
  assert np.isfinite(metrics["mipu/t_post_se"]) and metrics["mipu/t_post_se"] > 0
  assert metrics["mipu/j_gap"] == pytest.approx(metrics["mipu/val_reward"] - metrics["mipu/j_learner"])
  assert progress.mipu_ground_truth == [[metrics["mipu/t_post"], metrics["mipu/j_gap"]]]
  assert metrics["mipu/accepted"] == 0 and progress.mipu_rollbacks == 1
  assert kept is before and int(kept.step) == 0
  for a, b in zip(jax.tree.leaves(want_before), jax.tree.leaves((kept.params, kept.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_is_a_valid_config_on_cpu_and_at_paper_scale(tmp_path, variant):
  from minpro_jax.config_lib.files import load_module

  mipu_cfg = load_module("configs/mipu.py")
  mipu_qwen3_1p7b, mipu_qwen3_4b = (load_module(f"configs/paper/mipu_qwen3_{s}.py") for s in ("1p7b", "4b"))

  c = mipu_cfg.get_config(variant)
  assert c.sampling.precision == "fp8" and c.loss.method == "grpo"
  assert (c.loss.rollout_is == "token") == (variant in ("tis", "mipu", "random"))
  assert c.mipu.rollback == (variant in ("step2", "mipu", "random"))
  assert (run_config.lr_decay_config(c) is not None) == (variant == "lr_decay")
  c.workdir = str(tmp_path / "run")
  if variant == "random":  # its rate must be given: the error says how
    with pytest.raises(run_config.ConfigError, match="mipu.random_rate"):
      run_config.validate_config(c)
    c.mipu.random_rate = 0.3
  run_config.validate_config(c)
  run_config.loss_config(c)
  for module in (mipu_qwen3_1p7b, mipu_qwen3_4b):
    p = module.get_config(variant)
    assert p.sampling.precision == "fp8" and p.delay == 0 and p.workdir.endswith(variant)
    run_config.validate_shapes_config(p)
  with pytest.raises(ValueError, match="choose one of"):
    mipu_cfg.get_config("ppo")
