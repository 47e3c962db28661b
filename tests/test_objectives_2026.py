"""Issue 57's objectives and options against hand vectors from their papers' formulas: DPPO's Binary-TV mask, CPPO's
position-weighted cumulative-prefix mask, mu-GRPO's negative-advantage veto and decoupled PPO (score and A-3PO
interpolation), each with both advantage signs, garbage at masked positions and the same tokens packed into one row;
the per-update effective sample sizes and gradient cosine against numpy; the PPO epochs' row orders and A-3PO's
interpolation weight."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.rl.epochs import epoch_rows
from minpro_jax.rl.ess import ess_metrics, kish_ess_fraction, tree_cosine
from minpro_jax.rl.masks import cppo_mask
from minpro_jax.rl.objectives import policy_loss
from minpro_jax.rl.proximal import interpolation_alpha
from minpro_jax.rl.segments import valid_and_starts

TOL = dict(rtol=1e-5, atol=1e-6)
NAN = float("nan")


def _rows(probs, behavior, adv, width):
  """Right-padded [B, width] log-probs (NaN garbage off the mask), behaviour log-probs, [B] advantages, mask."""
  b = len(probs)
  logp, old = np.full((b, width), NAN, np.float32), np.full((b, width), NAN, np.float32)
  mask = np.zeros((b, width), bool)
  for i, (p, q) in enumerate(zip(probs, behavior)):
    logp[i, : len(p)], old[i, : len(q)], mask[i, : len(p)] = np.log(p), np.log(q), True
  return logp, old, np.asarray(adv, np.float32), mask


def _packed(logp, old, adv, mask):
  """The rows of `_rows` side by side in one packed row: segment i + 1 holds row i's valid tokens, advantages per
  token, padding (segment 0) at the end holding garbage."""
  lens = mask.sum(1)
  width = int(lens.sum()) + 2
  plp, pold = np.full((1, width), NAN, np.float32), np.full((1, width), NAN, np.float32)
  padv, seg = np.zeros((1, width), np.float32), np.zeros((1, width), np.int32)
  at = 0
  for i, n in enumerate(lens):
    plp[0, at : at + n], pold[0, at : at + n] = logp[i, :n], old[i, :n]
    padv[0, at : at + n], seg[0, at : at + n] = adv[i], i + 1
    at += n
  return plp, pold, padv, seg != 0, seg


def _loss_and_grad(method, logp, old, adv, mask, segment_ids=None, **hp):
  def loss(lp):
    return policy_loss(method, lp, old, adv, mask, segment_ids=segment_ids, **hp)

  out = jax.jit(loss)(logp)
  grad = jax.jit(jax.grad(lambda lp: loss(lp).loss))(logp)
  return out, np.where(mask, np.asarray(grad), 0.0)


def _check(method, probs, behavior, adv, loss_sum, grad_sum, **hp):
  """loss_sum and d(loss_sum)/d logp (= grad x denominator) as given, unpacked and packed."""
  logp, old, a, mask = _rows(probs, behavior, adv, max(map(len, probs)) + 1)
  out, grad = _loss_and_grad(method, logp, old, a, mask, **hp)
  np.testing.assert_allclose(out.loss_sum, loss_sum, **TOL)
  want = np.zeros(mask.shape)
  for i, g in enumerate(grad_sum):
    want[i, : len(g)] = g
  np.testing.assert_allclose(grad * float(out.denominator), want, **TOL)
  assert not np.isnan(grad).any()
  plp, pold, padv, pmask, seg = _packed(logp, old, a, mask)
  # a [B, T] hyper-parameter (decoupled PPO's proximal log-probs) packed like the log-probs
  php = {k: _packed(v, v, a, mask)[0] if np.shape(v) == logp.shape else v for k, v in hp.items()}
  pout, pgrad = _loss_and_grad(method, plp, pold, padv, pmask, segment_ids=seg, **php)
  np.testing.assert_allclose(pout.loss_sum, loss_sum, **TOL)
  np.testing.assert_allclose(pout.denominator, out.denominator, **TOL)
  np.testing.assert_allclose(pgrad[pmask] * float(pout.denominator), want[mask], **TOL)
  return out


# ---------------------------------------------------------------- DPPO (arXiv 2602.04879), Binary-TV
def test_dppo_binary_tv_hand_vector():
  """Loss -M sg(min(rho, 10)) A logp; M drops A > 0 tokens with pi - mu > 0.15 and A < 0 ones with pi - mu < -0.15.
  Row 0 (A = +1): D = [0.2, 0.05, 0.4]: only token 1 kept, rho = 1.2. Row 1 (A = -0.5): D = [-0.2, 0.1, -0.45]:
  only token 1 kept, rho = 1.2. Row 2 (A = +1): D = 0.019 kept, rho = 20 capped at 10."""
  probs = [[0.5, 0.3, 0.9], [0.2, 0.6, 0.05], [0.02]]
  behavior = [[0.3, 0.25, 0.5], [0.4, 0.5, 0.5], [0.001]]
  terms = [-1.2 * math.log(0.3), 0.5 * 1.2 * math.log(0.6), -10 * math.log(0.02)]
  out = _check("dppo", probs, behavior, [1.0, -0.5, 1.0], sum(terms), [[0, -1.2, 0], [0, 0.6, 0], [-10.0]])
  assert float(out.denominator) == 7  # token-mean: masked tokens still count
  np.testing.assert_allclose(out.metrics["tv_masked_frac"], 4 / 7, **TOL)
  np.testing.assert_allclose(out.token_weights[:, 1], [1.2, 1.2, 0], **TOL)
  # thresholds 0.5 keep every token, a cap of 100 leaves rho = 20: -sum rho A logp with rho = pi / mu
  rho = [[0.5 / 0.3, 1.2, 1.8], [0.5, 1.2, 0.1], [20.0]]
  loose_sum = sum(-a * r * math.log(p) for a, rs, ps in zip([1.0, -0.5, 1.0], rho, probs) for r, p in zip(rs, ps))
  grads = [[-a * r for r in rs] for a, rs in zip([1.0, -0.5, 1.0], rho)]
  loose = _check("dppo", probs, behavior, [1.0, -0.5, 1.0], loose_sum, grads, tv_low=0.5, tv_high=0.5, ratio_cap=100.0)
  assert float(loose.metrics["tv_masked_frac"]) == 0


# ---------------------------------------------------------------- CPPO (arXiv 2606.10968)
def _cppo_naive(pi, mu, adv, delta=0.2, w_min=0.8, delta_b=0.02):
  """The paper's rule token by token (UniRL `_cppo_mask`), numpy's linear-interpolation quantile."""
  pi, mu = np.asarray(pi, np.float64), np.asarray(mu, np.float64)
  t_len, d = len(pi), np.abs(pi - mu)
  w = [1 - (1 - w_min) * t / max(t_len - 1, 1) for t in range(t_len)]
  budget = float(np.clip(np.quantile(d, 0.9), delta_b, 2 * delta_b))
  spent = allowance = 0.0
  keep = []
  for t in range(t_len):
    toward_mu = adv * (pi[t] / mu[t] - 1) <= 0
    keep.append(bool(toward_mu or w[t] * d[t] <= min(delta, delta + budget * allowance - spent)))
    spent, allowance = spent + w[t] * d[t], allowance + w[t]
  return keep


def test_cppo_hand_vector():
  """Row 0 (A = +1): D = [0.1, 0.15, 0.25, 0.02, 0.25], w = [1, 0.95, 0.9, 0.85, 0.8], budget clip(q_0.9 = 0.25) =
  0.04: t1 Z = 0.1 <= 0.2 kept; t2 Z = 0.1425 > min(0.2, 0.2 + 0.04 - 0.1) = 0.14 masked; t3 masked; t4 moves pi
  toward mu (pi < mu with A > 0), kept; t5 masked. Row 1 (A = -1): D = [0.18, 0.03, 0.15], budget 0.04: t1 Z = 0.18
  <= 0.2 kept; t2 toward mu (pi > mu with A < 0) kept; t3 Z = 0.12 > 0.2 + 0.04 x 1.9 - 0.207 = 0.069 masked.
  Loss -M rho A, its gradient -M rho A."""
  probs = [[0.50, 0.45, 0.60, 0.28, 0.70], [0.12, 0.05, 0.40]]
  behavior = [[0.40, 0.30, 0.35, 0.30, 0.45], [0.30, 0.02, 0.55]]
  assert _cppo_naive(probs[0], behavior[0], 1.0) == [True, False, False, True, False]
  assert _cppo_naive(probs[1], behavior[1], -1.0) == [True, True, False]
  rho0 = [1.25, 0, 0, 0.28 / 0.30, 0]
  rho1 = [0.4, 2.5, 0]
  out = _check("cppo", probs, behavior, [1.0, -1.0], -sum(rho0) + sum(rho1), [[-r for r in rho0], rho1])
  np.testing.assert_allclose(out.metrics["tv_masked_frac"], 4 / 8, **TOL)


def test_cppo_mask_against_the_naive_loop_on_random_sequences():
  """Random lengths (1..9), both advantage signs, a small delta so the prefix budget and its quantile bind; rows
  and the same sequences packed two to a row."""
  rng = np.random.default_rng(0)
  lens = [1, 2, 5, 9, 7, 3]
  probs = [rng.uniform(0.05, 0.95, n) for n in lens]
  behavior = [np.clip(p + rng.normal(0, 0.08, len(p)), 0.01, 0.99) for p in probs]
  adv = np.asarray([1.0, -1.0, 0.5, -0.7, 1.3, -0.2], np.float32)
  hp = dict(tv_delta=0.06, position_weight_min=0.7, prefix_budget=0.03)
  want = [_cppo_naive(p, q, a, 0.06, 0.7, 0.03) for p, q, a in zip(probs, behavior, adv)]
  assert 0 < sum(map(sum, want)) < sum(lens)  # both kept and masked tokens
  logp, old, a, mask = _rows(probs, behavior, adv, 10)
  valid, starts = valid_and_starts(mask, None)
  got = np.asarray(cppo_mask(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(a)[:, None] * valid, valid, starts, **hp))
  for i, n in enumerate(lens):
    assert got[i, :n].tolist() == want[i] and not got[i, n:].any()
  plp, pold, padv, pmask, seg = _packed(logp, old, a, mask)
  valid, starts = valid_and_starts(jnp.asarray(pmask), jnp.asarray(seg))
  got = np.asarray(cppo_mask(jnp.asarray(plp), jnp.asarray(pold), jnp.asarray(padv), valid, starts, **hp))
  assert got[pmask].tolist() == [k for row in want for k in row]


# ---------------------------------------------------------------- mu-GRPO's negative-advantage veto
def test_negative_veto_on_grpo_hand_vector():
  """Threshold 1.5. Row 0 (A = -1): rho = [1.2, 1.6, 0.8, 1.1], the trigger is t2: t2..t4 lose their loss. Row 1
  (A = +1): rho = [1.2, 1.6, 0.8] untouched (a positive response is never vetoed). Row 2 (A = -1): rho = [1.4,
  1.49], no trigger. GRPO per token max(-rho A, -clip(rho, 0.8, 1.28) A): row 0 keeps 1.2, row 1 gives
  [-1.2, -1.28, -0.8] (t2 clipped: no gradient), row 2 [1.4, 1.49]; the denominator still counts all 9 tokens."""
  behavior = [[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5]]
  rho = [[1.2, 1.6, 0.8, 1.1], [1.2, 1.6, 0.8], [1.4, 1.49]]
  probs = [[0.5 * r for r in row] for row in rho]
  out = _check("grpo", probs, behavior, [-1.0, 1.0, -1.0], 1.2 - 1.2 - 1.28 - 0.8 + 1.4 + 1.49,
               [[1.2, 0, 0, 0], [-1.2, 0, -0.8], [1.4, 1.49]], negative_veto=1.5)  # fmt: skip
  assert float(out.denominator) == 9
  np.testing.assert_allclose(out.metrics["negative_veto_frac"], 3 / 9, **TOL)
  off = _check("grpo", probs, behavior, [-1.0, 1.0, -1.0], 1.2 + 1.6 + 0.8 + 1.1 - 1.2 - 1.28 - 0.8 + 1.4 + 1.49,
               [[1.2, 1.6, 0, 1.1], [-1.2, 0, -0.8], [1.4, 1.49]])  # fmt: skip
  assert "negative_veto_frac" not in off.metrics


def test_negative_veto_stays_within_its_segment():
  """Packed: segment 1 (A = -1, rho = [2.0, 1.0]) is vetoed from its first token; segment 2 (A = -1, rho = [1.0,
  1.2]) in the same row keeps both (the veto never crosses a segment start)."""
  probs, behavior = [[0.8, 0.4], [0.4, 0.48]], [[0.4, 0.4], [0.4, 0.4]]
  _check("cispo", probs, behavior, [-1.0, -1.0], 0 + 0 + math.log(0.4) + 1.2 * math.log(0.48), [[0, 0], [1.0, 1.2]],
         negative_veto=1.5)  # fmt: skip
  with pytest.raises(ValueError, match="negative_veto must be a ratio threshold > 1"):
    _check("grpo", probs, behavior, [-1.0, -1.0], 0.0, [[0, 0], [0, 0]], negative_veto=0.9)


# ---------------------------------------------------------------- decoupled PPO
def test_decoupled_ppo_score_hand_vector():
  """Loss min(pi_prox / mu, 2) x max(-r A, -clip(r, 0.8, 1.28) A), r = pi_theta / pi_prox. Row 0 (A = +1): w =
  [1.25, 0.5], r = [1.2, 1.2] unclipped: [-1.5, -0.6]. Row 1 (A = -1): w = [min(5, 2), 4/3], r = [0.72, 1.125]:
  t1 clipped at 0.8 (no gradient) 2 x 0.8 = 1.6, t2 4/3 x 1.125 = 1.5."""
  probs, behavior = [[0.6, 0.3], [0.18, 0.45]], [[0.4, 0.5], [0.05, 0.3]]
  prox = [[0.5, 0.25], [0.25, 0.4]]
  plogp, _, _, _ = _rows(prox, prox, [0, 0], 3)
  out = _check("decoupled_ppo", probs, behavior, [1.0, -1.0], -1.5 - 0.6 + 1.6 + 1.5, [[-1.5, -0.6], [0, 1.5]],
               proximal_logp=plogp)  # fmt: skip
  np.testing.assert_allclose(out.metrics["behavior_weight_clip_frac"], 1 / 4, **TOL)
  np.testing.assert_allclose(out.metrics["behavior_weight_mean"], (1.25 + 0.5 + 2 + 4 / 3) / 4, **TOL)
  with pytest.raises(ValueError, match="needs proximal_logp"):
    _check("decoupled_ppo", probs, behavior, [1.0, -1.0], 0.0, [[0, 0], [0, 0]])
  with pytest.raises(ValueError, match="would correct a second time"):
    _check("decoupled_ppo", probs, behavior, [1.0, -1.0], 0.0, [[0, 0], [0, 0]], proximal_logp=plogp,
           rollout_is="token", rollout_logp=plogp)  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
def test_decoupled_ppo_with_the_behaviour_policy_as_proximal_is_grpo(packed):
  """pi_prox = mu: the behaviour weight is 1 and r is GRPO's ratio, so the loss, gradient and token weights are
  GRPO's (both advantage signs, clipping on both sides, garbage at masked positions)."""
  rng = np.random.default_rng(1)
  lens = [4, 1, 6, 3]
  behavior = [rng.uniform(0.05, 0.9, n) for n in lens]
  probs = [np.clip(q * np.exp(rng.normal(0, 0.4, n)), 1e-3, 0.999) for q, n in zip(behavior, lens)]
  logp, old, adv, mask = _rows(probs, behavior, [1.0, -1.0, 0.7, -0.3], 7)
  seg = None
  if packed:
    logp, old, adv, mask, seg = _packed(logp, old, adv, mask)
  want, want_grad = _loss_and_grad("grpo", logp, old, adv, mask, segment_ids=seg)
  got, got_grad = _loss_and_grad("decoupled_ppo", logp, old, adv, mask, segment_ids=seg, proximal_logp=old)
  np.testing.assert_allclose(got.loss, want.loss, **TOL)
  np.testing.assert_allclose(got_grad, want_grad, **TOL)
  np.testing.assert_allclose(np.asarray(got.token_weights)[mask], np.asarray(want.token_weights)[mask], **TOL)
  assert 0 < float(want.metrics["clip_frac_low"]) + float(want.metrics["clip_frac_high"])  # the clip binds


