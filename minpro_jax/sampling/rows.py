"""How many decode rows the continuous sampler runs: `config.sampling.decode_rows`, an int or "auto".

"auto" = as many rows as one device's HBM holds beside what stays resident while the sampler runs (its weights on
its layout, and whatever the caller adds: the learner's state), each row with the static per-row KV cache of
prompt bucket + max_new_tokens slots (held `CACHE_COPIES` times by the compiled loop), per data-parallel group of
the sampler's mesh (`auto_decode_rows`). The
trainer and the compile-only tool resolve it where they build their `Sampler` (`resolve_decode_rows`); the
`Sampler` itself only ever sees an int. On a device that reports no HBM figure (CPU) "auto" keeps `CPU_ROWS`.

Decode rows change no sample: the continuous sampler's responses equal the static sampler's token for token.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from minpro_jax.errors import ConfigError
from minpro_jax.models.config import ModelConfig
from minpro_jax.models.quant import precision_config
from minpro_jax.models.transformer import KVCache, Transformer
from minpro_jax.runtime.inference_mesh import param_shardings
from minpro_jax.runtime.sharding import DEFAULT_RULES, logical_split
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

AUTO = "auto"
CPU_ROWS = 64  # "auto" without an HBM figure (CPU): the Sampler's default
logger = logging.getLogger(__name__)
HEADROOM = 0.1  # the share of HBM "auto" leaves for temporaries (logits, a refill's prefill) and the runtime
# KV caches the continuous sampler's compiled `while_loop` holds at once: 1, the loop updates its cache in place
# (256 rows of Qwen3-8B on a v5p-64 compile to 35.5 GiB per chip with 24.8 GiB of cache; it was 2 while XLA copied
# the carried cache through the refill / decode `cond`: benchmarks/README.md, "Step budget").
CACHE_COPIES = 1


def auto_decode_rows(
    *,
    hbm_bytes: float,
    resident_bytes: float,
    kv_bytes_per_row: float,
    data_groups: int,
    batch_buckets: Sequence[int],
    headroom: float = HEADROOM,
) -> int:
  """The decode rows that fit, per the module docstring's memory model (a pure function of its arguments).

  rows per group = floor((hbm_bytes * (1 - headroom) - resident_bytes) / kv_bytes_per_row); rows = that times
  `data_groups`, rounded down to a batch bucket (the largest bucket <= rows; beyond the largest bucket, a multiple
  of it: the rows the `Sampler` runs are this value rounded up to a bucket, so rounding down keeps it).

  Args:
    hbm_bytes: one device's HBM capacity, bytes (> 0).
    resident_bytes: bytes one device holds while the sampler runs, besides the decode rows' KV cache: the
      sampler's weights on its layout, plus whatever else stays (the learner's parameters and optimizer state).
    kv_bytes_per_row: one decode row's KV cache on one device, bytes (the row's cache over its slots, divided by
      the split of the KV heads over the mesh); > 0.
    data_groups: how many groups the rows are split over (the mesh axes of the "batch" rule); >= 1.
    batch_buckets: the `Sampler`'s increasing batch buckets.
    headroom: the share of `hbm_bytes` left out for temporaries and the runtime, in [0, 1).

  Returns:
    An int >= 1.

  Raises:
    ConfigError: naming `config.sampling.decode_rows`, when not one row per group fits beside the resident bytes.
  """
  usable = hbm_bytes * (1.0 - headroom) - resident_bytes
  per_group = int(usable // kv_bytes_per_row) if usable > 0 else 0
  if per_group < 1:
    gib = 2.0**30
    raise ConfigError(
        f"config.sampling.decode_rows: 'auto' fits no decode row: a device has {hbm_bytes / gib:.1f} GiB of HBM "
        f"({(1 - headroom) * 100:.0f} % usable), {resident_bytes / gib:.1f} GiB stay resident (the sampler's weights "
        f"and the learner's state) and one row's KV cache takes {kv_bytes_per_row / gib:.2f} GiB per device; "
        "shorten data.max_prompt_tokens + sampling.max_new_tokens, split the weights and cache further "
        "(config.sampling.mesh with a larger tensor size), or use a slice with more HBM"
    )
  rows = per_group * int(data_groups)
  buckets = sorted(int(b) for b in batch_buckets)
  top = buckets[-1]
  if rows >= top:
    return rows // top * top
  return max(b for b in buckets if b <= rows) if rows >= buckets[0] else rows


def tree_bytes_per_device(tree) -> int:
  """Bytes one device holds of a tree of arrays or abstract arrays (each leaf's shard shape where it has a
  sharding, else its whole shape)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return int(total)


