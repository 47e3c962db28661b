"""Worked vectors V1-V7 and cases B01, B03, B04, B05 (tests/CASES.md) for minpro_jax.rl.objectives, all under
jax.jit and jax.grad; the objective registry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.rl.objectives import (
    OBJECTIVES,
    PolicyLossOutput,
    aggregate_loss,
    compute_m2po_mask,
    get_objective,
    inference_gap_t_post,
    mismatch_metrics,
    policy_loss,
    prefix_log_factor,
    register_objective,
    resolve_hparams,
)

TOL = dict(rtol=1e-5, atol=1e-6)
STATS = ("none", "min", "mean", "geomean", "prod")


def _batch(old, delta, adv, mask=None):
  old = np.asarray(old, np.float32)
  delta = np.asarray(delta, np.float32)
  if old.ndim == 1:
    old, delta, adv = old[None], delta[None], [adv]
  mask = np.ones(old.shape, bool) if mask is None else np.asarray(mask, bool).reshape(old.shape)
  return old + delta, old, np.asarray(adv, np.float32), mask


def _run(method, old, delta, adv, mask=None, **hp):
  logp, old, adv, mask = _batch(old, delta, adv, mask)
  fn = jax.jit(lambda lp: policy_loss(method, lp, old, adv, mask, **hp))
  out = fn(logp)
  grad = jax.jit(jax.grad(lambda lp: policy_loss(method, lp, old, adv, mask, **hp).loss))(logp)
  return out, np.asarray(grad)


# ---------------------------------------------------------------- V1 / V2: statistics, clipping
V1 = ([-1, -0.5, -2, -0.3], [0.1, -0.2, 0.05, 0], 1.0)
V1_EXPECTED = {
    "none": ([1, 1, 1, 1], [1.105171, 0.818731, 1.051271, 1], 0.979436),
    "min": ([1, 1.105171, 0.818731, 0.818731], [1.105171, 0.904837, 0.860708, 0.818731], 0.888010),
    "mean": ([1, 1.105171, 0.961951, 0.991724], [1.105171, 0.904837, 1.011271, 0.991724], 0.974384),
    "geomean": ([1, 1.105171, 0.951229, 0.983471], [1.105171, 0.904837, 1.0, 0.983471], 0.968270),
    "prod": ([1, 1.105171, 0.904837, 0.951229], [1.105171, 0.904837, 0.951229, 0.951229], 0.942077),
}


@pytest.mark.parametrize("stat", STATS)
def test_v1_prefix_factor_weights_loss_grad(stat):
  factor, w, loss = V1_EXPECTED[stat]
  logp, old, _, mask = _batch(*V1)
  log_f = jax.jit(prefix_log_factor, static_argnames="statistic")(jnp.asarray(logp - old), mask, statistic=stat)
  np.testing.assert_allclose(np.exp(log_f[0]), factor, **TOL)
  out, grad = _run("minpro", *V1, prefix_statistic=stat)
  np.testing.assert_allclose(out.token_weights[0], w, **TOL)
  np.testing.assert_allclose(out.loss, loss, **TOL)
  np.testing.assert_allclose(grad[0], -np.asarray(w) / 4, **TOL)  # dL/dlogp = -w A / N


def test_v1_minpro_gradient_literal():
  _, grad = _run("minpro", *V1)
  np.testing.assert_allclose(grad[0], [-0.276293, -0.226209, -0.215177, -0.204683], **TOL)


V2 = ([-2, -1, -3, -0.7, -1.5], [0.6, 0, -1.2, 0.4, 0.3], 1.0)
V2_EXPECTED = {
    "none": ([1.28, 1, 0.301194, 1.28, 1.28], 1.195403),
    "min": ([1.28, 1.28, 0.301194, 0.449329, 0.406570], 0.991940),
    "mean": ([1.28, 1.28, 0.425003, 1.28, 1.28], 1.355402),
    "geomean": ([1.28, 1.28, 0.406570, 1.221403, 1.28], 1.336403),
    "prod": ([1.28, 1.28, 0.548812, 0.818731, 1.105171], 1.389767),
}


@pytest.mark.parametrize("stat", STATS)
def test_v2_clipping_binds(stat):
  w, loss = V2_EXPECTED[stat]
  out, grad = _run("minpro", *V2, prefix_statistic=stat)
  np.testing.assert_allclose(out.token_weights[0], w, **TOL)
  np.testing.assert_allclose(out.loss, loss, **TOL)
  np.testing.assert_allclose(grad[0], -np.asarray(w) / 5, **TOL)


def test_v2_details():
  logp, old, _, mask = _batch(*V2)
  np.testing.assert_allclose(
      np.exp(prefix_log_factor(logp - old, mask)[0]), [1, 1.822119, 1, 0.301194, 0.301194], **TOL
  )
  _, grad = _run("minpro", *V2)
  np.testing.assert_allclose(grad[0], [-0.256, -0.256, -0.060239, -0.089866, -0.081314], **TOL)
  out, _ = _run("minpro", *V2, eps_low=0.2)
  np.testing.assert_allclose(out.token_weights[0], [1.28, 1.28, 0.8, 0.8, 0.8], **TOL)
  np.testing.assert_allclose(out.loss, 1.526400, **TOL)
  np.testing.assert_allclose(_run("cispo", *V2, eps_low=0.2)[0].loss, 1.614400, **TOL)
  np.testing.assert_allclose(_run("minpro", *V2, prefix_statistic="none", eps_low=0.2)[0].loss, 1.614400, **TOL)
  out, _ = _run("minpro", *V2, prefix_cap_at_one=True)
  np.testing.assert_allclose(out.token_weights[0, 1], 1.0, **TOL)
  out, grad = _run("minpro", *V2, surrogate="ppo", eps_low=0.2)
  np.testing.assert_allclose(out.loss, -0.743419, **TOL)
  np.testing.assert_allclose(grad[0], [0, 0, -0.060239, -0.089866, -0.081314], **TOL)


def test_minpro_ppo_surrogate_hand_vector_both_advantage_signs():
  """MinPRO's trust-region ablation (issue 55): the PPO clipped surrogate on r = sg(f_t) rho_t with eps_low 0.2,
  eps_high 0.28. l = [.5, 0, -.4, .1, .3]: log f = exclusive prefix min [0, .5, 0, -.4, -.4], log r = [.5, .5, -.4,
  -.3, -.1], r = [1.648721, 1.648721, 0.670320, 0.740818, 0.904837] (token 1 leaves the band through f alone: l = 0).
  A = +1: tokens with r > 1.28 lose their gradient (loss -1.28), the rest keep -A r; A = -1: tokens with r < 0.8 lose
  it (loss 0.8), the rest keep -A r. dL/dlogp_t = -A r_t / N on a kept token (f detached), N = 10."""
  old = [[-1.0, -2.0, -0.5, -1.5, -0.8]] * 2
  delta = [[0.5, 0.0, -0.4, 0.1, 0.3]] * 2
  out, grad = _run("minpro", old, delta, [1.0, -1.0], surrogate="ppo", eps_low=0.2)
  r = [1.648721, 1.648721, 0.670320, 0.740818, 0.904837]
  np.testing.assert_allclose(out.token_weights, [r, r], **TOL)  # the unclipped r, for the logs
  kept = np.array([[0, 0, 1, 1, 1], [1, 1, 0, 0, 1]], bool)  # the gradient mask of each sign
  np.testing.assert_array_equal(grad != 0, kept)
  np.testing.assert_allclose(
      grad, [[0, 0, -0.067032, -0.074082, -0.090484], [0.164872, 0.164872, 0, 0, 0.090484]], **TOL
  )
  # per-token losses [-1.28, -1.28, -.670320, -.740818, -.904837] and [1.648721, 1.648721, .8, .8, .904837]
  np.testing.assert_allclose(out.loss, (-4.875975 + 5.802279) / 10, **TOL)
  np.testing.assert_allclose([out.metrics["clip_frac_high"], out.metrics["clip_frac_low"]], [0.2, 0.2], **TOL)
  _, grad_reinforce = _run("minpro", old, delta, [1.0, -1.0], eps_low=0.2)  # the paper's surrogate: no mask
  assert np.all(grad_reinforce != 0)


# ---------------------------------------------------------------- V3 / V4: padding, length 1
V3_OLD = [-0.8, -1.6, -0.4]
V3_DELTA = [-0.3, 0.2, 0.1]


@pytest.mark.parametrize("left", [False, True])
def test_v3_padding_right_and_left(left):
  old = np.array(V3_OLD + [-1.0, -1.0], np.float32)
  delta = np.array(V3_DELTA + [-30.0, 5.0], np.float32)
  mask = np.array([1, 1, 1, 0, 0], bool)
  if left:
    old, delta, mask = np.roll(old, 2), np.roll(delta, 2), np.roll(mask, 2)
  out, grad = _run("minpro", old, delta, -0.5, mask)
  valid = mask
  np.testing.assert_allclose(out.token_weights[0][valid], [0.740818, 0.904837, 0.818731], **TOL)
  np.testing.assert_array_equal(out.token_weights[0][~valid], 0.0)
  np.testing.assert_allclose(out.loss, -0.387882, **TOL)
  np.testing.assert_allclose(grad[0][valid], [0.123470, 0.150806, 0.136455], **TOL)
  np.testing.assert_array_equal(grad[0][~valid], 0.0)
  out, _ = _run("minpro", old, delta, -0.5, mask, prefix_statistic="prod")
  np.testing.assert_allclose(out.token_weights[0][valid], [0.740818, 0.904837, 1.0], **TOL)
  np.testing.assert_allclose(out.loss, -0.396945, **TOL)


@pytest.mark.parametrize("stat", STATS)
def test_v4_length_one(stat):
  out, grad = _run("minpro", [-0.5], [0.4], 2.0, prefix_statistic=stat)
  np.testing.assert_allclose(out.token_weights[0], [1.28], **TOL)
  np.testing.assert_allclose(out.loss, 0.256, **TOL)
  np.testing.assert_allclose(grad[0], [-2.56], **TOL)


# ---------------------------------------------------------------- V5: aggregation
V5 = (
    [[-1, -2, -0.5, -1.5], [-0.7, -0.2, 0, 0]],
    [[0, -0.7, 0.2, 0.1], [0.3, 0.1, 0, 0]],
    [1.0, -1.0],
    [[1, 1, 1, 1], [1, 1, 0, 0]],
)


def test_v5_aggregation():
  out, grad = _run("minpro", *V5)
  np.testing.assert_allclose(out.token_weights, [[1, 0.496585, 0.606531, 0.548812], [1.28, 1.28, 0, 0]], **TOL)
  np.testing.assert_allclose(out.loss, 0.441846, **TOL)
  np.testing.assert_allclose(out.denominator, 6.0)
  np.testing.assert_allclose(grad, [[-0.166667, -0.082764, -0.101088, -0.091469], [0.213333, 0.213333, 0, 0]], **TOL)
  out, _ = _run("minpro", *V5, loss_agg_mode="seq-mean-token-mean")
  np.testing.assert_allclose(out.loss, 0.251384, **TOL)
  np.testing.assert_allclose(out.denominator, 2.0)


# ---------------------------------------------------------------- V6: overflow
@pytest.mark.parametrize("first", [79.95, 95.0])
def test_v6_overflow(first):
  new = np.array([-0.05, -0.1, -0.01, -0.3], np.float32)
  delta = np.array([first, 0, 59.99, -0.1], np.float32)
  old = new - delta
  out, grad = _run("minpro", old, delta, 1.0)
  np.testing.assert_allclose(out.token_weights[0], [1.28, 1.28, 1.28, 0.904837], rtol=1e-4)
  np.testing.assert_allclose(out.loss, 0.119063, rtol=1e-4)
  assert np.all(np.isfinite(grad))
  out, grad = _run("minpro", old, delta, 1.0, prefix_statistic="prod")
  np.testing.assert_allclose(out.token_weights[0], [1.28] * 4, rtol=1e-4)
  np.testing.assert_allclose(out.loss, 0.147200, rtol=1e-4)
  assert np.all(np.isfinite(grad)) and all(np.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(
    "stat,w,loss",
    [("min", [0, 0, 0], None), ("prod", [0, 0, 0], None), ("geomean", [0, 0, 0], None), ("mean", [0, 0, 0.5], 0.05)],
)
def test_v6b_underflow(stat, w, loss):
  new = np.array([-90, -0.2, -0.3], np.float32)
  delta = np.array([-89.9, 0, 0], np.float32)
  out, grad = _run("minpro", new - delta, delta, 1.0, prefix_statistic=stat)
  np.testing.assert_allclose(out.token_weights[0], w, atol=1e-6)
  if loss is not None:
    np.testing.assert_allclose(out.loss, loss, **TOL)
  assert np.all(np.isfinite(grad))


# ---------------------------------------------------------------- V7: baselines
V7 = (
    [[-1.2, -0.4, -2, -0.9], [-0.6, -1.1, -0.3, 0]],
    [[0.5, 0.1, -0.2, 0.3], [-0.4, 0.05, -0.1, 0]],
    [1.0, -1.0],
    [[1, 1, 1, 1], [1, 1, 1, 0]],
)


def test_v7_grpo():
  out, grad = _run("grpo", *V7)
  np.testing.assert_allclose(out.loss, -0.246828, **TOL)
  np.testing.assert_allclose(grad, [[0, -0.157882, -0.116962, 0], [0, 0.150182, 0.129262, 0]], **TOL)
  np.testing.assert_allclose(out.metrics["clip_frac_high"], 2 / 7, **TOL)
  np.testing.assert_allclose(out.metrics["clip_frac_low"], 1 / 7, **TOL)
  np.testing.assert_allclose(out.metrics["ratio_max"], math.exp(0.5), **TOL)
  np.testing.assert_allclose(out.metrics["ratio_min"], math.exp(-0.4), **TOL)


def test_v7_cispo():
  out, grad = _run("cispo", *V7)
  np.testing.assert_allclose(out.loss, 0.237238, **TOL)
  np.testing.assert_allclose(
      grad, [[-0.182857, -0.157882, -0.116962, -0.182857], [0.095760, 0.150182, 0.129262, 0]], **TOL
  )


def test_v7_minpro():
  out, grad = _run("minpro", *V7)
  w = np.array([[1.28, 1.28, 0.904837, 1.105171], [0.670320, 0.704688, 0.606531, 0]])
  np.testing.assert_allclose(out.token_weights, w, **TOL)
  np.testing.assert_allclose(out.loss, 0.325841, **TOL)
  np.testing.assert_allclose(grad, -w * np.array([[1.0], [-1.0]]) / 7, **TOL)


@pytest.mark.parametrize("method", ["gspo", "gspo_token"])
def test_v7_gspo(method):
  out, grad = _run(method, *V7)
  np.testing.assert_allclose(out.loss, -0.00035, atol=2e-7)
  np.testing.assert_array_equal(grad, 0.0)
  np.testing.assert_allclose(out.token_weights[:, 0], [1.191246, 0.860708], **TOL)


def test_v7_m2po():
  out, grad = _run("m2po", *V7)
  np.testing.assert_allclose(out.loss, -0.188236, **TOL)
  np.testing.assert_allclose(grad, [[0, -0.157882, -0.116962, -0.192837], [0, 0.150182, 0.129262, 0]], **TOL)
  np.testing.assert_allclose(out.metrics["m2po_kept_frac"], 5 / 7, **TOL)
  np.testing.assert_allclose(out.metrics["m2po_second_moment"], 0.080357, **TOL)
  logp, old, adv, mask = _batch(*V7)
  keep = compute_m2po_mask(jnp.asarray(logp - old), adv, mask)
  np.testing.assert_array_equal(keep, [[0, 1, 1, 1], [0, 1, 1, 0]])
  # A precomputed mask (e.g. over the global mini-batch) gives the same result.
  out2 = policy_loss("m2po", logp, old, adv, mask, m2po_mask=keep)
  np.testing.assert_allclose(out2.loss, out.loss, **TOL)


def test_gspo_token_equals_gspo_gradient_when_unclipped():
  logp, old, adv, mask = _batch(*V7)
  f = lambda m: jax.grad(lambda lp: policy_loss(m, lp, old, adv, mask, eps_low=0.5, eps_high=0.5).loss)(logp)
  np.testing.assert_allclose(f("gspo"), f("gspo_token"), **TOL)
  assert np.abs(f("gspo")).max() > 0.01


# ---------------------------------------------------------------- cases (tests/CASES.md)
B01_X = np.array([[2, 2, 2, 2, 2, 6, 5, 3, 2, 4], [10, 3, 4, 5, 2, 3, 4, 1, 1, 3]], np.float32)
B01_M = np.array([[1] * 5 + [0] * 5, [1] + [0] * 9], bool)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 20 / 6),
        ("seq-mean-token-mean", 6.0),
        ("seq-mean-token-sum", 10.0),
        ("seq-mean-token-sum-norm", 1.0),
    ],
)
@pytest.mark.parametrize("garbage", [None, 1e9, np.nan])
def test_b01_loss_aggregation(mode, expected, garbage):
  x = B01_X if garbage is None else np.where(B01_M, B01_X, np.float32(garbage))
  s, d = jax.jit(aggregate_loss, static_argnames=("loss_agg_mode", "max_response_length"))(
      x, B01_M, loss_agg_mode=mode, max_response_length=10
  )
  np.testing.assert_allclose(s / d, expected, rtol=1e-6)


def _b03(adv):
  logp = np.array([[-0.1, -0.2]], np.float32)
  old = logp - 100.0
  mask = np.ones_like(logp, bool)
  f = lambda lp: policy_loss("gspo", lp, old, np.array([adv], np.float32), mask, eps_low=0.2, eps_high=0.2).loss
  return jax.jit(f)(logp), jax.jit(jax.grad(f))(logp)


def test_b03_gspo_large_log_ratio():
  loss, grad = _b03(1.0)
  np.testing.assert_allclose(loss, -1.2, **TOL)
  np.testing.assert_array_equal(grad, 0.0)
  loss, grad = _b03(0.0)
  assert loss == 0.0 and np.all(grad == 0.0)
  loss, grad = _b03(-1.0)
  assert np.isfinite(loss) and np.all(np.isfinite(grad))


@pytest.mark.parametrize(
    "r,a,ppo,dual", [(5, 1, -1.2, -1.2), (5, -1, 5.0, 3.0), (0.5, -1, 0.8, 0.8), (0.5, 1, -0.5, -0.5)]
)
def test_b04_dual_clip_side(r, a, ppo, dual):
  logp = np.array([[math.log(r) - 1.0]], np.float32)
  old = np.array([[-1.0]], np.float32)
  adv, mask = np.array([a], np.float32), np.ones((1, 1), bool)
  kw = dict(eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(policy_loss("grpo", logp, old, adv, mask, **kw).loss, ppo, rtol=1e-5)
  np.testing.assert_allclose(policy_loss("grpo", logp, old, adv, mask, dual_clip_c=3.0, **kw).loss, dual, rtol=1e-5)


@pytest.mark.parametrize(
    "r,a,cispo,ppo", [(2.0, 1, -1.28, 0.0), (0.5, 1, -0.5, -0.5), (2.0, -1, 1.28, 2.0), (0.5, -1, 0.5, 0.0)]
)
def test_b05_cispo_vs_ppo_gradient(r, a, cispo, ppo):
  old = np.array([[-1.0]], np.float32)
  logp = old + np.float32(math.log(r))
  adv, mask = np.array([a], np.float32), np.ones((1, 1), bool)
  g = lambda m, **kw: jax.grad(lambda lp: policy_loss(m, lp, old, adv, mask, **kw).loss)(logp)[0, 0]
  np.testing.assert_allclose(g("cispo", eps_high=0.28), cispo, rtol=1e-5)
  np.testing.assert_allclose(g("grpo", eps_low=0.2, eps_high=0.2), ppo, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- masked garbage, accumulation, packing
METHOD_HP = [
    ("minpro", {}),
    ("minpro", {"prefix_statistic": "mean"}),
    ("minpro", {"surrogate": "ppo"}),
    ("grpo", {"dual_clip_c": 3.0}),
    ("gspo", {}),
    ("gspo_token", {}),
    ("cispo", {}),
    ("m2po", {}),
    ("minpro", {"rollout_is": "token", "rollout_mis": "sequence", "rollout_mis_bounds": (0.1, 10.0)}),
    ("minpro", {"loss_agg_mode": "seq-mean-token-sum-norm"}),
]


def _random_batch(seed, b=4, t=12):
  rng = np.random.default_rng(seed)
  old = rng.uniform(-3, -0.05, (b, t)).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
  lengths = rng.integers(1, t + 1, b)
  mask = np.arange(t)[None] < lengths[:, None]
  mask[1] = mask[1][::-1]  # one left-padded row
  adv = rng.normal(size=b).astype(np.float32)
  rollout = (old + rng.normal(0, 0.05, (b, t))).astype(np.float32)
  return logp, old, adv, mask, rollout


@pytest.mark.parametrize("method,hp", METHOD_HP)
def test_garbage_at_masked_positions_is_bit_identical(method, hp):
  logp, old, adv, mask, rollout = _random_batch(0)

  def f(lp, bl, ro, a):
    h = dict(hp)
    if "rollout_is" in h:
      h["rollout_logp"] = ro
    return policy_loss(method, lp, bl, a, mask, **h)

  def run(lp, bl, ro, a):
    (loss, out), g = jax.jit(jax.value_and_grad(lambda x: (f(x, bl, ro, a).loss, f(x, bl, ro, a)), has_aux=True))(lp)
    return out, g

  clean, g_clean = run(logp, old, rollout, np.tile(adv[:, None], (1, 12)))
  dirty_vals = np.array([np.nan, np.inf, -np.inf, 1e30], np.float32)
  adv_bt = np.tile(adv[:, None], (1, 12))
  garbage = np.resize(dirty_vals, logp.shape)
  dirty, g_dirty = run(
      np.where(mask, logp, garbage),
      np.where(mask, old, garbage[::-1]),
      np.where(mask, rollout, garbage),
      np.where(mask, adv_bt, garbage),
  )
  for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(g_clean, g_dirty)
  assert np.all(np.asarray(g_dirty)[~mask] == 0.0)
  assert np.isfinite(clean.loss)


ACCUM_CASES = [(m, hp, "token-mean") for m, hp in METHOD_HP if m != "m2po"] + [
    ("m2po", {"use_global_mask": True}, "token-mean"),
    ("gspo", {}, "seq-mean-token-mean"),
    ("minpro", {}, "seq-mean-token-mean"),
    ("minpro", {}, "seq-mean-token-sum"),
    ("minpro", {"max_response_length": 20}, "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("method,hp,mode", ACCUM_CASES)
def test_micro_batch_accumulation_is_exact(method, hp, mode):
  """Summing loss_sum / denominator over micro-batches reproduces the full-batch loss and gradient."""
  logp, old, adv, mask, rollout = _random_batch(1, b=6)
  hp = dict(hp)
  hp.setdefault("loss_agg_mode", mode)
  use_global = hp.pop("use_global_mask", False)

  @jax.jit
  def run(lp, bl, a, m, ro, m2):
    h = dict(hp)
    if "rollout_is" in h:
      h["rollout_logp"] = ro
    if use_global:
      h["m2po_mask"] = m2
    out, g = jax.value_and_grad(
        lambda x: (lambda o: (o.loss_sum, o))(policy_loss(method, x, bl, a, m, **h)), has_aux=True
    )(lp)
    return out[1], g

  m2 = compute_m2po_mask(jnp.asarray(logp - old), adv, mask)
  full, g_full = run(logp, old, adv, mask, rollout, m2)
  np.testing.assert_allclose(full.loss, full.loss_sum / full.denominator, rtol=1e-6)
  sums, dens, grads = 0.0, 0.0, []
  for sl in (slice(0, 2), slice(2, 4), slice(4, 6)):
    part, g = run(logp[sl], old[sl], adv[sl], mask[sl], rollout[sl], m2[sl])
    sums, dens = sums + part.loss_sum, dens + part.denominator
    grads.append(g)
  np.testing.assert_allclose(sums / dens, full.loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.concatenate(grads) / dens, g_full / full.denominator, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "method,hp,mode",
    [(m, hp, "token-mean") for m, hp in METHOD_HP[:-1]]
    + [("minpro", {}, "seq-mean-token-mean"), ("minpro", {"max_response_length": 5}, "seq-mean-token-sum-norm")],
)
def test_packed_rows_equal_unpacked(method, hp, mode):
  """Two responses packed in one row (with a prompt gap and padding) == the same responses as rows."""
  logp, old, adv, mask, rollout = _random_batch(2, b=2, t=5)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  hp = dict(hp, loss_agg_mode=hp.get("loss_agg_mode", mode))
  adv_bt = np.tile(adv[:, None], (1, 5))
  pad = lambda x, v: np.concatenate(
      [
          np.full((1, 2), v, x.dtype),
          x[0:1, :3],
          np.full((1, 2), v, x.dtype),  # noqa
          x[1:2],
          np.full((1, 1), v, x.dtype),
      ],
      axis=1,
  )
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0]], np.int32)
  pmask = np.array([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0]], bool)
  unpacked_hp, packed_hp = dict(hp), dict(hp)
  if "rollout_is" in hp:
    unpacked_hp["rollout_logp"], packed_hp["rollout_logp"] = rollout, pad(rollout, 7.0)
  vg = lambda f: jax.jit(jax.value_and_grad(lambda lp: (lambda o: (o.loss, o))(f(lp)), has_aux=True))  # noqa
  (_, ref), g_ref = vg(lambda lp: policy_loss(method, lp, old, adv_bt, mask, **unpacked_hp))(logp)
  (_, got), g = vg(
      lambda lp: policy_loss(method, lp, pad(old, -1.0), pad(adv_bt, 5.0), pmask, segment_ids=seg, **packed_hp)
  )(pad(logp, -2.0))
  np.testing.assert_allclose(got.loss, ref.loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got.denominator, ref.denominator)
  np.testing.assert_allclose(got.token_weights[0][pmask[0]], ref.token_weights[mask], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g[0][pmask[0]], g_ref[mask], rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(g[0][~pmask[0]], 0.0)


# ---------------------------------------------------------------- rollout correction and diagnostics
def test_rollout_tis_and_mis():
  logp, old, adv, mask = _batch(*V1)
  rollout = old - np.array([[1.0, 0.2, -1.0, 0.0]], np.float32)  # old - rollout = [1, .2, -1, 0]
  base = policy_loss("cispo", logp, old, adv, mask)
  tis = policy_loss("cispo", logp, old, adv, mask, rollout_logp=rollout, rollout_is="token", tis_cap=2.0)
  corr = np.minimum(np.exp([1.0, 0.2, -1.0, 0.0]), 2.0)
  np.testing.assert_allclose(tis.token_weights[0], base.token_weights[0] * corr, **TOL)
  seq = policy_loss("cispo", logp, old, adv, mask, rollout_logp=rollout, rollout_is="sequence", tis_cap=1.5)
  np.testing.assert_allclose(seq.token_weights[0], base.token_weights[0] * math.exp(0.2), **TOL)  # sum d = 0.2
  seq = policy_loss("cispo", logp, old, adv, mask, rollout_logp=rollout, rollout_is="sequence", tis_cap=1.1)
  np.testing.assert_allclose(seq.token_weights[0], base.token_weights[0] * 1.1, **TOL)
  mis = policy_loss(
      "cispo", logp, old, adv, mask, rollout_logp=rollout, rollout_mis="token", rollout_mis_bounds=(0.5, 2.0)
  )
  np.testing.assert_allclose(mis.token_weights[0], base.token_weights[0] * np.array([0, 1, 0, 1]), **TOL)
  assert mis.denominator == 4.0  # rejected tokens still count
  np.testing.assert_allclose(mis.metrics["mis_kept_frac"], 0.5)
  g = jax.grad(lambda lp: policy_loss("cispo", lp, old, adv, mask, rollout_logp=rollout, rollout_is="token").loss)(logp)
  np.testing.assert_allclose(g[0], -base.token_weights[0] * corr / 4, **TOL)
  with pytest.raises(ValueError, match="rollout_logp"):
    policy_loss("cispo", logp, old, adv, mask, rollout_is="token")


def test_rollout_sequence_tis_value():
  logp, old, adv, mask = _batch(*V1)
  rollout = old - 0.05  # sum over 4 tokens of 0.05 = 0.2 -> weight exp(0.2) < cap
  base = policy_loss("grpo", logp, old, adv, mask)
  seq = policy_loss("grpo", logp, old, adv, mask, rollout_logp=rollout, rollout_is="sequence")
  np.testing.assert_allclose(seq.loss, base.loss * math.exp(0.2), rtol=1e-5)


def test_mismatch_metrics_and_inference_gap():
  logp = np.array([[-1.0, -2.0, 5.0], [-0.5, 7.0, 7.0]], np.float32)
  beh = np.array([[-1.1, -1.8, np.nan], [-0.7, np.inf, 0.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
  d = np.array([0.1, -0.2, 0.2])
  m = jax.jit(mismatch_metrics)(logp, beh, mask)
  np.testing.assert_allclose(m["mismatch_abs_mean"], np.abs(d).mean(), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_max_abs"], 0.2, rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_k1"], -d.mean(), rtol=1e-4)
  np.testing.assert_allclose(m["mismatch_k3"], (np.exp(d) - 1 - d).mean(), rtol=1e-3)
  adv = np.array([1.0, -2.0], np.float32)
  t = jax.jit(inference_gap_t_post)(logp, beh, adv, mask)
  expected = -np.mean([math.exp(-0.05) * 1.0, math.exp(0.2) * -2.0])
  np.testing.assert_allclose(t, expected, rtol=1e-5)


# ---------------------------------------------------------------- validation
def test_errors_name_the_problem():
  logp, old, adv, mask = _batch(*V1)
  with pytest.raises(ValueError, match=r"method 'ppo2'.*minpro.*m2po"):
    policy_loss("ppo2", logp, old, adv, mask)
  with pytest.raises(ValueError, match=r"'eps_hi'.*eps_high"):
    policy_loss("minpro", logp, old, adv, mask, eps_hi=0.2)
  with pytest.raises(ValueError, match=r"prefix.statistic 'max'.*geomean"):
    policy_loss("minpro", logp, old, adv, mask, prefix_statistic="max")
  with pytest.raises(ValueError, match=r"loss_agg_mode 'mean'.*seq-mean-token-sum-norm"):
    policy_loss("grpo", logp, old, adv, mask, loss_agg_mode="mean")
  with pytest.raises(ValueError, match="surrogate"):
    policy_loss("minpro", logp, old, adv, mask, surrogate="dpo")
  with pytest.raises(ValueError, match="advantages must have shape"):
    policy_loss("minpro", logp, old, np.zeros((2,), np.float32), mask)
  with pytest.raises(ValueError, match="behavior_logp"):
    policy_loss("minpro", logp, old[:, :2], adv, mask)
  with pytest.raises(ValueError, match="statistic"):
    prefix_log_factor(logp, mask, statistic="median")
  with pytest.raises(ValueError, match="segment_ids"):
    prefix_log_factor(logp, mask, segment_ids=np.ones(logp.shape, np.float32))
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    policy_loss("minpro", logp, old, adv[:, None], mask, segment_ids=np.ones(logp.shape, np.int32))
  with pytest.raises(ValueError, match="eps_low"):
    policy_loss("grpo", logp, old, adv, mask, eps_low=1.5)


def test_output_is_a_pytree_and_metrics_are_scalars():
  logp, old, adv, mask = _batch(*V7[:3], V7[3])
  for method in ("minpro", "grpo", "gspo", "gspo_token", "cispo", "m2po"):
    out = jax.jit(lambda lp, m=method: policy_loss(m, lp, old, adv, mask))(logp)
    assert isinstance(out, PolicyLossOutput)
    assert out.token_weights.shape == logp.shape and out.token_weights.dtype == jnp.float32
    assert all(v.shape == () and v.dtype == jnp.float32 for v in out.metrics.values()), method
    assert all(np.isfinite(v) for v in out.metrics.values())


# ---------------------------------------------------------------- registry
BUILTIN_DEFAULTS = {
    "minpro": {
        "eps_low": None,
        "eps_high": 0.28,
        "prefix_statistic": "min",
        "prefix_cap_at_one": False,
        "surrogate": "reinforce",
    },
    "grpo": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": None},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
    "cispo": {"eps_low": None, "eps_high": 0.28},
    "m2po": {"m2_threshold": 0.04, "m2po_mask": None},
}


def test_registry_holds_the_builtins_with_their_defaults():
  assert list(OBJECTIVES)[:6] == list(BUILTIN_DEFAULTS)
  for name, defaults in BUILTIN_DEFAULTS.items():
    objective = get_objective(name)
    assert objective.name == name and dict(objective.defaults) == defaults, name
    assert (objective.prepare is not None) == (name == "m2po"), name
  with pytest.raises(TypeError):
    get_objective("grpo").defaults["eps_low"] = 0.1  # read-only
  with pytest.raises(ValueError, match=r"method 'ppo2'.*minpro.*m2po"):
    get_objective("ppo2")
  with pytest.raises(ValueError, match=r"'grpo' is already registered"):
    register_objective("grpo", defaults={})
  assert resolve_hparams("gspo", {"eps_high": 0.1})["loss_agg_mode"] == "seq-mean-token-mean"
  with pytest.raises(ValueError, match=r"'dual_clip_c'.*valid: .*eps_high"):
    resolve_hparams("cispo", {"dual_clip_c": 3.0})
  # M2PO's prepare step is its whole-batch keep-mask
  logp, old, adv, mask = _batch(*V7)
  prepared = get_objective("m2po").prepare(jnp.asarray(logp - old), adv, mask, resolve_hparams("m2po", {}))
  np.testing.assert_array_equal(prepared["m2po_mask"], compute_m2po_mask(jnp.asarray(logp - old), adv, mask))


def test_a_registered_toy_objective_runs_through_policy_loss():
  @register_objective("toy_reinforce_test", defaults={"scale": 1.0})
  def toy(inputs, hp):  # plain REINFORCE: -scale * A * logp
    weights = jnp.where(inputs.valid, 1.0, 0.0)
    return -hp["scale"] * inputs.adv * inputs.logp, weights, {"toy_scale": jnp.asarray(hp["scale"])}

  try:
    logp = np.array([[-1.0, -2.0, 9.0]], np.float32)
    old = np.array([[-1.5, -1.0, np.nan]], np.float32)
    adv = np.array([0.5], np.float32)
    mask = np.array([[1, 1, 0]], bool)
    f = lambda lp: policy_loss("toy_reinforce_test", lp, old, adv, mask, scale=2.0)
    out = jax.jit(f)(logp)
    # token losses -2 * 0.5 * [-1, -2] = [1, 2]; token-mean over 2 valid tokens = 1.5; dL/dlogp = -1 / 2
    np.testing.assert_allclose(out.loss, 1.5, **TOL)
    np.testing.assert_allclose(out.denominator, 2.0)
    np.testing.assert_allclose(out.metrics["toy_scale"], 2.0)
    np.testing.assert_array_equal(out.token_weights, [[1.0, 1.0, 0.0]])
    np.testing.assert_allclose(jax.grad(lambda lp: f(lp).loss)(logp), [[-0.5, -0.5, 0.0]], **TOL)
    np.testing.assert_allclose(policy_loss("toy_reinforce_test", logp, old, adv, mask).loss, 0.75, **TOL)
    with pytest.raises(ValueError, match=r"'eps_high'.*valid: .*scale"):
      policy_loss("toy_reinforce_test", logp, old, adv, mask, eps_high=0.2)
  finally:
    del OBJECTIVES["toy_reinforce_test"]
  with pytest.raises(ValueError, match="toy_reinforce_test"):
    get_objective("toy_reinforce_test")