def test_decoupled_ppo_interpolated_proximal():
  """A-3PO, alpha = 0.5: log pi_prox = log mu + 0.5 (log pi - log mu), e.g. log sqrt(0.6 x 0.4) for row 0 token 1;
  the loss equals the score form fed that hand-computed proximal log-prob. Row 0 (A = +1, rho = [1.5, 0.6]): w = r =
  sqrt(rho) = [1.2247, 0.7746], both unclipped (r = 0.7746 < 0.8 is the unclipped branch for A > 0): loss -rho =
  [-1.5, -0.6], gradient -w r = -rho. Row 1 (A = -1, rho = [1.44]): w = r = 1.2, loss 1.44."""
  probs, behavior = [[0.6, 0.3], [0.432]], [[0.4, 0.5], [0.3]]
  hand = [[math.sqrt(0.6 * 0.4), math.sqrt(0.3 * 0.5)], [math.sqrt(0.432 * 0.3)]]
  plogp, _, _, _ = _rows(hand, hand, [0, 0], 3)
  alpha = np.float32(0.5)
  out = _check("decoupled_ppo", probs, behavior, [1.0, -1.0], -1.5 - 0.6 + 1.44, [[-1.5, -0.6], [1.44]],
               proximal="interpolate", proximal_alpha=alpha)  # fmt: skip
  score = _check("decoupled_ppo", probs, behavior, [1.0, -1.0], -1.5 - 0.6 + 1.44, [[-1.5, -0.6], [1.44]],
                 proximal_logp=plogp)  # fmt: skip
  np.testing.assert_allclose(out.metrics["proximal_log_ratio_mean"], score.metrics["proximal_log_ratio_mean"], **TOL)
  np.testing.assert_allclose(out.metrics["proximal_log_ratio_mean"], 0.5 * np.mean(np.log([1.5, 0.6, 1.44])), **TOL)
  # alpha = 1: pi_prox is the current policy: r = 1 (never clipped) and w = min(rho, 2), a TIS-weighted gradient
  _check("decoupled_ppo", probs, behavior, [1.0, -1.0], -1.5 - 0.6 + 1.44, [[-1.5, -0.6], [1.44]],
         proximal="interpolate", proximal_alpha=np.float32(1.0))  # fmt: skip


