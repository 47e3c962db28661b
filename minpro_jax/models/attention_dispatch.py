"""Which attention implementation a cache-free forward (the learner, scoring, the sampler's prefill) runs.

`ModelConfig.attention_impl` names one: "xla" (`attention_core`: the [T, S] scores, in causal query blocks),
"blockwise" (`blockwise_attention`: FlashAttention in plain JAX, O(T · block) memory on every backend), "splash"
(the Pallas TPU kernel, `splash_attention`), "cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`, the
cuDNN flash kernel on NVIDIA GPUs) or "auto": splash on TPU, cudnn on GPU for bf16/fp16 compute (cuDNN's flash
kernel has no fp32 path), and elsewhere blockwise from `AUTO_BLOCKWISE_MIN_TOKENS` tokens on and xla below.

The platform is the one the program is compiled for: the devices of the mesh in context (so a compile for a TPU
topology on a CPU host picks splash), else `jax.default_backend()`. Splash off TPU runs in Pallas interpret mode
(correct and slow; for tests), and cudnn off GPU raises.

Every implementation computes the model's rule: query t (at slot t) attends to key slot s iff s <= t and both
carry the same non-zero segment id. Rows of padding (segment 0) are never read; each implementation gives them
some finite value.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from minpro_jax.models.attention_core import causal_block_attention, causal_block_count, masked_attention
from minpro_jax.models.blockwise_attention import blockwise_attention
from minpro_jax.models.config import ModelConfig
from minpro_jax.models.splash_attention import LANES, splash_attention

logger = logging.getLogger(__name__)

AUTO_BLOCKWISE_MIN_TOKENS = 2048  # attention_impl="auto" off TPU/GPU switches to blockwise from this length on
_CUDNN_DTYPES = ("bfloat16", "float16")


def target_platform() -> str:
  """ "tpu", "gpu" or "cpu": the platform of the mesh in context (`jax.set_mesh`), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  platform = jax.default_backend() if mesh is None or mesh.empty else mesh.abstract_device.platform
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def resolve_attention_impl(config: ModelConfig, seq_len: int, platform: str | None = None) -> str:
  """The implementation ("xla", "blockwise", "splash" or "cudnn") a cache-free forward of `seq_len` tokens runs.

  Raises:
    ValueError: attention_impl="cudnn" for a platform other than GPU, or with fp32 compute (cuDNN's flash
      attention takes bf16/fp16 only); the message names `ModelConfig.attention_impl` and the alternatives.
  """
  platform = platform or target_platform()
  impl = config.attention_impl
  if impl == "auto":
    if platform == "tpu":
      return "splash"
    if platform == "gpu" and config.dtype in _CUDNN_DTYPES:
      return "cudnn"
    return "blockwise" if seq_len >= AUTO_BLOCKWISE_MIN_TOKENS else "xla"
  if impl == "cudnn" and (platform != "gpu" or config.dtype not in _CUDNN_DTYPES):
    raise ValueError(
        f"ModelConfig.attention_impl='cudnn' needs a GPU and dtype bfloat16/float16 (platform {platform}, dtype "
        f"{config.dtype}); use 'auto' or 'blockwise'"
    )
  return impl


