"""Masks and segments of [B, T] token arrays, shared by the objectives and the loss aggregation.

Conventions (``[B, T]`` = batch x time): a *response* (sequence) is a maximal contiguous run of equal
``segment_ids`` within a row (``segment_ids=None``: the whole row is one response). Segment id 0 is padding. Only
positions with ``response_mask`` true (and segment id != 0) are *valid*.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_bt(name: str, x: jax.Array, shape: tuple[int, ...] | None = None) -> None:
  """Checks that `x` is a [B, T] array (of `shape` when given).

  Raises:
    ValueError: naming `name`, its shape and the shape it must have.
  """
  if x.ndim != 2:
    raise ValueError(f"{name} must be a [B, T] array, got shape {tuple(x.shape)}.")
  if shape is not None and tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} has shape {tuple(x.shape)} but must match log-probs shape {tuple(shape)}.")


def valid_and_starts(response_mask: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
  """Valid-token mask and segment-start flags.

  Args:
    response_mask: [B, T] bool or 0/1; true at response tokens that enter the loss.
    segment_ids: [B, T] integer or None. A new segment starts wherever the id differs from the
      previous position (position 0 always starts one). Id 0 marks padding (never valid).

  Returns:
    valid: [B, T] bool. starts: [B, T] bool, or None when ``segment_ids`` is None (one segment per row).
  """
  valid = response_mask.astype(bool)
  if segment_ids is None:
    return valid, None
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array ([B, T] int32), got dtype {segment_ids.dtype}.")
  check_bt("segment_ids", segment_ids, response_mask.shape)
  valid = valid & (segment_ids != 0)
  prev = jnp.concatenate([jnp.full_like(segment_ids[:, :1], -1), segment_ids[:, :-1]], axis=1)
  starts = (segment_ids != prev).at[:, 0].set(True)
  return valid, starts


def segment_keys(starts: jax.Array) -> tuple[jax.Array, int]:
  """Flat per-(row, segment) ids ``b * (T + 1) + local`` and the static number of keys."""
  b, t = starts.shape
  local = jnp.cumsum(starts.astype(jnp.int32), axis=1)  # 1..T
  return local + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None], b * (t + 1)


def seq_sum(x_bt: jax.Array, starts: jax.Array | None) -> jax.Array:
  """Per-sequence sum of ``x_bt`` broadcast back to every position of the sequence ([B, T] or [B, 1]).

  ``x_bt`` must already be 0 at masked positions. With ``starts=None`` a row is one sequence and the
  result has shape [B, 1] (broadcastable); otherwise [B, T].
  """
  if starts is None:
    return jnp.sum(x_bt, axis=1, keepdims=True)
  keys, n = segment_keys(starts)
  totals = jax.ops.segment_sum(x_bt.reshape(-1), keys.reshape(-1), num_segments=n)
  return totals[keys]
