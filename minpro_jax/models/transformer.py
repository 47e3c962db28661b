"""A Flax NNX decoder of the Qwen3 / Qwen3-MoE / Llama family.

One code path covers the three architectures (see `ModelConfig`): RMSNorm, rotate-half RoPE (HF
layout), grouped-query attention with optional per-head q/k RMSNorm (Qwen3), SwiGLU MLPs or a top-k
mixture of experts, tied or untied LM head. It matches Hugging Face `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM` and `LlamaForCausalLM` to fp32 rounding (tests/test_model_hf_parity.py).
Sources: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021, RoFormer), grouped-query attention
(Ainslie et al. 2023), SwiGLU (Shazeer 2020), the Switch load-balancing loss (Fedus et al. 2022, eq. 4).

With `stack_layers=True` (the default; checkpoints and the learner) layers are *stacked*: every per-layer
parameter has a leading `layers` axis (created with `nnx.vmap`), so `scan_layers=True` runs them with
`nnx.scan` and `False` with a Python loop over the same parameters; checkpoints are identical either way.
`stack_layers=False` (the sampler's layout, `minpro_jax.models.unstack_layer_params`) holds one
`DecoderLayer` per layer.

Attention masking is by segment ids and slot order, which covers every use with one rule: a query
attends to a key iff they carry the same non-zero segment id and the key's slot is not after the
query's. Left/right padding is segment 0, packed sequences are segments 1, 2, ..., and the KV cache
of the sampler stores the segment id of each slot.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from minpro_jax.models.attention_core import (
    live_length_attention,
    masked_attention,
)
from minpro_jax.models.attention_dispatch import cache_free_attention, resolve_attention_impl
from minpro_jax.models.config import ModelConfig
from minpro_jax.models.dense import dense
from minpro_jax.models.moe import MoE, init_param
from minpro_jax.models.paged_attention import PagedKVCache, write_slots
from minpro_jax.models.quant import maybe_quant_act
from minpro_jax.models.rope import apply_rope, rope_tables
from minpro_jax.runtime.multihost import settle
from minpro_jax.runtime.sharding import DEFAULT_RULES, constrain, use_mesh


@flax.struct.dataclass
class KVCache:
  """Key/value cache of all layers.

  Layouts are heads-major, the order a decode step's attention contracts without copying the cache
  (a token-major [B, S, K, head_dim] cache is transposed by XLA:CPU at every step): values
  [B, K, S, head_dim]; keys [B, K, head_dim, S] in fp32 (`keys_head_dim_major`: XLA:CPU's fast q.k dot form
  for fp32), else like values (bf16 has no fast dot in the head_dim-major form).

  Attributes:
    k: keys (compute dtype, RoPE already applied): one array with a leading [L] axis when the config stacks
      its layers (`stack_layers=True`), else a tuple of L per-layer arrays (so a decode step reads and
      writes each layer's cache in place instead of slicing it out of a stack).
    v: values, [L, B, K, S, head_dim] or a tuple of L arrays [B, K, S, head_dim].
    segment_ids: [B, S] int32 segment id of each slot (0 = empty or padding; never attended to).
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  segment_ids: jax.Array

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, length: int) -> "KVCache":
    """An empty cache for `batch` rows and `length` slots, in the layout `config.stack_layers` selects."""
    kh, hd, dt = config.num_kv_heads, config.head_dim, config.jnp_dtype
    v_shape, v_axes = (batch, kh, length, hd), ("batch", "act_kv_heads", "cache_seq", None)
    if keys_head_dim_major(dt):
      k_shape, k_axes = (batch, kh, hd, length), ("batch", "act_kv_heads", None, "cache_seq")
    else:
      k_shape, k_axes = v_shape, v_axes
    if config.stack_layers:
      k = constrain(jnp.zeros((config.num_layers, *k_shape), dt), ("layers", *k_axes))
      v = constrain(jnp.zeros((config.num_layers, *v_shape), dt), ("layers", *v_axes))
    else:
      k = tuple(constrain(jnp.zeros(k_shape, dt), k_axes) for _ in range(config.num_layers))
      v = tuple(constrain(jnp.zeros(v_shape, dt), v_axes) for _ in range(config.num_layers))
    return cls(k=k, v=v, segment_ids=jnp.zeros((batch, length), jnp.int32))


