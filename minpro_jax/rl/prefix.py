"""Exclusive prefix statistics of token log-ratios (the MinPRO prefix factor and its ablations).

The public entry point is :func:`prefix_log_factor`, re-exported by :mod:`minpro_jax.rl.objectives`.
Also here: `seq_first`, the first valid token of each sequence (a prefix count). The segment helpers shared by the
objectives (valid-token mask, segment starts, per-sequence sums) are `minpro_jax.rl.masks`.

Conventions (``[B, T]`` = batch x time):
  * A *response* (sequence) is a maximal contiguous run of equal ``segment_ids`` within a row
    (``segment_ids=None``: the whole row is one response, which covers left and right padding).
    Segment id 0 is padding. Only positions with ``response_mask`` true (and segment id != 0) are *valid*.
  * Masked positions are identities of the statistic: they never enter a later prefix and the
    scan carries across them (e.g. prompt tokens inside a packed segment).

Reference: MinPRO, arXiv 2601.22718 (prefix min of token ratios); the other statistics are its ablations
(worked vectors V1-V2, tests/CASES.md).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from minpro_jax.rl.segments import check_bt, valid_and_starts

PREFIX_STATISTICS = ("min", "mean", "geomean", "prod", "none")


def seq_first(starts: jax.Array | None, valid: jax.Array) -> jax.Array:
  """[B, T] bool: true at the first valid token of each sequence (one representative per sequence)."""
  v = valid.astype(jnp.int32)
  if starts is None:
    before = jnp.cumsum(v, axis=1) - v
  else:
    before = _segmented_inclusive(jnp.add, v, starts) - v
  return valid & (before == 0)


def seq_cumsum(x_bt: jax.Array, starts: jax.Array | None, *, exclusive: bool = False) -> jax.Array:
  """[B, T] cumulative sum of ``x_bt`` along each sequence (restarting at every segment start; ``starts=None``: a
  row is one sequence), inclusive of the position itself or, with ``exclusive``, over the positions before it (0 at
  a sequence's first position). ``x_bt`` must already be 0 at masked positions; an integer input sums exactly."""
  zero = jnp.zeros((), x_bt.dtype)
  if starts is None:
    inclusive = jnp.cumsum(x_bt, axis=1)
    return _shift_right(inclusive, zero) if exclusive else inclusive
  inclusive = _segmented_inclusive(jnp.add, x_bt, starts)
  if not exclusive:
    return inclusive
  return jnp.where(starts, zero, _shift_right(inclusive, zero))


def _shift_right(x: jax.Array, fill) -> jax.Array:
  return jnp.concatenate([jnp.full_like(x[:, :1], fill), x[:, :-1]], axis=1)


def _segmented_inclusive(op: Callable, values: jax.Array, starts: jax.Array) -> jax.Array:
  """Inclusive scan along axis 1 that restarts at every ``starts`` position.

  The operator on (reset flag, value) pairs, (f1, v1) . (f2, v2) = (f1 | f2, v2 if f2 else op(v1, v2)),
  is associative whenever ``op`` is, so ``jax.lax.associative_scan`` applies (log-depth, no loop).
  """

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return fa | fb, jnp.where(fb, vb, op(va, vb))

  _, out = jax.lax.associative_scan(combine, (starts, values), axis=1)
  return out


def _exclusive(op: Callable, values: jax.Array, identity: float, starts: jax.Array | None, unsegmented: Callable):
  if starts is None:
    return _shift_right(unsegmented(values), identity)
  inclusive = _segmented_inclusive(op, values, starts)
  return jnp.where(starts, jnp.asarray(identity, values.dtype), _shift_right(inclusive, identity))


def _cummin(x: jax.Array) -> jax.Array:
  return jax.lax.associative_scan(jnp.minimum, x, axis=1)


def _cumsum(x: jax.Array) -> jax.Array:
  return jnp.cumsum(x, axis=1)


def _cumlogsumexp(x: jax.Array) -> jax.Array:
  return jax.lax.associative_scan(jnp.logaddexp, x, axis=1)


def prefix_log_factor(
    log_ratio: jax.Array,
    response_mask: jax.Array,
    statistic: str = "min",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Log of the exclusive prefix statistic of token ratios over strictly preceding valid tokens.

  For valid token t of a response, with l_j = log rho_j = logp_j - behavior_logp_j over the valid tokens
  j < t of the *same* response:
    * ``"min"``: min_{j<t} l_j (MinPRO, arXiv 2601.22718), segmented ``jax.lax.associative_scan``;
    * ``"mean"``: log((1/n) sum_{j<t} exp(l_j)) = exclusive logsumexp - log n (arithmetic mean of ratios);
    * ``"geomean"``: (1/n) sum_{j<t} l_j;
    * ``"prod"``: sum_{j<t} l_j (so factor * rho_t is the exact prefix ratio rho_{1:t});
    * ``"none"``: 0.
  The result is 0 at the first valid token of every response (empty prefix) and at masked positions.

  Args:
    log_ratio: [B, T] float; log-ratios at valid positions (finite). Values at masked positions are
      ignored and may be NaN/inf: they are replaced before any arithmetic.
    response_mask: [B, T] bool/0-1; valid response tokens.
    statistic: one of ``PREFIX_STATISTICS``.
    segment_ids: optional [B, T] int32 for packed rows; each maximal run of equal ids is one response,
      id 0 is padding. None: each row is one response (left or right padding via the mask).

  Returns:
    [B, T] float32. Not meant to be differentiated (the objectives wrap it in ``stop_gradient``).

  Raises:
    ValueError: unknown ``statistic``; arrays not [B, T] or of mismatched shapes; non-integer segment_ids.
  """
  if statistic not in PREFIX_STATISTICS:
    raise ValueError(f"Unknown prefix statistic {statistic!r}; valid choices: {', '.join(PREFIX_STATISTICS)}.")
  check_bt("log_ratio", log_ratio)
  check_bt("response_mask", response_mask, log_ratio.shape)
  valid, starts = valid_and_starts(response_mask, segment_ids)
  lr = log_ratio.astype(jnp.float32)
  zero = jnp.zeros_like(lr)
  if statistic == "none":
    return zero

  if statistic == "min":
    excl = _exclusive(jnp.minimum, jnp.where(valid, lr, jnp.inf), jnp.inf, starts, _cummin)
    return jnp.where(valid & (excl < jnp.inf), excl, zero)

  count = _exclusive(jnp.add, valid.astype(jnp.float32), 0.0, starts, _cumsum)
  has_prefix = valid & (count > 0)
  safe_count = jnp.maximum(count, 1.0)
  if statistic == "mean":
    lse = _exclusive(jnp.logaddexp, jnp.where(valid, lr, -jnp.inf), -jnp.inf, starts, _cumlogsumexp)
    return jnp.where(has_prefix, lse - jnp.log(safe_count), zero)
  total = _exclusive(jnp.add, jnp.where(valid, lr, zero), 0.0, starts, _cumsum)
  if statistic == "prod":
    return jnp.where(valid, total, zero)
  return jnp.where(has_prefix, total / safe_count, zero)  # geomean