def test_interpolation_alpha_by_version():
  """alpha = (v_prox - v_mu) / (v_theta - v_mu): sampled at 10, the step starts at 26, update 3 of it runs at 29."""
  assert interpolation_alpha(np.full(4, 10), 26, 29) == np.float32(16 / 19)
  assert interpolation_alpha(np.full(4, 10), 10, 13) == 0.0  # on-policy step: pi_prox = mu
  assert interpolation_alpha(np.full(4, 10), 10, 10) == 0.0  # all three the same policy
  with pytest.raises(ValueError, match="one sampling version per mini-batch"):
    interpolation_alpha(np.asarray([10, 11]), 26, 29)
  with pytest.raises(ValueError, match="out of order"):
    interpolation_alpha(np.full(2, 10), 30, 29)


# ---------------------------------------------------------------- effective sample size, gradient cosine
def _kish(w):
  w = np.asarray(w, np.float64)
  return w.sum() ** 2 / (len(w) * (w * w).sum())


def test_ess_metrics_against_numpy():
  """A made-up batch of three responses (lengths 3, 1, 2): token weights, log-probs and behaviour log-probs; the
  token ESS over the 6 tokens, the sequence ESS of each response's mean weight, and the sequence-ratio ESS of exp(sum
  of log-ratios) (one of them 40 nats: it must not overflow), unpacked and packed."""
  w = [[0.5, 1.2, 2.0], [0.1], [1.0, 3.0]]
  lr = [[0.3, -0.2, 0.1], [40.0], [-0.5, 0.25]]
  behavior = [[-1.0, -2.0, -0.5], [-3.0], [-0.7, -1.1]]
  width = 4
  tw, logp, old, mask = (np.zeros((3, width), np.float32) for _ in range(4))
  mask = mask.astype(bool)
  for i in range(3):
    n = len(w[i])
    tw[i, :n], old[i, :n], logp[i, :n], mask[i, :n] = w[i], behavior[i], np.add(behavior[i], lr[i]), True
  old[~mask], logp[~mask] = NAN, NAN
  want = {
      "ess/token_frac": _kish(sum(w, [])),
      "ess/seq_frac": _kish([np.mean(x) for x in w]),
      "ess/seq_is_frac": _kish(np.exp(np.asarray([sum(x) for x in lr]) - 40.0)),
  }
  got = jax.jit(ess_metrics)(tw, logp, old, mask)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=k)
  ptw, plp, pold, pmask, seg = _packed(tw, tw, np.zeros(3, np.float32), mask)  # tw twice: its rows packed
  plp, pold, _, _, _ = _packed(logp, old, np.zeros(3, np.float32), mask)
  got = jax.jit(ess_metrics)(np.where(pmask, ptw, 0.0), plp, pold, pmask, seg)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=f"packed {k}")
  assert float(kish_ess_fraction(jnp.ones(5), jnp.ones(5, bool))) == pytest.approx(1.0)
  assert float(kish_ess_fraction(jnp.asarray([1.0, 0, 0, 0]), jnp.ones(4, bool))) == pytest.approx(0.25)


