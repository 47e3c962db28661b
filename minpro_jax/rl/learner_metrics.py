"""The learner update's metrics on the devices: response-position bins, micro-batch metric reduction, padding counts.

Pure jax functions of the update's arrays (`minpro_jax.rl.learner`); the host side of a step's metrics is
`minpro_jax.rl.update_metrics`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_POSITION_BINS = 8


def position_bins(response_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """[N, L] int32 bin of each response token's index inside its response (bins of 2^k tokens, last open); with
  packed `segment_ids` the index restarts at every segment."""
  count = jnp.cumsum(response_mask.astype(jnp.int32), axis=1)
  if segment_ids is not None:  # subtract the count before the segment's start, carried along the segment
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    base = jnp.where(segment_ids != prev, count - response_mask.astype(jnp.int32), 0)
    count = count - jax.lax.cummax(base, axis=1)
  edges = 2 ** jnp.arange(1, NUM_POSITION_BINS, dtype=jnp.int32) * 4  # 8, 16, 32, ..., 512
  return jnp.sum((count - 1)[..., None] >= edges, axis=-1)


METRIC_INIT = {"max": -jnp.inf, "min": jnp.inf}


def combine_metric(name: str, acc, value, weight):
  """Micro-batch metrics: *_max / *_min are reduced exactly, *_tokens summed, the rest are token-weighted means."""
  kind = name.rsplit("_", 1)[-1]
  if kind == "tokens":
    return acc + value
  if kind == "max":
    return jnp.maximum(acc, value)
  if kind == "min":
    return jnp.minimum(acc, value)
  return acc + weight * value


@jax.jit(static_argnums=(1,))
def pad_counts(segment_ids: jax.Array, micro_batch: int) -> tuple[jax.Array, jax.Array]:
  """(int32 real tokens of the [M, W] `segment_ids`, int32 micro-batches of `micro_batch` rows holding one): the
  counts `packing.pad_fraction` takes on the host, on the devices (replicated scalars)."""
  real = segment_ids != 0
  per_micro = real.reshape(real.shape[0] // micro_batch, -1).any(1)
  return jnp.sum(real, dtype=jnp.int32), jnp.sum(per_micro, dtype=jnp.int32)
