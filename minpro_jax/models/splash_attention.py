"""The Pallas TPU splash-attention kernel as a drop-in for `blockwise_attention` without a cache (q_offset = 0).

`splash_attention` computes what `blockwise_attention.blockwise_attention` computes for queries in the slots of
their own keys (query t attends to key slot s iff s <= t and both carry the same segment id) with JAX's
splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`): a FlashAttention forward and a
recomputing backward (a custom VJP) as Mosaic TPU kernels that skip the key blocks a causal mask hides. The G
query heads of a KV head share its K/V: each (batch row, KV head) runs the MQA form of the kernel, q [G, T, hd]
over k, v [T, hd], with a `CausalMask` for each of the G heads and the segment ids as `SegmentIds`, vmapped over
batch and KV heads. The backward runs splash's separate dkv and dq kernels, whose memory is linear in T; its
fused dq + dkv kernel keeps a partial dq per key block ([K, T / block, G, T, hd] per batch row), quadratic in T.

Kernel constraints this module works within: every block size (queries, keys, and the key block of one compute
step, forward and backward) is a multiple of 128 and divides the sequence, so T is padded with segment-0 slots to
a multiple of the block, and the block is cut to T rounded up to 128 when it is larger. The same checks run in
interpret mode (`interpret=True`, the kernels evaluated as JAX ops on any backend, for tests on CPU), so there too
the smallest sequence the kernel sees is 128 slots. head_dim need not be a multiple of 128: interpret mode runs
hd = 8, and the forward + backward compile for v5p with hd = 64, 96 and 128.

Splash does not scale the scores: the queries are multiplied by 1 / sqrt(hd) in fp32 and cast to `dtype` before
the kernel (so in bf16 with hd = 128 the scaled queries carry one bf16 rounding that `blockwise_attention`, which
scales the fp32 scores, does not). Scores, softmax statistics and the probability-value product are fp32 inside
the kernel. Padding rows (segment 0) attend to the segment-0 slots at or before them (every slot sees itself, so
no row is empty and the output is finite); callers never read them, and a loss that masks them gives them no
gradient.

Under a mesh (`jax.sharding.get_abstract_mesh()` non-empty, as inside `runtime.sharding.use_mesh`) the kernel runs
per device in a `jax.shard_map`: the batch dimension split over the mesh axes the logical axis "batch" resolves to
and the KV-head dimension over those of "act_kv_heads", each only when it divides evenly (otherwise that dimension
is replicated), the sequence never split. A mesh with Manual axes (a call from inside another shard_map) is left
to the caller: the kernel is then called directly on what that shard_map hands in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from minpro_jax.runtime import sharding

LANES = 128  # every splash block size must be a multiple of the TPU lane count
DEFAULT_BLOCK = 512


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _pad_to(x: jax.Array, axis: int, length: int) -> jax.Array:
  pad = length - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def splash_attention(
    qg_bkgth: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    q_segment_bt: jax.Array,
    kv_segment_bs: jax.Array,
    *,
    block_size: int = DEFAULT_BLOCK,
    dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:
  """Slot-causal, segment-masked grouped-query self-attention with the splash kernel, forward and backward.

  Args:
    qg_bkgth: [B, K, G, T, hd] queries, grouped by KV head; query t sits at slot t of the keys.
    k_bksh, v_bksh: [B, K, S, hd] keys and values of the same tokens, S == T.
    q_segment_bt: [B, T] int segment ids of the queries (0: padding).
    kv_segment_bs: [B, S] int segment ids of the key slots.
    block_size: static int, a multiple of 128: the query and key block of the forward and backward kernels;
      T is padded with segment 0 to a multiple of it, and a block larger than T is cut to T rounded up to 128.
    dtype: compute dtype of the queries, keys, values and the output (scores and softmax are fp32).
    interpret: run the kernels in Pallas interpret mode (any backend; slow, for tests).

  Returns:
    [B, K, G, T, hd] in `dtype`; equal to `blockwise_attention` (q_offset = 0), up to float rounding, on every row
    with a non-zero segment id; finite on the padding rows.

  Raises:
    ValueError: a query array that is not 5-D, keys / values / segment ids whose shapes disagree with the queries
      (the message names the argument), S != T, or a block_size that is not a positive multiple of 128.
  """
  if qg_bkgth.ndim != 5:
    raise ValueError(f"splash_attention: qg_bkgth {qg_bkgth.shape} must be [B, K, G, T, hd]")
  b, kh, g, t, hd = qg_bkgth.shape
  if k_bksh.ndim != 4 or k_bksh.shape[:2] != (b, kh) or k_bksh.shape[3] != hd:
    raise ValueError(f"splash_attention: k_bksh {k_bksh.shape} must be [B={b}, K={kh}, S, hd={hd}]")
  s = k_bksh.shape[2]
  if s != t:
    raise ValueError(f"splash_attention: k_bksh has S={s} key slots but qg_bkgth T={t} queries; S must equal T")
  if v_bksh.shape != k_bksh.shape:
    raise ValueError(f"splash_attention: v_bksh {v_bksh.shape} must equal k_bksh's shape {k_bksh.shape}")
  if q_segment_bt.shape != (b, t):
    raise ValueError(f"splash_attention: q_segment_bt {q_segment_bt.shape} must be [{b}, {t}]")
  if kv_segment_bs.shape != (b, s):
    raise ValueError(f"splash_attention: kv_segment_bs {kv_segment_bs.shape} must be [{b}, {s}]")
  if block_size < LANES or block_size % LANES:
    raise ValueError(f"splash_attention: block_size={block_size} must be a positive multiple of {LANES}")

  block = min(block_size, _round_up(t, LANES))
  tp = _round_up(t, block)
  q = (qg_bkgth.astype(jnp.float32) * (1.0 / math.sqrt(hd))).astype(dtype)
  q = _pad_to(q, 3, tp)
  k, v = _pad_to(k_bksh.astype(dtype), 2, tp), _pad_to(v_bksh.astype(dtype), 2, tp)
  q_seg = _pad_to(q_segment_bt.astype(jnp.int32), 1, tp)
  kv_seg = _pad_to(kv_segment_bs.astype(jnp.int32), 1, tp)

  def per_device(q, k, v, q_seg, kv_seg):
    return _splash(q, k, v, q_seg, kv_seg, block, interpret)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and sharding.auto_axes(mesh):  # within a shard_map: its auto axes
    head_axes = sharding.mesh_axes(mesh, "act_kv_heads", kh) or None
    batch_axes = sharding.mesh_axes(mesh, "batch", b, exclude=head_axes or ()) or None
    per_device = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(
            P(batch_axes, head_axes, None, None, None),
            P(batch_axes, head_axes, None, None),
            P(batch_axes, head_axes, None, None),
            P(batch_axes, None),
            P(batch_axes, None),
        ),
        out_specs=P(batch_axes, head_axes, None, None, None),
        axis_names=sharding.auto_axes(mesh),
        check_vma=False,
    )
  out = per_device(q, k, v, q_seg, kv_seg)
  return out[:, :, :, :t].astype(dtype)


def _splash(q, k, v, q_seg, kv_seg, block: int, interpret: bool) -> jax.Array:
  """The kernel on padded operands: q [B, K, G, Tp, hd], k, v [B, K, Tp, hd], segment ids [B, Tp]."""
  g, tp = q.shape[2], q.shape[3]
  mask = splash.MultiHeadMask([splash.CausalMask((tp, tp)) for _ in range(g)])
  block_sizes = splash.BlockSizes(
      block_q=block,
      block_kv=block,
      block_kv_compute=block,
      block_q_dkv=block,
      block_kv_dkv=block,
      block_kv_dkv_compute=block,
      block_q_dq=block,
      block_kv_dq=block,
  )
  kernel = splash.make_splash_mqa_single_device(mask, block_sizes=block_sizes, interpret=interpret)

  def one_row(q_kgth, k_ksh, v_ksh, q_seg_t, kv_seg_s):
    segment_ids = splash.SegmentIds(q=q_seg_t, kv=kv_seg_s)
    return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=segment_ids))(q_kgth, k_ksh, v_ksh)

  return jax.vmap(one_row)(q, k, v, q_seg, kv_seg)
