"""Gradient fidelity on an exact toy (issue 38, part 1, Tier A): how well each objective's gradient from N stale
samples follows the true policy gradient grad J(pi).

The toy is a tabular Markov "language model": logits ``theta[t, prev, next]`` ([T, V, V] f32) give
pi(x_t | x_{t-1}) = softmax(theta[t, x_{t-1}]), with x_{-1} = token 0 (BOS). Which tokens are correct is the reward
structure (`correct_sets`): ``correct`` [T, V, V] bool, token `next` correct at position t after `prev`, either the
same set of ``num_correct`` tokens after every prev (``[T, V]`` is accepted for that case) or a set that depends
on the previous token (issue 55: for one correct token, x_t is correct iff x_t = (x_{t-1} + t) mod V). The reward
is all-or-nothing: 1 when the response makes at most ``tolerance`` (E) errors (tokens outside the correct set),
else 0. With several correct tokens per position the policy keeps entropy that the reward ignores (like an LLM's
wording) and the log-ratio of a drifted policy grows with T even where it does not matter for the reward; with one
correct successor the drift follows the reward.

J(theta) = P(errors <= E) is exact by dynamic programming over (position, errors so far, previous token), and
grad J is `jax.grad` of it. An objective's estimate g_hat from N responses of mu is the codebase's own
`minpro_jax.rl.objectives.policy_loss` chained into the toy: the per-token coefficients c = -dL/dlogp (one
`jax.grad` of the loss w.r.t. its logp input) and one VJP of logp(theta) with every method's coefficients vmapped
(`gradient_estimates`); advantages are `minpro_jax.rl.advantages.group_advantages` of the rewards. Metrics per
batch: a = <g, g*>/|g*|^2 and b = |g|^2/|g*|^2, from which `summarize` gives the projection E a, the efficiency
eta = (E a)^2 / E b (signed, its square debiased), the bias cos(E g, g*) and tr Cov(g)/|g*|^2. Pure functions; the runner and the report are
`minpro_jax.lab.fidelity_run` (also its command line).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from minpro_jax.rl.advantages import group_advantages
from minpro_jax.rl.objectives import PolicyLossOutput, policy_loss

BOS = 0
# Sequence-level IS reference: the TIS weight of `rollout_correction`, capped at e^20 (the codebase's log-ratio
# clamp) so that it stays finite in f32.
SEQUENCE_IS_CAP = math.exp(20.0)


# ------------------------------------------------------------------------------------------------- the toy
def transitions(correct: jax.Array) -> jax.Array:
  """[T, V, V] bool ``correct[t, prev, next]`` of a reward structure given as [T, V, V] or as [T, V] (the same set
  after every prev). Raises ValueError for another rank."""
  if correct.ndim == 2:
    return jnp.broadcast_to(correct[:, None, :], (correct.shape[0], correct.shape[1], correct.shape[1]))
  if correct.ndim != 3 or correct.shape[1] != correct.shape[2]:
    raise ValueError(f"correct must be [T, V] or [T, V, V], got shape {tuple(correct.shape)}.")
  return correct


def init_logits(key: jax.Array, correct: jax.Array, bias: float, scale: float = 1.0) -> jax.Array:
  """[T, V, V] f32 logits: scale * N(0, 1) noise plus ``bias`` on every correct (prev, next) transition."""
  c = transitions(correct)
  noise = scale * jax.random.normal(key, c.shape, jnp.float32)
  return noise + bias * c.astype(jnp.float32)


def random_correct_sets(key: jax.Array, horizon: int, vocab: int, num_correct: int) -> jax.Array:
  """[T, V] bool: ``num_correct`` correct tokens per position, drawn uniformly."""
  if not 0 < num_correct < vocab:
    raise ValueError(f"num_correct must be in [1, vocab - 1] = [1, {vocab - 1}], got {num_correct}.")
  keys = jax.random.split(key, horizon)
  perm = jax.vmap(lambda k: jax.random.permutation(k, vocab))(keys)
  return jnp.zeros((horizon, vocab), bool).at[jnp.arange(horizon)[:, None], perm[:, :num_correct]].set(True)


def correct_sets(key: jax.Array, horizon: int, vocab: int, num_correct: int, dependent: bool) -> jax.Array:
  """[T, V, V] bool: the reward structure with ``num_correct`` correct tokens per (position, previous token).

  ``dependent=False``: `random_correct_sets` (drawn with ``key``), the same after every previous token.
  ``dependent=True``: x_t is correct iff (x_t - x_{t-1} - t) mod V < num_correct (x_{-1} = BOS = 0; ``key``
  unused): the correct set moves with the previous token, so one wrong token shifts what is correct next.

  Raises:
    ValueError: num_correct outside [1, V - 1].
  """
  if not 0 < num_correct < vocab:
    raise ValueError(f"num_correct must be in [1, vocab - 1] = [1, {vocab - 1}], got {num_correct}.")
  if not dependent:
    return transitions(random_correct_sets(key, horizon, vocab, num_correct))
  t, prev, nxt = np.meshgrid(np.arange(horizon), np.arange(vocab), np.arange(vocab), indexing="ij")
  return jnp.asarray((nxt - prev - t) % vocab < num_correct)


def exact_return(theta: jax.Array, correct: jax.Array, tolerance: int) -> jax.Array:
  """J(theta) = P(at most ``tolerance`` errors), f32 scalar, by DP over (position, errors so far, previous token).

  Args:
    theta: [T, V, V] logits. correct: [T, V, V] or [T, V] bool (`transitions`). tolerance: E >= 0 (static).
  """
  if tolerance < 0:
    raise ValueError(f"tolerance must be >= 0, got {tolerance}.")
  _, v, _ = theta.shape
  alpha = jnp.zeros((tolerance + 1, v), jnp.float32).at[0, BOS].set(1.0)  # [errors, prev]

  def step(alpha, xs):
    logits, ok = xs  # [V, V] each
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    q_ok, q_err = alpha @ jnp.where(ok, p, 0.0), alpha @ jnp.where(ok, 0.0, p)  # [E + 1, next]
    shifted = jnp.concatenate([jnp.zeros_like(q_err[:1]), q_err[:-1]], axis=0)  # one more error; over E drops out
    return q_ok + shifted, None

  alpha, _ = jax.lax.scan(step, alpha, (theta, transitions(correct)))
  return jnp.sum(alpha)


def token_abs_log_ratio(theta_pi: jax.Array, theta_mu: jax.Array) -> jax.Array:
  """E_mu[(1/T) sum_t |log pi(x_t | x_{t-1}) - log mu(x_t | x_{t-1})|], f32 scalar, exactly (forward pass over mu's
  marginal of the previous token): the per-token drift the study matches across reward structures and T."""
  v = theta_pi.shape[1]

  def step(carry, xs):
    marginal, total = carry
    lp_pi, lp_mu = (jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in xs)
    p_mu = jnp.exp(lp_mu)
    total = total + marginal @ jnp.sum(p_mu * jnp.abs(lp_pi - lp_mu), axis=-1)
    return (marginal @ p_mu, total), None

  start = (jnp.zeros(v, jnp.float32).at[BOS].set(1.0), jnp.float32(0.0))
  (_, total), _ = jax.lax.scan(step, start, (theta_pi, theta_mu))
  return total / theta_pi.shape[0]


def sample(key: jax.Array, theta: jax.Array, num: int) -> jax.Array:
  """[num, T] int32 responses of the policy with logits ``theta`` (f32 softmax), from BOS."""

  def step(prev, xs):
    logits, k = xs
    tok = jax.random.categorical(k, logits.astype(jnp.float32)[prev], axis=-1).astype(jnp.int32)
    return tok, tok

  keys = jax.random.split(key, theta.shape[0])
  _, toks = jax.lax.scan(step, jnp.full((num,), BOS, jnp.int32), (theta, keys))
  return toks.T


def token_logp(theta: jax.Array, tokens: jax.Array) -> jax.Array:
  """[N, T] f32 log pi(x_t | x_{t-1}) of ``tokens`` [N, T] under logits ``theta`` [T, V, V]."""
  logsm = jax.nn.log_softmax(theta.astype(jnp.float32), axis=-1)
  prev = jnp.concatenate([jnp.full_like(tokens[:, :1], BOS), tokens[:, :-1]], axis=1)
  return logsm[jnp.arange(tokens.shape[1])[None, :], prev, tokens]


def correct_tokens(tokens: jax.Array, correct: jax.Array) -> jax.Array:
  """[N, T] bool: whether each token of ``tokens`` [N, T] is correct after its previous token."""
  prev = jnp.concatenate([jnp.full_like(tokens[:, :1], BOS), tokens[:, :-1]], axis=1)
  return transitions(correct)[jnp.arange(tokens.shape[1])[None, :], prev, tokens]


def rewards(tokens: jax.Array, correct: jax.Array, tolerance: int) -> jax.Array:
  """[N] f32: 1 when a response makes at most ``tolerance`` errors, else 0."""
  return (jnp.sum(~correct_tokens(tokens, correct), axis=1) <= tolerance).astype(jnp.float32)


def calibrate_bias(key, correct, tolerance: int, target_return: float, scale: float = 1.0) -> float:
  """The correct-token bias b of `init_logits` whose J is ``target_return`` (bisection to a relative error of
  1e-3 or 50 halvings)."""
  j_of = jax.jit(lambda b: exact_return(init_logits(key, correct, b, scale), correct, tolerance))
  lo, hi = -5.0, 40.0
  for _ in range(50):
    mid = 0.5 * (lo + hi)
    j = float(j_of(mid))
    if abs(j - target_return) < 1e-3 * target_return:
      break
    lo, hi = (mid, hi) if j < target_return else (lo, mid)
  return mid


def adam_trajectory(
    theta0: jax.Array,
    correct,
    tolerance: int,
    *,
    lr: float,
    keep: int,
    min_steps: int,
    stop_return: float,
    max_steps: int = 5000,
) -> tuple[list[jax.Array], int, list[float]]:
  """On-policy Adam ascent on the exact J (deterministic), run until step k >= ``min_steps`` with
  J(theta_k) >= ``stop_return``.

  Returns (thetas, k, returns): the last ``keep`` + 1 points [theta_{k-keep}, ..., theta_k] (fewer when k < keep),
  the step k, and J at every step 0..k. Raises RuntimeError when J stays below ``stop_return`` for ``max_steps``.
  """
  opt = optax.adam(lr)
  j_of = jax.jit(lambda th: exact_return(th, correct, tolerance))

  @jax.jit
  def step(theta, state):
    g = jax.grad(exact_return)(theta, correct, tolerance)
    upd, state = opt.update(-g, state, theta)
    return optax.apply_updates(theta, upd), state

  thetas, state, theta, returns = [theta0], opt.init(theta0), theta0, []
  for k in range(max_steps + 1):
    returns.append(float(j_of(theta)))
    if k >= min_steps and returns[-1] >= stop_return:
      return thetas, k, returns
    theta, state = step(theta, state)
    thetas = (thetas + [theta])[-(keep + 1) :]
  raise RuntimeError(f"J stayed below {stop_return} for {max_steps} Adam steps (lr {lr}); raise lr.")


# ------------------------------------------------------------------------------------------------- estimators
@dataclasses.dataclass(frozen=True)
class Method:
  """One estimator: a `policy_loss` objective and its hparams; ``sequence_is`` makes it the sequence-level IS
  reference (cispo on-policy, rho = 1, times the sequence weight exp(sum_t l_t) of `rollout_correction`)."""

  name: str
  objective: str
  hparams: tuple[tuple[str, Any], ...] = ()
  sequence_is: bool = False


METHODS: tuple[Method, ...] = (
    Method("minpro:min", "minpro", (("prefix_statistic", "min"),)),
    Method("minpro:mean", "minpro", (("prefix_statistic", "mean"),)),
    Method("minpro:geomean", "minpro", (("prefix_statistic", "geomean"),)),
    Method("minpro:prod", "minpro", (("prefix_statistic", "prod"),)),
    Method("cispo", "cispo"),  # = minpro with prefix_statistic "none"
    Method("grpo", "grpo"),
    Method("gspo", "gspo"),
    Method("gspo_token", "gspo_token"),
    Method("m2po", "m2po"),
    Method("seq_is", "cispo", sequence_is=True),
)
METHOD_NAMES = tuple(m.name for m in METHODS)


def method_loss(method: Method, logp: jax.Array, behavior_logp: jax.Array, advantages: jax.Array) -> PolicyLossOutput:
  """`policy_loss` of ``method`` on [N, T] log-probs of full-length responses (every token valid)."""
  mask = jnp.ones(logp.shape, bool)
  hp = dict(method.hparams)
  if method.sequence_is:
    return policy_loss(
        method.objective,
        logp,
        logp,
        advantages,
        mask,
        rollout_logp=behavior_logp,
        rollout_is="sequence",
        tis_cap=SEQUENCE_IS_CAP,
        **hp,
    )
  return policy_loss(method.objective, logp, behavior_logp, advantages, mask, **hp)


def coefficients(method: Method, logp, behavior_logp, advantages) -> tuple[jax.Array, jax.Array]:
  """(c, w): the per-token coefficients c = -dL/dlogp [N, T] and the token weights [N, T] of ``method``."""

  def loss(lp):
    out = method_loss(method, lp, behavior_logp, advantages)
    return out.loss, out.token_weights

  grad, w = jax.grad(loss, has_aux=True)(logp)
  return -grad, w


def gradient_estimates(
    theta: jax.Array, tokens: jax.Array, behavior_logp: jax.Array, advantages: jax.Array, methods: Sequence[Method]
) -> tuple[jax.Array, jax.Array]:
  """Every method's ascent direction g_hat = -dL/dtheta from one batch: ([M, T, V, V], token weights [M, N, T]).

  One VJP of logp(theta) (``tokens`` [N, T] sampled from the behaviour policy) whose cotangents are the methods'
  coefficients -dL/dlogp, vmapped; equal to -jax.grad of each loss w.r.t. theta (tests/test_fidelity_toy.py).
  """
  logp, vjp = jax.vjp(lambda th: token_logp(th, tokens), theta)
  cw = [coefficients(m, logp, behavior_logp, advantages) for m in methods]
  coefs = jnp.stack([c for c, _ in cw])
  (grads,) = jax.vmap(vjp)(coefs)
  return grads, jnp.stack([w for _, w in cw])


def ess(weights: jax.Array, axis: int = -2) -> jax.Array:
  """Effective sample size fraction (sum w)^2 / (N sum w^2) over ``axis`` (the N samples); 0 when all w are 0."""
  n = weights.shape[axis]
  s1, s2 = jnp.sum(weights, axis), jnp.sum(weights * weights, axis)
  return jnp.where(s2 > 0, s1 * s1 / (n * jnp.where(s2 > 0, s2, 1.0)), 0.0)


class BatchStats(NamedTuple):
  """One batch's numbers per method (M methods, P reported positions)."""

  grad_sum: jax.Array  # [M, D] the estimates (summed by the runner for E g)
  proj: jax.Array  # [M] <g, g*> / |g*|^2
  sq: jax.Array  # [M] |g|^2 / |g*|^2
  ess: jax.Array  # [M, P] per-position ESS fraction of the token weights
  weights: jax.Array  # [M, N, P] token weights at the reported positions
  reward_mean: jax.Array  # [] mean reward of the batch (under mu)
  log_ratio_seq: jax.Array  # [N] sum_t (log pi - log mu)
  weight_split: jax.Array  # [M, 3] summed token weights over `SPLIT` (successes; failures to / after 1st error)
  split_tokens: jax.Array  # [3] the tokens of each part of `SPLIT`
  abs_log_ratio: jax.Array  # [] mean |log pi - log mu| over the batch's tokens


