"""Loss aggregation, rollout (training-inference mismatch) correction, and mismatch diagnostics.

Pure functions used by :func:`minpro_jax.rl.objectives.policy_loss` and by the trainer. All take
``[B, T]`` arrays whose masked positions may hold garbage: inputs are sanitised with ``jnp.where``
before any arithmetic, so nothing at a masked position reaches a value or a gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minpro_jax.rl.prefix import seq_first
from minpro_jax.rl.segments import check_bt, seq_sum, valid_and_starts

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_IS_LEVELS = (None, "token", "sequence")
ROLLOUT_MIS_LEVELS = (None, "token", "sequence", "geometric")
# verl clamps log-ratios to [-20, 20] before exp (core_algos.compute_policy_loss_vanilla).
LOG_RATIO_CLAMP = 20.0


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"Unknown {name} {value!r}; valid choices: {', '.join(map(str, choices))}.")


def aggregate_loss(
    loss_bt: jax.Array,
    response_mask: jax.Array,
    loss_agg_mode: str = "token-mean",
    *,
    segment_ids: jax.Array | None = None,
    max_response_length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Reduce a per-token loss to ``(loss_sum, denominator)``; the loss is ``loss_sum / denominator``.

  Modes (verl ``core_algos.agg_loss``; a sequence is a row, or a segment of a packed row):
    * ``token-mean``: sum over valid tokens / number of valid tokens.
    * ``seq-mean-token-mean``: sum over sequences of (sequence token-mean) / number of sequences.
    * ``seq-mean-token-sum``: sum over sequences of (sequence token-sum) / number of sequences.
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): total token-sum / (number of sequences * max_response_length),
      ``max_response_length`` defaulting to T. (Older verl divides by T only; we keep the Dr. GRPO
      1/(G * L_max) normalisation so that the value is a mean over sequences, case B01 (tests/CASES.md).)
  "Number of sequences" counts sequences with at least one valid token. Because both numbers are sums
  over sequences, accumulating ``loss_sum`` and ``denominator`` over micro-batches (that do not split a
  sequence) and dividing at the end reproduces the full-batch loss exactly.

  Args:
    loss_bt: [B, T] float per-token loss (garbage allowed at masked positions).
    response_mask: [B, T] bool/0-1.
    loss_agg_mode: one of ``LOSS_AGG_MODES``.
    segment_ids: optional [B, T] int packed-row segment ids (see ``minpro_jax.rl.prefix``).
    max_response_length: positive int, only for ``seq-mean-token-sum-norm``.

  Returns:
    (loss_sum, denominator): float32 scalars.

  Raises:
    ValueError: unknown mode, bad shapes, or non-positive ``max_response_length``.
  """
  check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
  check_bt("loss_bt", loss_bt)
  check_bt("response_mask", response_mask, loss_bt.shape)
  valid, starts = valid_and_starts(response_mask, segment_ids)
  loss = jnp.where(valid, loss_bt.astype(jnp.float32), 0.0)
  if loss_agg_mode == "token-mean":
    return jnp.sum(loss), jnp.sum(valid).astype(jnp.float32)
  num_seqs = jnp.sum(seq_first(starts, valid)).astype(jnp.float32)
  if loss_agg_mode == "seq-mean-token-mean":
    count = seq_sum(valid.astype(jnp.float32), starts)
    per_token = jnp.where(valid, loss / jnp.maximum(count, 1.0), 0.0)
    return jnp.sum(per_token), num_seqs
  if loss_agg_mode == "seq-mean-token-sum":
    return jnp.sum(loss), num_seqs
  length = loss_bt.shape[1] if max_response_length is None else max_response_length
  if not isinstance(length, int) or length <= 0:
    raise ValueError(f"max_response_length must be a positive int, got {max_response_length!r}.")
  return jnp.sum(loss), num_seqs * float(length)


def _masked_diff(a: jax.Array, b: jax.Array, valid: jax.Array) -> jax.Array:
  """float32 a - b at valid positions, exactly 0 elsewhere (inputs sanitised before subtracting)."""
  a = jnp.where(valid, a, 0.0).astype(jnp.float32)
  b = jnp.where(valid, b, 0.0).astype(jnp.float32)
  return jnp.where(valid, a - b, 0.0)


def masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
  """Mean of ``x`` over ``valid`` (0 when nothing is valid). ``x`` must be finite where valid."""
  n = jnp.sum(valid)
  return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n, 1).astype(jnp.float32)


def rollout_correction(
    behavior_logp: jax.Array,
    rollout_logp: jax.Array | None,
    valid: jax.Array,
    starts: jax.Array | None,
    *,
    rollout_is: str | None = None,
    tis_cap: float = 2.0,
    rollout_mis: str | None = None,
    rollout_mis_bounds: tuple[float, float] = (0.5, 2.0),
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Detached training-inference correction: TIS weight and MIS keep-mask, both [B, T].

  With d_t = behavior_logp_t - rollout_logp_t (trainer's old log-prob minus the inference engine's):
    * TIS (Yao et al. 2025; verl ``rollout_is``): token w_t = min(exp(d_t), tis_cap); sequence
      w = min(exp(sum_t d_t), tis_cap) for every token of the sequence. Clipped in log space.
    * MIS (Liu, Li et al. 2025 "When Speed Kills Stability"; verl ``rollout_rs``): keep a token iff its
      ratio exp(d_t) (``"token"``), its sequence's exp(sum d) (``"sequence"``) or exp(mean d)
      (``"geometric"``) lies in ``rollout_mis_bounds`` [low, high]. Rejected tokens get zero loss but
      STILL COUNT in the loss denominator (so the loss scale does not depend on the rejection rate and
      micro-batch accumulation with a global token count stays exact).
  All inputs are sanitised at masked positions. Returns (weight_bt, keep_bt, metrics); both arrays are
  1 when the corresponding option is None.
  """
  check_choice("rollout_is", rollout_is, ROLLOUT_IS_LEVELS)
  check_choice("rollout_mis", rollout_mis, ROLLOUT_MIS_LEVELS)
  ones = jnp.ones(valid.shape, jnp.float32)
  if rollout_is is None and rollout_mis is None:
    return ones, valid, {}
  if rollout_logp is None:
    raise ValueError("rollout_is/rollout_mis need rollout_logp ([B, T] inference-engine log-probs).")
  check_bt("rollout_logp", rollout_logp, valid.shape)
  d = _masked_diff(behavior_logp, rollout_logp, valid)
  d_seq = seq_sum(d, starts)
  metrics = {}
  weight = ones
  if rollout_is is not None:
    if not tis_cap > 0:
      raise ValueError(f"tis_cap must be > 0, got {tis_cap!r}.")
    log_w = d if rollout_is == "token" else jnp.broadcast_to(d_seq, d.shape)
    weight = jnp.where(valid, jnp.exp(jnp.minimum(log_w, math.log(tis_cap))), 0.0)
    metrics["tis_weight_mean"] = masked_mean(weight, valid)
    metrics["tis_clip_frac"] = masked_mean((log_w > math.log(tis_cap)).astype(jnp.float32), valid)
  keep = valid
  if rollout_mis is not None:
    low, high = rollout_mis_bounds
    if not 0 < low <= high:
      raise ValueError(f"rollout_mis_bounds must satisfy 0 < low <= high, got {rollout_mis_bounds!r}.")
    if rollout_mis == "token":
      stat = d
    elif rollout_mis == "sequence":
      stat = jnp.broadcast_to(d_seq, d.shape)
    else:
      count = seq_sum(valid.astype(jnp.float32), starts)
      stat = jnp.broadcast_to(d_seq / jnp.maximum(count, 1.0), d.shape)
    keep = valid & (stat >= math.log(low)) & (stat <= math.log(high))
    metrics["mis_kept_frac"] = masked_mean(keep.astype(jnp.float32), valid)
  return jax.lax.stop_gradient(weight), keep, metrics


def k3(delta: jax.Array) -> jax.Array:
  """exp(delta) - 1 - delta elementwise (Schulman's k3 KL estimator), accurate to float32 rounding near 0.

  Written directly, the two cancellations leave 0 or negative values for |delta| < ~1e-3 in fp32 (case B28,
  tests/CASES.md); below 0.1 the Taylor series d^2/2 (1 + d/3 + d^2/12 + d^3/60) is used instead (its truncation
  error is below 1e-9 relative there).

  Args:
    delta: float array of log-ratios (clamp them before, e.g. to +-LOG_RATIO_CLAMP).

  Returns:
    An array of delta's shape and dtype, >= 0.
  """
  d = delta
  series = 0.5 * d * d * (1.0 + d / 3.0 + d * d / 12.0 + d * d * d / 60.0)
  return jnp.where(jnp.abs(d) < 0.1, series, jnp.expm1(d) - d)


def mismatch_metrics(logp: jax.Array, behavior_logp: jax.Array, response_mask: jax.Array) -> dict[str, jax.Array]:
  """Token-level mismatch statistics between two log-prob arrays, over valid tokens.

  With delta = logp - behavior_logp (e.g. trainer vs sampler), returns float32 scalars:
    ``mismatch_abs_mean`` mean |delta|; ``mismatch_max_abs`` max |delta|;
    ``mismatch_k1`` mean(-delta) and ``mismatch_k3`` mean(exp(delta) - 1 - delta), the k1/k3 estimators
    of KL(behavior || logp-policy) on samples from the behavior policy (Schulman's "Approximating KL";
    MIPU's Mismatch-K3). delta is clamped to +-20 before exp.
  Masked positions may hold garbage. Raises ValueError on shape mismatch.
  """
  check_bt("logp", logp)
  check_bt("behavior_logp", behavior_logp, logp.shape)
  check_bt("response_mask", response_mask, logp.shape)
  valid = response_mask.astype(bool)
  delta = _masked_diff(logp, behavior_logp, valid)
  dc = jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return {
      "mismatch_abs_mean": masked_mean(jnp.abs(delta), valid),
      "mismatch_max_abs": jnp.max(jnp.where(valid, jnp.abs(delta), 0.0)),
      "mismatch_k1": masked_mean(-delta, valid),
      "mismatch_k3": masked_mean(k3(dc), valid),
  }


def inference_gap_terms(
    logp_train: jax.Array,
    logp_sampler: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Per-response terms of MIPU's T_post: `(-rho_i * A_i, has_i)`, rho_i = exp(masked_mean_t(logp_train -
  logp_sampler)), the mean log-ratio clamped to +-20 before exp; a response without a valid token has term 0 and
  has_i False.

  Args:
    logp_train: [B, T] float, trainer log-probs at the new weights of tokens sampled by the engine.
    logp_sampler: [B, T] float, the inference engine's log-probs of the same tokens.
    advantages: [B] float per-response advantage (group-centred).
    response_mask: [B, T] bool/0-1.

  Returns ([B] float32, [B] bool). Raises: ValueError on bad shapes.
  """
  check_bt("logp_train", logp_train)
  check_bt("logp_sampler", logp_sampler, logp_train.shape)
  check_bt("response_mask", response_mask, logp_train.shape)
  if advantages.shape != (logp_train.shape[0],):
    raise ValueError(f"advantages must have shape [B]={(logp_train.shape[0],)}, got {tuple(advantages.shape)}.")
  valid = response_mask.astype(bool)
  delta = _masked_diff(logp_train, logp_sampler, valid)
  count = jnp.sum(valid, axis=1).astype(jnp.float32)
  has = count > 0
  mean_delta = jnp.sum(delta, axis=1) / jnp.maximum(count, 1.0)
  rho = jnp.exp(jnp.clip(mean_delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  return jnp.where(has, -rho * advantages.astype(jnp.float32), 0.0), has


def inference_gap_t_post(
    logp_train: jax.Array,
    logp_sampler: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
) -> jax.Array:
  """MIPU step-2 statistic T_post = -mean_i( exp(masked_mean_t(logp_train - logp_sampler)) * A_i ).

  Source: MIPU (arXiv 2606.29526, project page, Step 2). Accept the update iff T_post >= -c. Arguments as
  `inference_gap_terms`; responses without any valid token are excluded from the mean.

  Returns a float32 scalar. Raises: ValueError on bad shapes.
  """
  terms, has = inference_gap_terms(logp_train, logp_sampler, advantages, response_mask)
  return jnp.sum(terms) / jnp.maximum(jnp.sum(has), 1).astype(jnp.float32)
