"""Token keep-masks of the trust-region objectives, as pure functions of [B, T] arrays.

  * `compute_m2po_mask`: M2PO's second-moment budget (arXiv 2510.01161), over the whole mini-batch.
  * `binary_tv_mask`: DPPO's Binary-TV trust region (arXiv 2602.04879).
  * `cppo_mask`: CPPO's position-weighted Binary-TV threshold with a cumulative prefix budget (arXiv 2606.10968).
  * `negative_veto_mask`: mu-GRPO's negative-advantage veto (arXiv 2605.17570).

Conventions as in `minpro_jax.rl.objectives`: a sequence is a row, or a segment of a packed row
(`minpro_jax.rl.segments`); masked positions may hold garbage and are sanitised before any arithmetic; every mask is
False off the valid tokens and carries no gradient (the objectives use it under ``stop_gradient``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minpro_jax.rl.prefix import seq_cumsum
from minpro_jax.rl.segments import check_bt, segment_keys, seq_sum

CPPO_BUDGET_QUANTILE = 0.9  # the per-sequence quantile of D_t that sets the budget (UniRL `_cppo_mask`)


def token_advantages(advantages: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, T] float32 advantages, 0 off `valid`, from [B] (one per row) or [B, T] (one per token) `advantages`.

  Raises:
    ValueError: `advantages` is neither [B] nor [B, T].
  """
  if advantages.ndim == 1 and advantages.shape[0] == valid.shape[0]:
    adv = advantages[:, None]
  elif advantages.shape == valid.shape:
    adv = advantages
  else:
    raise ValueError(
        f"advantages must have shape [B]={(valid.shape[0],)} or [B, T]={tuple(valid.shape)}, "
        f"got {tuple(advantages.shape)}."
    )
  return jnp.where(valid, adv.astype(jnp.float32), 0.0)


def compute_m2po_mask(
    log_ratio: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    m2_threshold: float = 0.04,
) -> jax.Array:
  """M2PO keep-mask over the WHOLE batch passed in (pass the full global mini-batch).

  Variant implemented (M2PO, arXiv 2510.01161; Trinity-RFT-style, consistent with the authors' "harmful
  tokens" rule): candidates are trust-region tokens (A > 0 and l > 0) or (A < 0 and l < 0); sort their l^2
  ascending and keep the longest sorted prefix whose running mean of l^2 stays <= ``m2_threshold``; drop the
  other candidates. Non-candidate valid tokens are always kept. (Not the authors' released variant that
  turns the budget into global PPO clip bounds.)

  Args:
    log_ratio: [B, T] f32 l = logp - behavior_logp (garbage allowed at masked positions).
    advantages: [B, T] (or [B]) advantages.
    response_mask: [B, T] bool/0-1.
    m2_threshold: tau_M2 > 0.

  Returns: [B, T] bool, true at kept valid tokens. Raises ValueError on bad shapes or threshold.
  """
  check_bt("log_ratio", log_ratio)
  check_bt("response_mask", response_mask, log_ratio.shape)
  if not m2_threshold > 0:
    raise ValueError(f"m2_threshold must be > 0, got {m2_threshold!r}.")
  valid = response_mask.astype(bool)
  lr = jnp.where(valid, log_ratio.astype(jnp.float32), 0.0)
  adv = token_advantages(advantages, valid)
  cand = valid & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
  sq = jnp.where(cand, lr * lr, jnp.inf).reshape(-1)
  order = jnp.argsort(sq, stable=True)
  sorted_sq = sq[order]
  finite = jnp.isfinite(sorted_sq)
  running = jnp.cumsum(jnp.where(finite, sorted_sq, 0.0)) / jnp.arange(1, sq.size + 1, dtype=jnp.float32)
  num_keep = jnp.sum(finite & (running <= m2_threshold))
  rank = jnp.zeros(sq.size, jnp.int32).at[order].set(jnp.arange(sq.size, dtype=jnp.int32))
  keep_cand = cand & (rank.reshape(lr.shape) < num_keep)
  return valid & (~cand | keep_cand)


