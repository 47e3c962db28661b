"""The sampler's parameter layouts: per-layer arrays and a fused q/k/v matrix, converted from the learner's.

The learner and every checkpoint keep stacked layers ([L, ...] leaves) and one matrix per HF projection.
A decode step on XLA:CPU prefers otherwise:

* per-layer arrays (`unstack_layer_params`): inside a `while_loop`, XLA:CPU copies every slice of a stacked
  weight out of the stack at every step;
* one `qkv_proj` per layer (`fuse_qkv_params`): attention's three input projections as one matmul, so a
  decode step pays XLA:CPU's fixed cost per dot once instead of three times (`benchmarks/decode.py` times
  both layouts).

Both conversions only move values (no arithmetic), so the converted model computes the same function up to
the matmul's summation order. The sampler fake-quantizes (FP8) *before* fusing, so q, k and v keep the
per-tensor scales of `minpro_jax.models.quant` and mu does not depend on the layout. (vLLM's FP8 path
differs: it requantizes a fused matrix with one max scale.)

Sharding: `qkv_proj` is split by KV head, which keeps the tensor-parallel split of the unfused q/k/v as long
as the mesh axes that split heads divide the KV-head count (`fused_qkv_keeps_sharding`); the sampler does not
fuse otherwise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.sharding import DEFAULT_RULES, logical_to_spec


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


def fused_qkv_keeps_sharding(config: ModelConfig, mesh: jax.sharding.Mesh | None, rules=None) -> bool:
  """Whether `qkv_proj` is split over `mesh` like the unfused q/k/v under the logical-axis `rules`.

  `qkv_proj` is split by KV head and `q_proj` by query head: the same mesh axes must split both, and their
  size must divide `num_kv_heads` (else the fused matrix would be replicated on every device). Mesh axes the
  rules name but the mesh lacks split nothing.

  Args:
    config: the model config.
    mesh: the sampler's mesh, or None (one device: always True).
    rules: logical-axis rules (default `minpro_jax.runtime.sharding.DEFAULT_RULES`), resolved with
      `minpro_jax.runtime.sharding.logical_to_spec` as the parameters' own shardings are.

  Returns:
    True when fusing keeps every q/k/v weight split as before (the sampler then fuses), else False.
  """
  if mesh is None:
    return True
  q_spec, kv_spec = logical_to_spec(("q_heads", "kv_heads"), rules or DEFAULT_RULES)
  names = lambda s: tuple(a for a in ((s,) if isinstance(s, str) else s or ()) if a in mesh.shape)  # noqa: E731
  n = math.prod(mesh.shape[a] for a in names(kv_spec))
  return names(q_spec) == names(kv_spec) and config.num_kv_heads % n == 0


def fuse_qkv_params(state: nnx.State, config: ModelConfig) -> nnx.State:
  """A per-layer parameter State rewritten for `config.replace(fuse_qkv=True)`.

  Per layer, `qkv_proj[:, k, j] = q_proj[:, k * G + j]` for j < G = H / K, `qkv_proj[:, k, G] = k_proj[:, k]`
  and `qkv_proj[:, k, G + 1] = v_proj[:, k]` ([D, K, G + 2, head_dim]: each KV head next to the query heads
  that read it, so splitting the KV-head axis keeps every group on one device). Query head k * G + j reads KV
  head k, the grouped-query mapping of Hugging Face's `repeat_kv` that the unfused attention uses too. Every
  other leaf is passed through.

  Args:
    state: the `nnx.State` of a `Transformer` built with `config` (per-layer: `stack_layers=False`, e.g. the
      output of `unstack_layer_params`), any dtype.
    config: that model's config (`stack_layers=False`, `fuse_qkv=False`).

  Returns:
    A State to merge with the graphdef of `Transformer(config.replace(fuse_qkv=True))`. Under jit the
    concatenation runs once; the result is a copy of the q/k/v weights.

  Raises:
    ValueError: `config` is stacked or already fused; `state` is not per-layer with `config.num_layers`
      layers, is already fused, or has a q/k/v projection of another shape than `config` gives (names it).
  """
  if config.stack_layers or config.fuse_qkv:
    raise ValueError(
        "fuse_qkv_params needs a per-layer, unfused config (stack_layers=False, fuse_qkv=False); "
        "convert a stacked State with unstack_layer_params first"
    )
  template = _template(config.replace(fuse_qkv=True))
  pure = nnx.to_pure_dict(state)
  layers = pure.get("layers", {})
  if set(layers) != set(range(config.num_layers)):
    raise ValueError(
        f"state['layers'] has keys {sorted(layers, key=str)[:6]}..., expected the per-layer indices "
        f"0..{config.num_layers - 1}; a stacked State needs unstack_layer_params first"
    )
  d, k, g, hd = config.hidden_size, config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
  want = {"q_proj": (d, k * g, hd), "k_proj": (d, k, hd), "v_proj": (d, k, hd)}
  for i, layer in layers.items():
    attn = layer["attn"]
    for name, shape in want.items():
      if name not in attn:
        raise ValueError(f"state layers[{i}].attn has no {name} (fields: {sorted(attn)}); is it already fused?")
      if tuple(attn[name].shape) != shape:
        raise ValueError(
            f"state layers[{i}].attn.{name} has shape {tuple(attn[name].shape)}, the config gives " f"{shape}"
        )
    q = attn.pop("q_proj").reshape(d, k, g, hd)
    kv = [attn.pop(name)[:, :, None] for name in ("k_proj", "v_proj")]
    attn["qkv_proj"] = jnp.concatenate([q, *kv], axis=2)
  nnx.replace_by_pure_dict(template, pure)
  return template