def sampler_memory(model_config: ModelConfig, precision: str, slots: int, mesh=None, rules=None) -> dict[str, int]:
  """What the sampler keeps on one device, from abstract shapes (nothing is allocated).

  Args:
    model_config: the policy's config; precision: the sampler's ("fp32", "bf16", "fp8"); slots: a decode row's
      cache length (prompt bucket + max_new_tokens); mesh, rules: the sampler's layout (None: one device;
      rules None = `DEFAULT_RULES`).

  Returns:
    {"weight_bytes": the converted parameters' shard on one device, "kv_bytes_per_row": one row's KV cache and
    segment ids on one device (the KV heads split as the "act_kv_heads" rule does where it divides them),
    "data_groups": the mesh axes' size of the "batch" rule (1 without a mesh)}.
  """
  cfg = precision_config(model_config, precision).replace(stack_layers=False, scan_layers=False, remat="none")
  with nnx.use_eager_sharding(False):
    state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[1]
  cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 1, int(slots)))
  kv = tree_bytes_per_device((cache.k, cache.v))
  seg = tree_bytes_per_device(cache.segment_ids)
  if mesh is None:
    return {"weight_bytes": tree_bytes_per_device(state), "kv_bytes_per_row": kv + seg, "data_groups": 1}
  rules = rules or DEFAULT_RULES
  shardings = param_shardings(state, mesh, rules)
  weights = 0
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    shape = shardings[jax.tree_util.keystr(path)].shard_shape(x.shape)
    weights += math.prod(shape) * np.dtype(x.dtype).itemsize
  heads = logical_split(dict(mesh.shape), "act_kv_heads", rules)[1]
  heads = heads if cfg.num_kv_heads % heads == 0 else 1
  return {
      "weight_bytes": int(weights),
      "kv_bytes_per_row": kv // heads + seg,
      "data_groups": logical_split(dict(mesh.shape), "batch", rules)[1],
  }


def resolve_decode_rows(
    value: int | str,
    model_config: ModelConfig,
    *,
    precision: str,
    slots: int,
    mesh=None,
    rules=None,
    hbm_bytes: float | None,
    other_resident_bytes: float = 0.0,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
) -> int:
  """`config.sampling.decode_rows` as the int the `Sampler` takes: an int as it is; "auto" by `auto_decode_rows`
  on `sampler_memory` of the sampler's layout, a row costing `CACHE_COPIES` times its KV cache, or `CPU_ROWS` when
  `hbm_bytes` is None or 0 (CPU).

  Args:
    value: the validated field (`sampler_setup.sampler_decode_rows`).
    other_resident_bytes: bytes per device that stay besides the sampler's weights (the learner's state).
    hbm_bytes: one device's HBM (`device_hbm_bytes`, or a slice's chip figure); batch_buckets: the `Sampler`'s;
      the rest as `sampler_memory`.

  Raises:
    ConfigError: "auto" fits no row (`auto_decode_rows`).
  """
  if value != AUTO:
    return int(value)
  if not hbm_bytes:
    logger.info("sampling.decode_rows=auto: no HBM figure for this device (CPU), so %d decode rows", CPU_ROWS)
    return CPU_ROWS
  mem = sampler_memory(model_config, precision, slots, mesh, rules)
  rows = auto_decode_rows(
      hbm_bytes=hbm_bytes,
      resident_bytes=mem["weight_bytes"] + other_resident_bytes,
      kv_bytes_per_row=CACHE_COPIES * mem["kv_bytes_per_row"],
      data_groups=mem["data_groups"],
      batch_buckets=batch_buckets,
  )
  gib = 2.0**30
  logger.info(
      "sampling.decode_rows=auto: %d decode rows (%.1f GiB HBM, %.1f GiB sampler weights + %.1f GiB other resident, "
      "%.3f GiB KV per row (held %d times), %d data groups, per device)",
      rows,
      hbm_bytes / gib,
      mem["weight_bytes"] / gib,
      other_resident_bytes / gib,
      mem["kv_bytes_per_row"] / gib,
      CACHE_COPIES,
      mem["data_groups"],
  )
  return rows


def device_hbm_bytes(devices: Sequence[Any]) -> int | None:
  """The smallest memory limit (`memory_stats()["bytes_limit"]`) of `devices`, or None where a device reports
  none (CPU)."""
  limits = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats or not stats.get("bytes_limit"):
      return None
    limits.append(int(stats["bytes_limit"]))
  return min(limits) if limits else None