def keys_head_dim_major(dtype) -> bool:
  """Whether the key cache of this compute dtype is stored [..., head_dim, S] (fp32) or [..., S, head_dim]."""
  return jnp.dtype(dtype) == jnp.float32


class ModelOutput(NamedTuple):
  """What `Transformer.__call__` returns.

  out: [B, T, V] float32 logits, or [B, T, D] final hidden states (after the final norm) when
    `return_hidden=True`.
  cache: the updated `KVCache` (or `PagedKVCache`), or None when none was given.
  router_aux_loss: scalar float32 load-balancing loss averaged over MoE layers (0 for dense models).
  routes: [B, T, L, k] int16 experts the router chose (its own top-k, also under replay) per token and layer
    (MoE), or None (dense models).
  """

  out: jax.Array
  cache: KVCache | None
  router_aux_loss: jax.Array
  routes: jax.Array | None = None


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, computed in fp32 (HF `Qwen3RMSNorm` / `LlamaRMSNorm`)."""

  def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
    del rngs
    self.eps = eps
    self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("norm",))(None, (dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k RMSNorm and a KV cache."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    pd = c.jnp_param_dtype
    std = 0.02
    self.config = c
    if c.fuse_qkv:  # the sampler's layout (`fuse_qkv_params`); split by KV head
      self.qkv_proj = nnx.Param(
          init_param(std, ("embed", "kv_heads", None, "head_dim"))(
              rngs.params(), (c.hidden_size, c.num_kv_heads, c.num_heads // c.num_kv_heads + 2, c.head_dim), pd
          )
      )
    else:
      self.q_proj = nnx.Param(
          init_param(std, ("embed", "q_heads", "head_dim"))(rngs.params(), (c.hidden_size, c.num_heads, c.head_dim), pd)
      )
      self.k_proj = nnx.Param(
          init_param(std, ("embed", "kv_heads", "head_dim"))(
              rngs.params(), (c.hidden_size, c.num_kv_heads, c.head_dim), pd
          )
      )
      self.v_proj = nnx.Param(
          init_param(std, ("embed", "kv_heads", "head_dim"))(
              rngs.params(), (c.hidden_size, c.num_kv_heads, c.head_dim), pd
          )
      )
    self.o_proj = nnx.Param(
        init_param(std, ("q_heads", "head_dim", "embed"))(rngs.params(), (c.num_heads, c.head_dim, c.hidden_size), pd)
    )
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)
      self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)

  def __call__(self, x_btd, rope, q_segment_bt, kv_segment_bs, cache_kv, cache_index, live_len=None):
    """Attention of T new tokens.

    Args:
      x_btd: [B, T, D] normed input (compute dtype).
      rope: (cos, sin) [B, T, head_dim // 2] float32 tables of the tokens' positions (`rope_tables`).
      q_segment_bt: [B, T] int32 segment ids of the new tokens.
      kv_segment_bs: [B, S] int32 segment ids of all key slots (S = T without a cache).
      cache_kv: None; or (k, v, layer) with the stacked caches (`KVCache` layouts, leading [L]) and this
        layer's index; or (k, v, None) with this layer's own caches. The new keys/values are written in
        place at slots [cache_index, cache_index + T). Or a `PagedKVCache` holding this layer's pages (T = 1):
        the new token goes to its page slot and attends to its row's pages; the pages are returned.
      cache_index: int32 scalar slot where the new tokens are written; ignored without a cache (the tokens
        are then slots 0..T-1). With this layer's own cache (layer None) and T = 1 it may be a [B] int32
        array, one slot per row (continuous batching: rows at different steps).
      live_len: optional int32 scalar (with a cache only): score only the first slots up to a bucket >= it
        (`live_length_attention`); every query that matters must sit in a slot < live_len.

    Returns:
      ([B, T, D] output, the updated (k, v) caches in the layout given, or None).
    """
    c = self.config
    dt = c.jnp_dtype
    x_btd = maybe_quant_act(x_btd, c.act_quant)  # sampler's simulated FP8 (identity by default)
    if c.fuse_qkv:
      qkv = dense(x_btd, self.qkv_proj[...].astype(dt))  # [B, T, K, G + 2, hd]
      g = qkv.shape[3] - 2
      q = qkv[:, :, :, :g].reshape(*qkv.shape[:2], c.num_heads, c.head_dim)  # head k * G + j, as unfused
      k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    else:
      q = dense(x_btd, self.q_proj[...].astype(dt))
      k = dense(x_btd, self.k_proj[...].astype(dt))
      v = dense(x_btd, self.v_proj[...].astype(dt))
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope)
    q = constrain(q, ("batch", "act_seq", "act_heads", None))
    if isinstance(cache_kv, PagedKVCache):  # decode into a page pool (`sampling.paged`)
      pages = write_slots(cache_kv.kv_pages, cache_kv.page, cache_kv.slot, k[:, 0], v[:, 0])
      out = cache_kv.attend(q[:, 0], pages)[:, None]
      return dense(maybe_quant_act(out, c.act_quant), self.o_proj[...].astype(dt), n_in=2), pages
    t = x_btd.shape[1]
    b, _, h, hd = q.shape
    kh = c.num_kv_heads
    # heads-major operands: every attention dot is a plain batched [M, K] x [K, N] matmul (no operand transpose)
    qg = jnp.transpose(q.reshape(b, t, kh, h // kh, hd), (0, 2, 3, 1, 4))  # [B, K, G, T, hd]
    k_new = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, T, hd]
    v_new = jnp.transpose(v, (0, 2, 1, 3))
    hd_major = False
    own_kv = (k_new, v_new)  # [B, K, T, hd]: what a cache-free forward or a prefill at slot 0 attends to
    if cache_kv is not None:
      k_cache, v_cache, layer = cache_kv
      hd_major = keys_head_dim_major(k_cache.dtype)
      k_new, v_new = k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype)
      own_kv = (k_new, v_new)
      if hd_major:
        k_new = jnp.swapaxes(k_new, 2, 3)  # [B, K, hd, T]
      k_at = (0, 0, 0, cache_index) if hd_major else (0, 0, cache_index, 0)
      if jnp.ndim(cache_index) == 1:  # one slot per row (T = 1, per-layer cache): a scatter of B columns
        # indexed by (row, head, slot), each update one head_dim vector: XLA:TPU scatters that in the cache's own
        # tiled layout ((row, slot) with a [K, head_dim] window made it relayout every layer's cache and back)
        rows, heads, slots = jnp.arange(b)[:, None], jnp.arange(kh)[None, :], cache_index[:, None]
        if hd_major:
          k_all = k_cache = k_cache.at[rows[:, 0], :, :, cache_index].set(k_new[..., 0])
        else:
          k_all = k_cache = k_cache.at[rows, heads, slots].set(k_new[:, :, 0])
        v_all = v_cache = v_cache.at[rows, heads, slots].set(v_new[:, :, 0])
      elif layer is None:  # this layer's own cache: updated in place and read without a copy
        k_all = k_cache = jax.lax.dynamic_update_slice(k_cache, k_new, k_at)
        v_all = v_cache = jax.lax.dynamic_update_slice(v_cache, v_new, (0, 0, cache_index, 0))
      else:
        k_cache = jax.lax.dynamic_update_slice(k_cache, k_new[None], (layer, *k_at))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v_new[None], (layer, 0, 0, cache_index, 0))
        k_all, v_all = k_cache[layer], v_cache[layer]
      new_cache = (k_cache, v_cache)
    else:
      k_all, v_all, new_cache = k_new, v_new, None
    s = v_all.shape[2]
    if cache_kv is not None and live_len is not None:  # score only the cache slots up to the longest live row
      q_slot = jnp.broadcast_to(jnp.reshape(cache_index, (-1, 1)) + jnp.arange(t)[None], (b, t))
      out = live_length_attention(
          qg, k_all, v_all, q_slot, q_segment_bt, kv_segment_bs, live_len, keys_hd_major=hd_major, dtype=dt
      )
      out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, hd)
      return dense(maybe_quant_act(out, c.act_quant), self.o_proj[...].astype(dt), n_in=2), new_cache
    prefill = cache_kv is not None and isinstance(cache_index, int) and cache_index == 0
    if cache_kv is None or (prefill and resolve_attention_impl(c, t) != "xla"):
      # the tokens attend to their own keys (a prefill at slot 0 sees nothing else): attention_impl decides how
      out = cache_free_attention(c, qg, *own_kv, q_segment_bt, kv_segment_bs[:, :t])
    else:
      if jnp.ndim(cache_index) == 1:
        q_slot = cache_index[:, None, None] + jnp.arange(t)[None, :, None]  # [B, T, 1]
        mask = jnp.arange(s)[None, None, :] <= q_slot  # [B, T, S] causal by slot
      else:
        q_slot = cache_index + jnp.arange(t)
        mask = (jnp.arange(s)[None, :] <= q_slot[:, None])[None]  # [1, T, S] causal by slot
      mask = mask & (q_segment_bt[:, :, None] == kv_segment_bs[:, None, :]) & (q_segment_bt[:, :, None] != 0)
      out = masked_attention(qg, k_all, v_all, mask, keys_hd_major=hd_major, dtype=dt)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, hd)
    y = dense(maybe_quant_act(out, c.act_quant), self.o_proj[...].astype(dt), n_in=2)
    return y, new_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, config.jnp_param_dtype
    self.dtype = c.jnp_dtype
    self.act_quant = c.act_quant
    self.gate_proj = nnx.Param(
        init_param(0.02, ("embed", "mlp"))(rngs.params(), (c.hidden_size, c.intermediate_size), pd)
    )
    self.up_proj = nnx.Param(
        init_param(0.02, ("embed", "mlp"))(rngs.params(), (c.hidden_size, c.intermediate_size), pd)
    )
    self.down_proj = nnx.Param(
        init_param(0.02, ("mlp", "embed"))(rngs.params(), (c.intermediate_size, c.hidden_size), pd)
    )

  def __call__(self, x_btd):
    dt = self.dtype
    x_btd = maybe_quant_act(x_btd, self.act_quant)
    g = dense(x_btd, self.gate_proj[...].astype(dt))
    u = dense(x_btd, self.up_proj[...].astype(dt))
    h = constrain(jax.nn.silu(g) * u, ("batch", "act_seq", "mlp"))
    return dense(maybe_quant_act(h, self.act_quant), self.down_proj[...].astype(dt))


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    pd = config.jnp_param_dtype
    self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, rngs=rngs)
    self.is_moe = config.is_moe
    self.mlp = MoE(config, rngs=rngs) if config.is_moe else MLP(config, rngs=rngs)

  def __call__(self, x_btd, rope, q_segment_bt, kv_segment_bs, cache_kv, cache_index, live_len=None, routes=None):
    """Returns (x [B, T, D], the updated cache or None, aux loss, the router's own [B, T, k] top-k (MoE) or None)."""
    h, new_kv = self.attn(self.input_norm(x_btd), rope, q_segment_bt, kv_segment_bs, cache_kv, cache_index, live_len)
    x_btd = x_btd + h
    if self.is_moe:
      h, aux, used = self.mlp(self.post_attn_norm(x_btd), q_segment_bt != 0, routes)
    else:
      h, aux, used = self.mlp(self.post_attn_norm(x_btd)), jnp.zeros((), jnp.float32), None
    x_btd = constrain(x_btd + h, ("batch", "act_seq", "act_embed"))
    return x_btd, new_kv, aux, used


@jax.custom_vjp
def _unstack_layers(x_l: jax.Array) -> tuple[jax.Array, ...]:
  """The L slices of a stacked [L, ...] parameter, whose gradient is one stack of the L slice gradients.

  Plain `x[i]` slicing differentiates into L zero-padded [L, ...] gradients that are then summed: O(L^2)
  memory traffic per step instead of O(L).
  """
  return tuple(x_l[i] for i in range(x_l.shape[0]))


def _unstack_layers_fwd(x_l):
  return _unstack_layers(x_l), None


def _unstack_layers_bwd(_, grads):
  return (jnp.stack(grads),)


_unstack_layers.defvjp(_unstack_layers_fwd, _unstack_layers_bwd)


REMAT_POLICIES = {  # ModelConfig.remat -> jax.checkpoint policy (None: save nothing but the block's input)
    "block": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the projections' outputs go to host memory in the forward and come back for the backward
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def segment_positions(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T] int32 position of each token inside its segment (0 at each segment start, 0 on padding).

  Works for left padding, right padding and packed rows (segments must be contiguous).
  """
  t = segment_ids_bt.shape[1]
  idx = jnp.arange(t, dtype=jnp.int32)[None, :]
  prev = jnp.pad(segment_ids_bt[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  start = jax.lax.cummax(jnp.where(segment_ids_bt != prev, idx, 0), axis=1)
  return jnp.where(segment_ids_bt != 0, idx - start, 0).astype(jnp.int32)


class Transformer(nnx.Module):
  """Decoder-only LM. See the module docstring for the masking rule and `ModelConfig` for the fields."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = nnx.Param(
        init_param(0.02, ("vocab", "embed"))(rngs.params(), (c.vocab_size, c.hidden_size), c.jnp_param_dtype)
    )

    if c.stack_layers:

      @nnx.split_rngs(splits=c.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make_layers(rngs):
        return DecoderLayer(c, rngs=rngs)

      self.layers = make_layers(rngs)
    else:
      self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, rngs=rngs)
    if not c.tie_embeddings:
      self.lm_head = nnx.Param(
          init_param(0.02, ("embed", "vocab"))(rngs.params(), (c.hidden_size, c.vocab_size), c.jnp_param_dtype)
      )

  def head_weight(self) -> jax.Array:
    """[D, V] output projection in the compute dtype (the transposed embedding when tied)."""
    dt = self.config.jnp_dtype
    return self.embed[...].T.astype(dt) if self.config.tie_embeddings else self.lm_head[...].astype(dt)

  def logits(self, hidden_btd: jax.Array) -> jax.Array:
    """[B, T, V] float32 logits of final hidden states (fp32 accumulation).

    A tied head contracts with the [V, D] embedding as stored: no transposed copy (at batch 1 a copy of
    the embedding would double the bytes read per decode step).
    """
    dt = self.config.jnp_dtype
    if self.config.tie_embeddings:
      return dense(hidden_btd, self.embed[...].astype(dt), w_transposed=True, preferred_element_type=jnp.float32)
    return dense(hidden_btd, self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)

  def __call__(
      self,
      tokens_bt: jax.Array,
      positions_bt: jax.Array | None = None,
      segment_ids_bt: jax.Array | None = None,
      *,
      cache: KVCache | None = None,
      cache_index: jax.Array | int = 0,
      return_hidden: bool = False,
      rope: tuple[jax.Array, jax.Array] | None = None,
      live_len: jax.Array | None = None,
      routes_btlk: jax.Array | None = None,
  ) -> ModelOutput:
    """Runs the decoder on T new tokens.

    Args:
      tokens_bt: [B, T] int32 token ids.
      positions_bt: [B, T] int32 RoPE positions; default: position inside each segment.
      segment_ids_bt: [B, T] int32; 0 marks padding, equal non-zero ids mark one sequence. Default: all 1.
      cache: optional `KVCache` with S >= cache_index + T slots; the new keys/values and segment ids are
        written at slots [cache_index, cache_index + T) and the new tokens attend to every earlier slot of
        their segment. Or a `PagedKVCache` (T = 1, per-layer config): each row's token is written to its page
        slot and attends to its row's pages; cache_index and live_len are then ignored.
      cache_index: int32 scalar, first slot written (only with a cache); or, for T = 1 and a per-layer cache
        (`stack_layers=False`), a [B] int32 array with each row's own slot (continuous batching).
      return_hidden: return final-normed hidden states [B, T, D] instead of logits (the chunked log-prob
        path uses this so [B, T, V] is never built).
      rope: optional precomputed `rope_tables(positions_bt, config)` (cos, sin), each [B, T, head_dim // 2].
        The sampler gathers them from a table built once per `generate`, so its decode loop computes no
        cos/sin per step.
      live_len: optional int32 scalar (only with a cache): attention scores only the leading cache slots up
        to the smallest `live_length_buckets` size >= live_len (`live_length_attention`), so a decode step
        costs what the longest live row needs; queries at slots >= live_len get undefined outputs.

      routes_btlk: optional [B, T, L, k] int expert ids per token and layer (MoE only; router replay,
        `models.moe`): a token whose k ids in a layer are NO_ROUTE (-1) is routed by the router's own top-k.

    Returns:
      `ModelOutput(out, cache, router_aux_loss, routes)`.

    Raises:
      ValueError: tokens are not [B, T], or shapes of positions / segment ids / cache / routes disagree, or
        routes for a dense model.
    """
    c = self.config
    if tokens_bt.ndim != 2:
      raise ValueError(f"tokens_bt must be [B, T], got shape {tokens_bt.shape}")
    b, t = tokens_bt.shape
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    if segment_ids_bt.shape != (b, t):
      raise ValueError(f"segment_ids_bt has shape {segment_ids_bt.shape}, expected {(b, t)}")
    segment_ids_bt = segment_ids_bt.astype(jnp.int32)
    if positions_bt is None:
      positions_bt = segment_positions(segment_ids_bt)
    if positions_bt.shape != (b, t):
      raise ValueError(f"positions_bt has shape {positions_bt.shape}, expected {(b, t)}")
    if routes_btlk is not None:
      want = (b, t, c.num_layers, c.num_experts_per_tok)
      if not c.is_moe or routes_btlk.shape != want:
        raise ValueError(f"routes_btlk has shape {routes_btlk.shape}; router replay needs a MoE and shape {want}")
    paged = isinstance(cache, PagedKVCache)
    if paged:
      if t != 1 or c.stack_layers or cache.page.shape != (b,):
        raise ValueError(
            f"a PagedKVCache needs T = 1 (got {t}), page / slot of shape ({b},) (got {cache.page.shape}) and a "
            "per-layer config (stack_layers=False)"
        )
      kv_segment, cache_index, live_len = segment_ids_bt, 0, None
    elif cache is not None:
      if cache.segment_ids.shape[0] != b or cache.segment_ids.shape[1] < t:
        raise ValueError(f"cache of {cache.segment_ids.shape} (rows, slots) does not fit tokens of shape {(b, t)}")
      if isinstance(cache.k, tuple) == c.stack_layers:
        raise ValueError(
            "cache layout does not match ModelConfig.stack_layers; build it with " "KVCache.zeros(model.config, ...)"
        )
      if jnp.ndim(cache_index) == 1:
        if t != 1 or c.stack_layers:
          raise ValueError("a per-row cache_index needs T = 1 and a per-layer cache (stack_layers=False)")
        # a select, not a scatter: [B, S] int32 is small beside the caches, and XLA:TPU keeps it in place
        at_slot = jnp.arange(cache.segment_ids.shape[1])[None, :] == cache_index[:, None]
        kv_segment = jnp.where(at_slot, segment_ids_bt[:, :1], cache.segment_ids)
      else:
        kv_segment = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids_bt, (0, cache_index))
    else:
      kv_segment = segment_ids_bt
      cache_index = 0
      live_len = None

    x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(c.jnp_dtype)
    x = constrain(x, ("batch", "act_seq", "act_embed"))

    if rope is None:
      rope = rope_tables(positions_bt, c)
    elif any(r.shape != (b, t, c.head_dim // 2) for r in rope):
      raise ValueError(f"rope tables have shapes {[r.shape for r in rope]}, expected 2 x {(b, t, c.head_dim // 2)}")

    def run_layer(layer, x, kv, routes):
      return layer(x, rope, segment_ids_bt, kv_segment, kv, cache_index, live_len, routes)

    if c.remat != "none":
      run_layer = nnx.remat(run_layer, prevent_cse=not c.scan_layers, policy=REMAT_POLICIES[c.remat])

    # routes per layer: [L, B, T, k] for the scan, a list of [B, T, k] for the loops; None without replay
    routes_l = None if routes_btlk is None else jnp.moveaxis(routes_btlk, 2, 0)
    if c.scan_layers:
      if cache is None:

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0, 0))
        def body(x, layer, routes):
          x, _, aux, used = run_layer(layer, x, None, routes)
          return x, aux, used

        x, aux, used_l = body(x, self.layers, routes_l)
        new_k = new_v = None
      else:

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0, 0))
        def body(carry, layer, idx, routes):
          x, k, v = carry
          x, (k, v), aux, used = run_layer(layer, x, (k, v, idx), routes)
          return (x, k, v), aux, used

        (x, new_k, new_v), aux, used_l = body((x, cache.k, cache.v), self.layers, jnp.arange(c.num_layers), routes_l)
    elif c.stack_layers:
      graphdef, state = nnx.split(self.layers)
      leaves, treedef = jax.tree.flatten(state)
      per_leaf = [_unstack_layers(a) for a in leaves]
      auxes, used_l = [], []
      new_k, new_v = (None, None) if cache is None else (cache.k, cache.v)
      for i in range(c.num_layers):
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, [layers[i] for layers in per_leaf]))
        kv = None if cache is None else (new_k, new_v, i)
        x, kv, a, used = run_layer(layer, x, kv, None if routes_l is None else routes_l[i])
        auxes.append(a)
        used_l.append(used)
        if kv is not None:
          new_k, new_v = kv
      aux = jnp.stack(auxes)
    else:
      auxes, ks, vs, used_l = [], [], [], []
      for i, layer in enumerate(self.layers):
        if paged:
          kv = cache._replace(kv_pages=cache.kv_pages[i])
        else:
          kv = None if cache is None else (cache.k[i], cache.v[i], None)
        x, kv, a, used = run_layer(layer, x, kv, None if routes_l is None else routes_l[i])
        auxes.append(a)
        used_l.append(used)
        if kv is not None:
          ks.append(kv if paged else kv[0])
          vs.append(None if paged else kv[1])
      aux = jnp.stack(auxes)
      new_k, new_v = tuple(ks), tuple(vs)

    hidden = self.final_norm(x)
    new_cache = None if cache is None else KVCache(k=new_k, v=new_v, segment_ids=kv_segment)
    new_cache = cache._replace(kv_pages=new_k) if paged else new_cache
    aux_loss = jnp.mean(aux) if c.is_moe else jnp.zeros((), jnp.float32)
    out = hidden if return_hidden else self.logits(hidden)
    routes_used = None
    if c.is_moe:
      routes_used = jnp.moveaxis(used_l if c.scan_layers else jnp.stack(used_l), 0, 2)  # [B, T, L, k]
    return ModelOutput(out, new_cache, aux_loss, routes_used)


def init_model(config: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None, rules=None) -> Transformer:
  """Creates a randomly initialised `Transformer`.

  With a mesh, parameters are created directly sharded by the logical-axis rules inside one jitted call,
  so no full host copy of the model ever exists. Without one, they live on the default device.

  Args:
    config: the model config.
    seed: PRNG seed of the initialisers (HF's normal(0, 0.02) for matrices, ones for norms).
    mesh: optional device mesh (see `minpro_jax.runtime.sharding.make_mesh`).
    rules: logical-axis rules (default `minpro_jax.runtime.sharding.DEFAULT_RULES`).
  """
  if mesh is None:
    with nnx.use_eager_sharding(False):
      return Transformer(config, rngs=nnx.Rngs(seed))
  with use_mesh(mesh, rules or DEFAULT_RULES):
    model = nnx.jit(lambda: Transformer(config, rngs=nnx.Rngs(seed)))()
    settle(nnx.state(model))
    return model