SPLIT = ("success", "failure_to_first_error", "failure_after_first_error")  # the parts of `weight_split`


def weight_split(weights: jax.Array, ok: jax.Array, reward: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sums [M, 3], token counts [3]) of the token weights ``weights`` [M, N, T] over the parts of `SPLIT`: tokens
  of rewarded responses; tokens of unrewarded ones up to and including their first wrong token (``ok`` [N, T]
  False), and after it. The prefix minimum's down-weighting of what follows a failed response's first error shows
  as the third part's mean weight below the second's (issue 55)."""
  after = jnp.cumsum(~ok, axis=1) - (~ok) > 0  # [N, T] a wrong token came before
  failed = (reward == 0)[:, None]
  parts = jnp.stack([jnp.broadcast_to(~failed, ok.shape), failed & ~after, failed & after]).astype(jnp.float32)
  return jnp.einsum("mnt,knt->mk", weights, parts), jnp.sum(parts, axis=(1, 2))


def batch_stats(
    key, theta_pi, theta_mu, g_star, correct, *, tolerance: int, num: int, group: int, methods, positions
) -> BatchStats:
  """Samples ``num`` responses of mu (f32), group-normalised advantages (`group_advantages`, mode grpo, groups of
  ``group``), every method's estimate, and its statistics against g* = grad J(pi)."""
  tokens = sample(key, theta_mu, num)
  logp_mu = token_logp(theta_mu, tokens)
  r = rewards(tokens, correct, tolerance)
  adv = group_advantages(r, jnp.arange(num, dtype=jnp.int32) // group, mode="grpo")
  grads, w = gradient_estimates(theta_pi, tokens, logp_mu, adv, methods)
  g = grads.reshape(len(methods), -1)
  gs = g_star.reshape(-1)
  norm2 = jnp.sum(gs * gs)
  pos = jnp.asarray(positions)
  log_ratio = token_logp(theta_pi, tokens) - logp_mu
  split, split_tokens = weight_split(w, correct_tokens(tokens, correct), r)
  return BatchStats(
      grad_sum=g,
      proj=g @ gs / norm2,
      sq=jnp.sum(g * g, axis=1) / norm2,
      ess=ess(w, axis=1)[:, pos],
      weights=w[:, :, pos],
      reward_mean=jnp.mean(r),
      log_ratio_seq=jnp.sum(log_ratio, axis=1),
      weight_split=split,
      split_tokens=split_tokens,
      abs_log_ratio=jnp.mean(jnp.abs(log_ratio)),
  )


def _eta(proj: np.ndarray, sq: np.ndarray) -> np.ndarray:
  """Signed eta over the batch axis -2: sign(E a) ((E a)^2 - var(a)/R) / E b, the square debiased and not clipped
  (issue 55): where E a is within its standard error of 0 the value crosses to the other sign, and an interval
  over resamples then straddles 0 instead of stopping at it; NaN where every estimate is 0."""
  r = proj.shape[-2]
  mean = proj.mean(-2)
  num = np.sign(mean) * (mean**2 - proj.var(-2, ddof=1) / r)
  den = sq.mean(-2)
  return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def summarize(
    proj: np.ndarray,
    sq: np.ndarray,
    mean_grad: np.ndarray,
    g_star: np.ndarray,
    *,
    reference: int = 0,
    seed: int = 0,
    g_star_norm2: float | None = None,
) -> dict[str, list]:
  """Per-method metrics from R batches that every method shares: proj, sq [R, M]; mean_grad [M, D] (the mean of
  the R estimates); g_star [D]; ``g_star_norm2`` replaces |g_star|^2 where g* is itself estimated (Tier B: the
  unbiased <g_A, g_B> of two independent halves; proj and sq must be normalised by the same number).

  Returns a dict of [M] lists: ``projection`` (E a) and its ``projection_se``; ``sq_mean`` (E b); the signed
  efficiency ``eta`` = sign(E a) ((E a)^2 - var(a)/R) / E b (the issue's eta with the square debiased, not clipped,
  and the sign of the projection kept: negative when the expected step descends J, of the other sign than E a when
  E a is within its standard error of 0; NaN when every estimate is 0, e.g. no batch with a nonzero advantage) with a 95 % percentile bootstrap interval over batches (``eta_low``,
  ``eta_high``, 1000 resamples) and the paired interval of eta minus method ``reference``'s on the same resamples
  (``eta_diff_low``, ``eta_diff_high``); ``trace_cov`` = tr Cov(g)/|g*|^2 (ddof 1); ``bias_cos`` = cos(E g, g*)
  with |E g|^2 debiased by tr Cov / R (None when that is not positive).
  """
  r = proj.shape[0]
  if r < 2:
    raise ValueError(f"summarize needs at least 2 batches, got {r}.")
  gs = g_star.reshape(-1)
  norm2 = float(gs @ gs) if g_star_norm2 is None else float(g_star_norm2)
  mean_sq_norm = np.sum(mean_grad * mean_grad, axis=1) / norm2
  trace_cov = (sq.mean(0) - mean_sq_norm) * r / (r - 1)
  eg2 = mean_sq_norm - trace_cov / r
  cos = [float(p / math.sqrt(e)) if e > 0 else None for p, e in zip(proj.mean(0), eg2)]
  idx = np.random.default_rng(seed).integers(0, r, size=(1000, r))
  boot = _eta(proj[idx], sq[idx])  # [1000, M]
  diff = boot - boot[:, reference : reference + 1]
  q = lambda x, p: np.quantile(x, p, axis=0).tolist()  # noqa: E731
  return {
      "projection": proj.mean(0).tolist(),
      "projection_se": (proj.std(0, ddof=1) / math.sqrt(r)).tolist(),
      "sq_mean": sq.mean(0).tolist(),
      "eta": _eta(proj, sq).tolist(),
      "eta_low": q(boot, 0.025),
      "eta_high": q(boot, 0.975),
      "eta_diff_low": q(diff, 0.025),
      "eta_diff_high": q(diff, 0.975),
      "trace_cov": trace_cov.tolist(),
      "bias_cos": cos,
  }


def truth_error_intervals(
    chunk_proj: np.ndarray, g_sq: np.ndarray, gram: np.ndarray, *, reference: int = 0, seed: int = 0, boot: int = 1000
) -> dict[str, Any]:
  """`summarize`'s eta intervals for an estimated truth (Tier B), carrying the truth's own error (issue 55).

  The truth g* = (g_A + g_B) / 2, each half the mean of C chunk gradients c_i (ascent directions), and |g*|^2 is
  estimated by <g_A, g_B>. Every bootstrap resample draws the R batches and, within each half, C of its chunks
  (with replacement), and recomputes a = <g, g*> / <g_A, g_B> and b = |g|^2 / <g_A, g_B> from the stored inner
  products; eta as `_eta` (not clipped). The batch draws are `summarize`'s with the same seed, so with C identical
  chunks (no truth error) the intervals are `summarize`'s. A resample whose halves have <g_A, g_B> <= 0 has no
  eta (the truth does not know its own direction there); when more than 2.5 % of them do, no interval is given.

  Args:
    chunk_proj: [R, M, 2C] <g_r, c_i> per batch, method and chunk (half A's C chunks first).
    g_sq: [R, M] |g_r|^2.
    gram: [2C, 2C] <c_i, c_j>.
    reference: the method whose eta the paired interval subtracts.
    seed: the rng seed; boot: the resamples.

  Returns:
    {"eta_low", "eta_high", "eta_diff_low", "eta_diff_high"}: [M] lists (95 % percentile intervals; None where
    undefined), and "truth_undefined": the share of resamples with <g_A, g_B> <= 0.
  """
  r, m, c2 = chunk_proj.shape
  c = c2 // 2
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, r, size=(boot, r))
  ia, ib = rng.integers(0, c, size=(boot, c)), c + rng.integers(0, c, size=(boot, c))
  etas, defined = np.full((boot, m), np.nan), np.zeros(boot, bool)
  for b in range(boot):
    norm2 = gram[np.ix_(ia[b], ib[b])].mean()
    defined[b] = norm2 > 0
    if defined[b]:
      p = chunk_proj[idx[b]]  # [R, M, 2C]
      proj = 0.5 * (p[..., ia[b]].mean(-1) + p[..., ib[b]].mean(-1)) / norm2
      etas[b] = _eta(proj, g_sq[idx[b]] / norm2)
  undefined = float(np.mean(~defined))
  diff = etas - etas[:, reference : reference + 1]

  def q(x, p):
    if undefined > 0.025:
      return [None] * m
    return [float(np.quantile(col[np.isfinite(col)], p)) if np.isfinite(col).any() else None for col in x.T]

  return {
      "eta_low": q(etas, 0.025),
      "eta_high": q(etas, 0.975),
      "eta_diff_low": q(diff, 0.025),
      "eta_diff_high": q(diff, 0.975),
      "truth_undefined": undefined,
  }
