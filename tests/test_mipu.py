"""MIPU Step 2: the acceptance rule, validation draws, snapshots that survive donation, and the trainer's
rollback (reject-all keeps the warm-start parameters; accept-all equals a run without the test)."""

import json
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax import run_config
from minpro_jax.rl import mipu


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


def _coin_grade(texts, golds, **kwargs):
  """Reward 0/1 from a checksum of the text: mixed rewards inside groups even for an untrained tiny model, so
  the advantages in T_post are not all zero."""
  del golds, kwargs
  return [float(zlib.crc32(t.encode()) % 2) for t in texts], {"no_answer": 0, "timeout": 0}


def _run(tmp_path, name, **extra):
  from minpro_jax.trainer import Trainer

  ov = tiny_overrides(tmp_path, workdir=str(tmp_path / name), total_steps=3, delay=1, **extra)
  tr = Trainer.from_config(make_config(ov))
  summary = tr.run()
  recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return tr, summary, [r for r in recs if 0 <= r["step"] < 3]


def test_trainer_rollback_reject_all_and_accept_all(tmp_path, monkeypatch):
  monkeypatch.setattr("minpro_jax.trainer.grade_split", _coin_grade)
  # reject every update (accept iff T_post >= 1e9): the run ends on the warm-start parameters, version 0
  tr, summary, recs = _run(tmp_path, "reject", **{"mipu.rollback": True, "mipu.gap_tolerance": -1e9})
  assert summary["mipu"] == {"checks": 2, "rollbacks": 2} and summary["policy_version"] == 0
  assert [r["policy_version"] for r in recs] == [0, 0, 0]
  assert [r.get("mipu/accepted") for r in recs] == [None, 0, 0] and recs[2]["mipu/rollbacks_total"] == 2
  assert int(tr.final_state.step) == 0
  from flax import nnx

  from minpro_jax.run_setup import build_model, build_tokenizer, train_and_eval_problems, warm_start

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
  monkeypatch.setattr("minpro_jax.trainer.grade_split", _coin_grade)
  _, summary, recs = _run(
      tmp_path,
      "fp8",
      **{"mipu.rollback": True, "mipu.gap_tolerance": 0.0, "sampling.precision": "fp8", "loss.rollout_is": "token"},
  )
  t_post = [r["mipu/t_post"] for r in recs[1:]]
  assert all(1e-7 < abs(t) < 0.5 for t in t_post), t_post
  assert [r["mipu/accepted"] for r in recs[1:]] == [int(t >= 0) for t in t_post]
  assert summary["mipu"]["rollbacks"] == sum(t < 0 for t in t_post)
