"""Per-update diagnostics of an off-policy estimator: the effective sample size of its weights, and the cosine
between consecutive gradients. Pure jax functions of an update's arrays (`minpro_jax.rl.learner`).

Effective sample size (Kish): for n non-negative weights, ESS / n = (sum w)^2 / (n sum w^2) in (0, 1]; 1 when the
weights are equal, 1/n when one weight carries everything. Three weight sets per update, each over its valid
tokens or sequences (a row, or a segment of a packed row):

  token    the objective's own detached per-token weights (`PolicyLossOutput.token_weights`: MinPRO's clipped prefix
           weight, GRPO's ratio, ...; rollout correction and masks multiplied in);
  seq      the objective's weight of each sequence: the mean of its token weights over the sequence (GSPO: its
           sequence ratio s_i; a sequence-level TIS factor passes through);
  seq_is   the sequence likelihood ratio W_i = prod_t pi_theta(y_t) / mu(y_t) = exp(sum_t l_t), whatever the
           objective: the importance weight of the whole response, whose ESS VCPO (arXiv 2602.17616;
           mit-han-lab/vcpo `compute_ess_info`, unclipped ratios by default) scales the step with (`learner.ess_step`).

The gradient cosine cos(g_k, g_{k-1}) of consecutive updates is GAC's signature (arXiv 2603.01501: persistently high
cosine between consecutive policy gradients under staleness, near-orthogonal on-policy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minpro_jax.rl.prefix import seq_first
from minpro_jax.rl.segments import seq_sum, valid_and_starts


def kish_ess_fraction(weights: jax.Array, valid: jax.Array) -> jax.Array:
  """(sum w)^2 / (n sum w^2) of the non-negative `weights` at `valid` (any shape); 0 when n = 0 or every weight is
  0. Scale-free: the weights are divided by their largest before squaring, so no finite weight overflows."""
  w = jnp.where(valid, weights.astype(jnp.float32), 0.0)
  w = w / jnp.maximum(jnp.max(w), jnp.finfo(jnp.float32).tiny)
  n = jnp.sum(valid).astype(jnp.float32)
  s1, s2 = jnp.sum(w), jnp.sum(w * w)
  return jnp.where((n > 0) & (s2 > 0), s1 * s1 / jnp.maximum(n * s2, jnp.finfo(jnp.float32).tiny), 0.0)


def kish_ess_fraction_log(log_weights: jax.Array, valid: jax.Array) -> jax.Array:
  """`kish_ess_fraction` of exp(`log_weights`) at `valid`, computed after subtracting the largest log-weight (so a
  sequence ratio exp(sum_t l_t) far outside float32's range still gives its ESS)."""
  lw = jnp.where(valid, log_weights.astype(jnp.float32), -jnp.inf)
  top = jnp.max(lw)
  w = jnp.where(valid, jnp.exp(lw - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  return kish_ess_fraction(w, valid)


def ess_metrics(
    token_weights: jax.Array,
    logp: jax.Array,
    behavior_logp: jax.Array,
    response_mask: jax.Array,
    segment_ids: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """The three ESS fractions of the module docstring for one update's mini-batch.

  Args:
    token_weights: [B, T] the objective's detached per-token weights (0 off the response).
    logp: [B, T] the learner's log-probs at the update's parameters; behavior_logp: [B, T] mu's.
    response_mask: [B, T] bool/0-1.
    segment_ids: [B, T] int packed-row segment ids, or None (a row is one sequence).

  Returns:
    {"ess/token_frac", "ess/seq_frac", "ess/seq_is_frac"}: float32 scalars in [0, 1].
  """
  valid, starts = valid_and_starts(response_mask, segment_ids)
  first = seq_first(starts, valid)  # one position per sequence
  w = jnp.where(valid, token_weights.astype(jnp.float32), 0.0)
  count = seq_sum(valid.astype(jnp.float32), starts)
  seq_w = jnp.broadcast_to(seq_sum(w, starts) / jnp.maximum(count, 1.0), valid.shape)
  lr = jnp.where(valid, logp.astype(jnp.float32) - behavior_logp.astype(jnp.float32), 0.0)
  seq_log_w = jnp.broadcast_to(seq_sum(lr, starts), valid.shape)
  return {
      "ess/token_frac": kish_ess_fraction(w, valid),
      "ess/seq_frac": kish_ess_fraction(seq_w, first),
      "ess/seq_is_frac": kish_ess_fraction_log(seq_log_w, first),
  }


def tree_cosine(a, b) -> jax.Array:
  """float32 cosine between two pytrees of arrays as flat vectors; NaN when either is the zero vector."""
  dot = sum(
      jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  na = jnp.sqrt(sum(jnp.vdot(x, x) for x in (v.astype(jnp.float32) for v in jax.tree.leaves(a))))
  nb = jnp.sqrt(sum(jnp.vdot(y, y) for y in (v.astype(jnp.float32) for v in jax.tree.leaves(b))))
  return jnp.where((na > 0) & (nb > 0), dot / jnp.maximum(na * nb, jnp.finfo(jnp.float32).tiny), jnp.nan)