def cache_free_attention(
    config: ModelConfig,
    qg_bkgth: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    q_segment_bt: jax.Array,
    kv_segment_bs: jax.Array,
) -> jax.Array:
  """Self-attention of T tokens over their own keys (slots 0..T-1) with the configured implementation.

  Args:
    config: the model config (attention_impl, attn_block_size, attn_causal_blocks, dtype).
    qg_bkgth: [B, K, G, T, hd] queries grouped by KV head (compute dtype).
    k_bksh, v_bksh: [B, K, T, hd] keys and values of the same tokens.
    q_segment_bt, kv_segment_bs: [B, T] int32 segment ids (0: padding); equal for self-attention.

  Returns:
    [B, K, G, T, hd] in the compute dtype.

  Raises:
    ValueError: see `resolve_attention_impl`.
  """
  dt = config.jnp_dtype
  t = qg_bkgth.shape[3]
  impl = resolve_attention_impl(config, t)
  bs = config.attn_block_size
  if impl == "blockwise":
    return blockwise_attention(qg_bkgth, k_bksh, v_bksh, q_segment_bt, kv_segment_bs, block_q=bs, block_k=bs, dtype=dt)
  if impl == "splash":
    interpret = target_platform() != "tpu"
    if interpret:
      _warn_interpret()
    bs = -(-bs // LANES) * LANES  # the kernel's blocks are multiples of the lane count
    return splash_attention(
        qg_bkgth, k_bksh, v_bksh, q_segment_bt, kv_segment_bs, block_size=bs, dtype=dt, interpret=interpret
    )
  if impl == "cudnn":
    return dot_product_attention(qg_bkgth, k_bksh, v_bksh, q_segment_bt, kv_segment_bs, dtype=dt)
  mask = _slot_causal_mask(q_segment_bt, kv_segment_bs, exclude_padding_queries=True)
  blocks = causal_block_count(t, config.attn_causal_blocks)
  if blocks > 1:
    return causal_block_attention(qg_bkgth, k_bksh, v_bksh, mask, blocks, dtype=dt)
  return masked_attention(qg_bkgth, k_bksh, v_bksh, mask, keys_hd_major=False, dtype=dt)


def dot_product_attention(
    qg_bkgth: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    q_segment_bt: jax.Array,
    kv_segment_bs: jax.Array,
    *,
    dtype=jnp.bfloat16,
    implementation: str | None = "cudnn",
) -> jax.Array:
  """The model's attention rule through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU).

  Segments go in as a boolean mask [B, 1, T, S] (same segment id) with `is_causal=True`: the kernel's sequence
  lengths (`query_seq_lengths` / `key_value_seq_lengths`) describe right padding only, and the learner's rows are
  left-padded prompts and packed segments. The mask costs T·S bytes per row (0.44 GB at 21k tokens), 1/4H of the
  fp32 scores xla builds. Padding queries attend to the padding slots at or before them (never an empty row).

  Args:
    qg_bkgth: [B, K, G, T, hd]; k_bksh, v_bksh: [B, K, S, hd]; segment ids [B, T] / [B, S].
    dtype: compute dtype (cuDNN: bfloat16 or float16).
    implementation: "cudnn", or "xla"/None (the same call on any backend; what the CPU tests run).

  Returns:
    [B, K, G, T, hd] in `dtype`.
  """
  b, kh, g, t, hd = qg_bkgth.shape
  q = jnp.transpose(qg_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, kh * g, hd).astype(dtype)  # head k * G + j
  k = jnp.transpose(k_bksh, (0, 2, 1, 3)).astype(dtype)  # [B, S, K, hd]
  v = jnp.transpose(v_bksh, (0, 2, 1, 3)).astype(dtype)
  mask = (q_segment_bt[:, :, None] == kv_segment_bs[:, None, :])[:, None]  # [B, 1, T, S]
  out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
  return jnp.transpose(out.reshape(b, t, kh, g, hd), (0, 2, 3, 1, 4))


def _slot_causal_mask(q_segment_bt, kv_segment_bs, *, exclude_padding_queries: bool) -> jax.Array:
  """[B, T, S] bool: key slot s <= query slot t, same segment (and, optionally, a non-padding query)."""
  t, s = q_segment_bt.shape[1], kv_segment_bs.shape[1]
  mask = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None]
  mask = mask & (q_segment_bt[:, :, None] == kv_segment_bs[:, None, :])
  if exclude_padding_queries:
    mask = mask & (q_segment_bt[:, :, None] != 0)
  return mask


@functools.cache
def _warn_interpret() -> None:
  logger.warning("attention_impl='splash' off TPU runs the Pallas kernel in interpret mode (slow; for tests)")
