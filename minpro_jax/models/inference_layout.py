"""The sampler's parameter layouts: per-layer arrays and fused projections, converted from the learner's.

The learner and every checkpoint keep stacked layers ([L, ...] leaves) and one matrix per HF projection.
A decode step on XLA:CPU prefers otherwise:

* per-layer arrays (`unstack_layer_params`): inside a `while_loop`, XLA:CPU copies every slice of a stacked
  weight out of the stack at every step;
* fused projections (`fuse_projection_params`): q/k/v as one `qkv_proj` and, in dense MLPs, gate/up as one
  `gate_up_proj`, so a dense layer runs 4 matmuls per token instead of 7 (MoE experts stay unfused). At
  batch 1 each matmul streams a few MB of weights and XLA:CPU's fixed cost per dot is a large part of the
  step (`benchmarks/decode.py` measures both layouts in the same run).

Both conversions only move values (no arithmetic), so the converted model computes the same function up to
the matmul's summation order. The sampler fake-quantizes (FP8) *before* fusing, so each original tensor keeps
the per-tensor scale of `minpro_jax.models.quant` and mu does not depend on the layout. (vLLM's FP8 path
differs: it requantizes a fused matrix with one max scale.)

Sharding: the fused matrices keep the tensor-parallel split of the unfused ones as long as the mesh axes
that split heads divide the KV-head count (`fusion_keeps_sharding`); the sampler does not fuse otherwise.
"""

from __future__ import annotations

import math

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


def _mesh_axes(logical: str, mesh: jax.sharding.Mesh, rules) -> tuple[str, ...]:
  for name, axes in rules:
    if name == logical:
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      return tuple(a for a in axes if a in mesh.shape)
  return ()


def fusion_keeps_sharding(config: ModelConfig, mesh: jax.sharding.Mesh | None, rules=None) -> bool:
  """Whether the fused layout shards like the unfused one on `mesh` under the logical-axis `rules`.

  `qkv_proj` is split by KV head, `q_proj` by query head: the same mesh axes must split both, and their size
  must divide `num_kv_heads` (else the fused matrix would be replicated on every device). `gate_up_proj`
  keeps `mlp` as its split axis, so it never decides.

  Args:
    config: the model config.
    mesh: the sampler's mesh, or None (one device: always True).
    rules: logical-axis rules (default `minpro_jax.sharding.DEFAULT_RULES`).
  """
  if mesh is None:
    return True
  from minpro_jax.sharding import DEFAULT_RULES
  rules = rules or DEFAULT_RULES
  q_axes, kv_axes = _mesh_axes("q_heads", mesh, rules), _mesh_axes("kv_heads", mesh, rules)
  n = math.prod(mesh.shape[a] for a in kv_axes)
  return q_axes == kv_axes and config.num_kv_heads % n == 0


def fuse_projection_params(state: nnx.State, config: ModelConfig) -> nnx.State:
  """A per-layer parameter State rewritten for `config.replace(fuse_projections=True)`.

  Per layer, `qkv_proj[:, k, j] = q_proj[:, k * G + j]` for j < G = H / K, `qkv_proj[:, k, G] = k_proj[:, k]`,
  `qkv_proj[:, k, G + 1] = v_proj[:, k]` ([D, K, G + 2, head_dim]: each KV head next to the query heads that
  read it, so splitting the KV-head axis keeps every group on one device), and `gate_up_proj[:, :, 0] =
  gate_proj`, `gate_up_proj[:, :, 1] = up_proj` ([D, F, 2]: F outermost, so its split survives the matmul's
  flattening). Mixture-of-experts blocks keep their experts as they are; every other leaf is passed through.

  Args:
    state: the `nnx.State` of a `Transformer` built with `config` (per-layer: `stack_layers=False`, e.g. the
      output of `unstack_layer_params`), any dtype.
    config: that model's config (`stack_layers=False`, `fuse_projections=False`).

  Returns:
    A State to merge with the graphdef of `Transformer(config.replace(fuse_projections=True))`. Under jit the
    concatenations run once; the result is a copy of the projection weights.

  Raises:
    ValueError: `config` is stacked or already fused; `state` is not per-layer with `config.num_layers`
      layers, is already fused, or has a projection of another shape than `config` gives (names the path).
  """
  if config.stack_layers or config.fuse_projections:
    raise ValueError("fuse_projection_params needs a per-layer, unfused config (stack_layers=False, "
                     "fuse_projections=False); convert a stacked State with unstack_layer_params first")
  template = _template(config.replace(fuse_projections=True))
  pure = nnx.to_pure_dict(state)
  layers = pure.get("layers", {})
  if sorted(layers, key=str) != sorted(range(config.num_layers), key=str):
    raise ValueError(f"state['layers'] has keys {sorted(layers, key=str)[:6]}..., expected the per-layer indices "
                     f"0..{config.num_layers - 1}; a stacked State needs unstack_layer_params first")
  d, k, g, hd = config.hidden_size, config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
  want = {"q_proj": (d, k * g, hd), "k_proj": (d, k, hd), "v_proj": (d, k, hd)}
  if not config.is_moe:
    want.update(gate_proj=(d, config.intermediate_size), up_proj=(d, config.intermediate_size))
  for i, layer in layers.items():
    for block, name in [("attn", n) for n in ("q_proj", "k_proj", "v_proj")] + \
                       [("mlp", n) for n in ("gate_proj", "up_proj") if n in want]:
      if name not in layer[block]:
        raise ValueError(f"state layers[{i}].{block} has no {name} (fields: {sorted(layer[block])}); "
                         "is it already fused?")
      if tuple(layer[block][name].shape) != want[name]:
        raise ValueError(f"state layers[{i}].{block}.{name} has shape {tuple(layer[block][name].shape)}, "
                         f"the config gives {want[name]}")
    attn = layer["attn"]
    q = attn.pop("q_proj").reshape(d, k, g, hd)
    kv = [attn.pop(name)[:, :, None] for name in ("k_proj", "v_proj")]
    attn["qkv_proj"] = jnp.concatenate([q, *kv], axis=2)
    if not config.is_moe:
      mlp = layer["mlp"]
      mlp["gate_up_proj"] = jnp.stack([mlp.pop("gate_proj"), mlp.pop("up_proj")], axis=-1)
  nnx.replace_by_pure_dict(template, pure)
  return template