def _probs(logp: jax.Array, behavior_logp: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(pi, mu): float32 probabilities of the sampled tokens, 1 off `valid` (sanitised log-probs 0 there)."""
  lp = jnp.where(valid, logp, 0.0).astype(jnp.float32)
  blp = jnp.where(valid, behavior_logp, 0.0).astype(jnp.float32)
  return jnp.exp(jnp.minimum(lp, 0.0)), jnp.exp(jnp.minimum(blp, 0.0))


def binary_tv_mask(
    logp: jax.Array,
    behavior_logp: jax.Array,
    adv: jax.Array,
    valid: jax.Array,
    tv_low: float = 0.15,
    tv_high: float = 0.15,
) -> jax.Array:
  """DPPO's Binary-TV keep-mask (arXiv 2602.04879; `_compute_token_mask_for_policy_loss`, loss mode
  ``dppo_binary_tv``, sail-sg/Stable-RL): with D_t = pi(y_t) - mu(y_t), the difference of the sampled token's
  probabilities (the total variation of the binary {y_t, not y_t} split), a token is dropped when the update
  leaves the trust region in the direction its advantage pushes: A > 0 and D_t > tv_high, or A <= 0 and
  D_t < -tv_low. Defaults 0.15 / 0.15: verl's `examples/dppo_trainer/run_qwen30b_dppo.sh` (the authors' recipe).

  Args:
    logp, behavior_logp: [B, T] log-probs of the sampled tokens under pi_theta and mu (<= 0; clamped to 0 above).
    adv: [B, T] float per-token advantages. valid: [B, T] bool.
    tv_low, tv_high: thresholds in probability units, >= 0.

  Returns: [B, T] bool, True at the kept valid tokens.

  Raises:
    ValueError: a negative threshold.
  """
  for name, v in (("tv_low", tv_low), ("tv_high", tv_high)):
    if not (isinstance(v, (int, float)) and v >= 0):
      raise ValueError(f"dppo: {name} must be a number >= 0 (a probability difference), got {v!r}.")
  pi, mu = _probs(logp, behavior_logp, valid)
  d = pi - mu
  out = jnp.where(adv > 0, d > tv_high, d < -tv_low)
  return valid & ~out


def _sequence_quantile(x: jax.Array, valid: jax.Array, starts: jax.Array | None, q: float) -> jax.Array:
  """[B, T] the q-quantile of `x` over each sequence's valid tokens, broadcast to its tokens (linear interpolation
  between order statistics, numpy's and torch's default: x_(floor h) + frac(h) (x_(floor h + 1) - x_(floor h)),
  h = q (n - 1)); 0 at sequences without a valid token."""
  b, t = valid.shape
  if starts is None:
    keys = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    num_keys = b
  else:
    keys, num_keys = segment_keys(starts)
  flat_keys = jnp.where(valid, keys, num_keys).reshape(-1)  # invalid tokens sort after every sequence
  flat_x = jnp.where(valid, x, 0.0).reshape(-1)
  _, sorted_x = jax.lax.sort((flat_keys, flat_x), num_keys=2)
  counts = jax.ops.segment_sum(valid.reshape(-1).astype(jnp.int32), flat_keys, num_segments=num_keys + 1)
  offsets = jnp.cumsum(counts) - counts  # the sorted position of each sequence's smallest value
  n = counts[keys]
  h = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
  lo = jnp.floor(h).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  size = flat_x.shape[0]
  x_lo = sorted_x[jnp.clip(offsets[keys] + lo, 0, size - 1)]
  x_hi = sorted_x[jnp.clip(offsets[keys] + hi, 0, size - 1)]
  return jnp.where(n > 0, x_lo + (h - lo) * (x_hi - x_lo), 0.0)


def cppo_mask(
    logp: jax.Array,
    behavior_logp: jax.Array,
    adv: jax.Array,
    valid: jax.Array,
    starts: jax.Array | None = None,
    tv_delta: float = 0.2,
    position_weight_min: float = 0.8,
    prefix_budget: float = 0.02,
) -> jax.Array:
  """CPPO's keep-mask (arXiv 2606.10968, Eq. 8-11; the authors' `_cppo_mask`, Tencent-Hunyuan/UniRL
  `unirl/algorithms/cppo.py`, Binary-TV variant). For the valid tokens t = 1..T of a sequence:

    D_t = |pi(y_t) - mu(y_t)|                             the Binary-TV divergence of the sampled token
    w_t = 1 - (1 - w_min) (t - 1) / max(T - 1, 1)          position weight, 1 at the first token, w_min at the last
    Z_t = w_t D_t,  S_{t-1} = sum_{j<t} Z_j,  W_{t-1} = sum_{j<t} w_j
    b   = clip(q_0.9(D_1..D_T), delta_b, 2 delta_b)        the sequence's per-token budget
    c_t = min(delta, delta + b W_{t-1} - S_{t-1})
    keep_t = (A (rho_t - 1) <= 0)  or  Z_t <= c_t

  so a token is kept when its update moves pi back toward mu, or when its weighted deviation fits both the
  position-weighted threshold (D_t <= delta / w_t: strict early, relaxed late) and what the prefix has left of its
  cumulative budget. Defaults delta = 0.2, w_min = 0.8, delta_b = 0.02 (`CPPOConfig`). The quantile is taken over
  the sequence's valid tokens with linear interpolation (torch.quantile's default, as the authors' code).

  Args:
    logp, behavior_logp: [B, T] log-probs of the sampled tokens under pi_theta and mu.
    adv: [B, T] float per-token advantages. valid: [B, T] bool.
    starts: segment starts of packed rows (`prefix.valid_and_starts`), or None (a row is one sequence).
    tv_delta, position_weight_min, prefix_budget: delta > 0, w_min in (0, 1], delta_b >= 0.

  Returns: [B, T] bool, True at the kept valid tokens.

  Raises:
    ValueError: a hyper-parameter outside its range.
  """
  if not (isinstance(tv_delta, (int, float)) and tv_delta > 0):
    raise ValueError(f"cppo: tv_delta must be a number > 0 (a probability difference), got {tv_delta!r}.")
  if not (isinstance(position_weight_min, (int, float)) and 0 < position_weight_min <= 1):
    raise ValueError(f"cppo: position_weight_min must lie in (0, 1], got {position_weight_min!r}.")
  if not (isinstance(prefix_budget, (int, float)) and prefix_budget >= 0):
    raise ValueError(f"cppo: prefix_budget must be a number >= 0, got {prefix_budget!r}.")
  pi, mu = _probs(logp, behavior_logp, valid)
  lr = jnp.where(valid, logp.astype(jnp.float32) - behavior_logp.astype(jnp.float32), 0.0)
  d = jnp.where(valid, jnp.abs(pi - mu), 0.0)
  ones = valid.astype(jnp.float32)
  pos = seq_cumsum(ones, starts)  # 1..T at valid tokens
  length = seq_sum(ones, starts)
  w = jnp.where(valid, 1.0 - (1.0 - position_weight_min) * (pos - 1.0) / jnp.maximum(length - 1.0, 1.0), 0.0)
  z = w * d
  spent = seq_cumsum(z, starts, exclusive=True)
  allowance = seq_cumsum(w, starts, exclusive=True)
  budget = jnp.clip(_sequence_quantile(d, valid, starts, CPPO_BUDGET_QUANTILE), prefix_budget, 2.0 * prefix_budget)
  c = jnp.minimum(tv_delta, tv_delta + budget * allowance - spent)
  toward_mu = adv * lr <= 0.0  # A (rho - 1) <= 0: rho - 1 has the sign of l
  return valid & (toward_mu | (z <= c))


def negative_veto_mask(
    log_ratio: jax.Array, adv: jax.Array, valid: jax.Array, starts: jax.Array | None, threshold: float
) -> jax.Array:
  """mu-GRPO's negative-advantage veto (arXiv 2605.17570, "negative-advantage veto, which removes destabilizing
  post-trigger suffix updates in negative-advantage responses"): in a sequence with A < 0, the first valid token
  whose ratio rho_t = pi_theta / mu exceeds `threshold` is the trigger, and it and every later token of the sequence
  lose their loss. Choices where the sources we could read (abstract, project page) leave it open: the trigger
  compares the behaviour ratio rho_t (not a clipped or proximal one) with `threshold`, and the trigger token is
  vetoed with its suffix (for A < 0 the PPO clip bounds rho from below only, so its own term is the largest).

  Args:
    log_ratio: [B, T] float32 log rho (0 off `valid`). adv: [B, T] float per-token advantages. valid: [B, T] bool.
    starts: segment starts of packed rows, or None.
    threshold: the trigger ratio, > 1.

  Returns: [B, T] bool, True at the valid tokens that keep their loss.

  Raises:
    ValueError: threshold <= 1.
  """
  if not (isinstance(threshold, (int, float)) and threshold > 1):
    raise ValueError(f"negative_veto must be a ratio threshold > 1 (None = off), got {threshold!r}.")
  trigger = valid & (adv < 0) & (log_ratio > math.log(threshold))
  vetoed = seq_cumsum(trigger.astype(jnp.int32), starts) > 0
  return valid & ~vetoed