def test_tree_cosine_against_numpy():
  a = {"x": np.asarray([1.0, 2.0, -1.0], np.float32), "y": np.asarray([[0.5, 0.0]], np.float32)}
  b = {"x": np.asarray([0.0, 1.0, 1.0], np.float32), "y": np.asarray([[2.0, -3.0]], np.float32)}
  va, vb = np.concatenate([a["x"], a["y"].ravel()]), np.concatenate([b["x"], b["y"].ravel()])
  want = va @ vb / np.linalg.norm(va) / np.linalg.norm(vb)
  np.testing.assert_allclose(tree_cosine(a, b), want, rtol=1e-6)
  assert np.isnan(float(tree_cosine(jax.tree.map(np.zeros_like, a), b)))


# ---------------------------------------------------------------- PPO epochs
def test_epoch_rows_keep_groups_whole_and_are_reproducible():
  first = epoch_rows(12, 3, 0, seed=7, version=40)
  np.testing.assert_array_equal(first, np.arange(12))  # pass 0: the batch's own order
  second = epoch_rows(12, 3, 1, seed=7, version=40)
  assert sorted(second.tolist()) == list(range(12)) and not np.array_equal(second, first)
  groups = second.reshape(4, 3)
  np.testing.assert_array_equal(groups - groups[:, :1], np.tile(np.arange(3), (4, 1)))  # whole groups
  assert np.all(groups[:, 0] % 3 == 0)
  np.testing.assert_array_equal(epoch_rows(12, 3, 1, seed=7, version=40), second)
  assert not np.array_equal(epoch_rows(12, 3, 2, seed=7, version=40), second)
  assert not np.array_equal(epoch_rows(12, 3, 1, seed=7, version=48), second)
  with pytest.raises(ValueError, match="do not split into groups of 5"):
    epoch_rows(12, 5, 1, seed=0, version=0)
