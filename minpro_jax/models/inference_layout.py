"""The sampler's parameter layouts: per-layer arrays and fused projections, converted from the learner's.

The learner and every checkpoint keep stacked layers ([L, ...] leaves) and one matrix per HF projection.
A decode step on XLA:CPU prefers otherwise:

* per-layer arrays (`unstack_layer_params`): inside a `while_loop`, XLA:CPU copies every slice of a stacked
  weight out of the stack at every step;
* fused projections (`fuse_projection_params`): q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`,
  so a layer runs 4 matmuls per token instead of 7. At batch 1 each matmul streams a few MB of weights, and
  the fixed per-dot cost is a large part of the step (`benchmarks/decode.py` measures both layouts).

Both conversions only move values (no arithmetic), so the converted model computes the same function up to
the matmul's summation order. The sampler fake-quantizes (FP8) *before* fusing, so each original tensor keeps
its own scale, as in vLLM, whose fused QKV layers keep one scale per shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.transformer import Transformer


def _template(config: ModelConfig) -> nnx.State:
  with nnx.use_eager_sharding(False):
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]


def unstack_layer_params(state: nnx.State, config: ModelConfig) -> nnx.State:
  """The parameter State of a stacked-layer model rewritten for `config.replace(stack_layers=False)`.

  Args:
    state: the `nnx.State` of a `Transformer` built with `config` (stacked: every per-layer leaf has a
      leading [L] axis), as `nnx.split(model)[1]` returns it.
    config: that model's config (must have `stack_layers=True`).

  Returns:
    A State whose `layers` entry holds L per-layer subtrees (leaf i = stacked leaf [i]); merge it with the
    graphdef of `Transformer(config.replace(stack_layers=False, scan_layers=False))`. Under jit the slices
    are computed once, so a decode loop that consumes the result never slices the stack per step. The
    result is a copy: it takes as much memory as the parameters.

  Raises:
    ValueError: `config.stack_layers` is False, or `state` does not have the config's layer count.
  """
  if not config.stack_layers:
    raise ValueError("unstack_layer_params needs the stacked config (stack_layers=True)")
  template = _template(config.replace(stack_layers=False, scan_layers=False))
  pure = nnx.to_pure_dict(state)
  stacked = pure["layers"]
  depth = {x.shape[0] for x in jax.tree.leaves(stacked)}
  if depth != {config.num_layers}:
    raise ValueError(f"state has layer stacks of depth {sorted(depth)}, config.num_layers={config.num_layers}")
  pure["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(config.num_layers)}
  nnx.replace_by_pure_dict(template, pure)
  return template


def fuse_projection_params(state: nnx.State, config: ModelConfig) -> nnx.State:
  """A per-layer parameter State rewritten for `config.replace(fuse_projections=True)`.

  Per layer, `qkv_proj[:, k, j] = q_proj[:, k * G + j]` for j < G = H / K, `qkv_proj[:, k, G] = k_proj[:, k]`,
  `qkv_proj[:, k, G + 1] = v_proj[:, k]` ([D, K, G + 2, head_dim]: each KV head next to the query heads that
  read it, so sharding the KV-head axis keeps every group on one device), and `gate_up_proj[:, 0] =
  gate_proj`, `gate_up_proj[:, 1] = up_proj` ([D, 2, F]). Mixture-of-experts blocks keep their experts as they
  are; every other leaf is passed through.

  Args:
    state: the `nnx.State` of a `Transformer` built with `config` (per-layer: `stack_layers=False`, e.g. the
      output of `unstack_layer_params`), any dtype.
    config: that model's config (`stack_layers=False`, `fuse_projections=False`).

  Returns:
    A State to merge with the graphdef of `Transformer(config.replace(fuse_projections=True))`. Under jit the
    concatenations run once; the result is a copy of the projection weights.

  Raises:
    ValueError: `config` is stacked or already fused, or `state` does not have the config's layer count.
  """
  if config.stack_layers or config.fuse_projections:
    raise ValueError("fuse_projection_params needs a per-layer, unfused config (stack_layers=False, "
                     "fuse_projections=False); convert a stacked State with unstack_layer_params first")
  template = _template(config.replace(fuse_projections=True))
  pure = nnx.to_pure_dict(state)
  if len(pure["layers"]) != config.num_layers:
    raise ValueError(f"state has {len(pure['layers'])} layers, config.num_layers={config.num_layers}")
  k, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
  for layer in pure["layers"].values():
    attn = layer["attn"]
    q = attn.pop("q_proj").reshape(config.hidden_size, k, g, config.head_dim)
    kv = [attn.pop(name)[:, :, None] for name in ("k_proj", "v_proj")]
    attn["qkv_proj"] = jnp.concatenate([q, *kv], axis=2)
    mlp = layer["mlp"]
    if "gate_proj" in mlp and not config.is_moe:
      mlp["gate_up_proj"] = jnp.stack([mlp.pop("gate_proj"), mlp.pop("up_proj")], axis=1)
  nnx.replace_by_pure_dict(template, pure)
  return template
