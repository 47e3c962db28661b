"""Memory-efficient attention in plain JAX: FlashAttention's blocked online softmax, with its recomputing backward.

`blockwise_attention` computes what `attention_core.masked_attention` computes for the slot-causal, segment-masked
rule of the model (query at slot `q_offset + t` attends to key slot s iff s <= its slot and both carry the same
non-zero segment id), without ever building the [T, S] score matrix: queries are taken in blocks of `block_q`,
keys in blocks of `block_k`, and each query block keeps a running max, normaliser and output over the key blocks
it can see (Dao et al. 2022, "FlashAttention", Alg. 1; Dao 2023, "FlashAttention-2", Alg. 1 and 2). Key blocks
entirely after a query block's last slot are skipped (causal block skipping). The backward pass is a
`jax.custom_vjp` that recomputes each block's probabilities from the saved log-sum-exp instead of storing them, so
forward + backward need O(T · block) memory instead of O(T²). Grouped-query heads attend to their KV head without
repeating K/V (queries come grouped [B, K, G, T, hd], as everywhere in `attention_core`).

Scores, the softmax statistics and the gradients are fp32; the probabilities are cast to the compute dtype
before the value matmul, as in `masked_attention`. A fully masked query row (padding) gets the uniform average of
the values of the key blocks it visits; callers never read those rows, and a loss that masks them gives them no
gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, as in attention_core, so a fully masked row averages instead of giving NaN
DEFAULT_BLOCK = 512


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def blockwise_attention(
    qg_bkgth: jax.Array,
    k_bksh: jax.Array,
    v_bksh: jax.Array,
    q_segment_bt: jax.Array,
    kv_segment_bs: jax.Array,
    *,
    q_offset: int = 0,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    dtype=jnp.float32,
) -> jax.Array:
  """Slot-causal, segment-masked grouped-query attention in O(T · block) memory, forward and backward.

  Args:
    qg_bkgth: [B, K, G, T, hd] queries (compute dtype), grouped by KV head; query t sits at slot q_offset + t.
    k_bksh, v_bksh: [B, K, S, hd] keys and values of slots 0..S-1.
    q_segment_bt: [B, T] int segment ids of the queries (0: padding, attends to nothing).
    kv_segment_bs: [B, S] int segment ids of the key slots.
    q_offset: static int, the slot of the first query (0 when the queries are the keys' own tokens).
    block_q, block_k: static block sizes (T and S are padded to multiples of them with segment 0); a block larger
      than the sequence is cut to it.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, K, G, T, hd] in `dtype`; equal to `masked_attention` with the same mask, up to float rounding, on every
    row with a visible key.

  Raises:
    ValueError: shapes that disagree, block sizes < 1 or a negative q_offset.
  """
  b, kh, g, t, hd = qg_bkgth.shape
  s = k_bksh.shape[2]
  if k_bksh.shape != (b, kh, s, hd) or v_bksh.shape != k_bksh.shape:
    raise ValueError(
        f"blockwise_attention: keys {k_bksh.shape} / values {v_bksh.shape} must be [B={b}, K={kh}, S, {hd}]"
    )
  if q_segment_bt.shape != (b, t) or kv_segment_bs.shape != (b, s):
    raise ValueError(
        f"blockwise_attention: segment ids {q_segment_bt.shape} / {kv_segment_bs.shape} must be [{b}, {t}] / [{b}, {s}]"
    )
  if block_q < 1 or block_k < 1 or q_offset < 0:
    raise ValueError(
        f"blockwise_attention: block_q={block_q}, block_k={block_k} must be >= 1, q_offset={q_offset} >= 0"
    )
  bq, bk = min(block_q, t), min(block_k, s)
  q = _pad_to(qg_bkgth, 3, bq)
  k, v = _pad_to(k_bksh, 2, bk), _pad_to(v_bksh, 2, bk)
  q_seg = _pad_to(q_segment_bt.astype(jnp.int32), 1, bq)
  kv_seg = _pad_to(kv_segment_bs.astype(jnp.int32), 1, bk)
  out = _flash(q, k.astype(dtype), v.astype(dtype), q_seg, kv_seg, q_offset, bq, bk, jnp.dtype(dtype).name)
  return out[:, :, :, :t]


# ----------------------------------------------------------------------------------------------- the kernel
def _first_q_block(j, q_offset: int, bq: int, bk: int):
  """The first query block that can see key block j (its last slot >= the block's first key slot)."""
  return jnp.maximum(0, (j * bk - q_offset) // bq)


def _last_k_block(i, q_offset: int, bq: int, bk: int, nk: int):
  """One past the last key block query block i can see (the key block of its last slot)."""
  return jnp.minimum(nk, (q_offset + (i + 1) * bq - 1) // bk + 1)


def _block_scores(q_i, k_j, qs_i, ks_j, i, j, q_offset, bq, bk, scale):
  """fp32 scaled scores [B, K, G, bq, bk] of query block i against key block j, masked to NEG_INF."""
  scores = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale
  q_slot = q_offset + i * bq + jnp.arange(bq)
  k_slot = j * bk + jnp.arange(bk)
  mask = (k_slot[None, None, :] <= q_slot[None, :, None]) & (qs_i[:, :, None] == ks_j[:, None, :])
  mask = mask & (qs_i[:, :, None] != 0)
  return jnp.where(mask[:, None, None], scores, NEG_INF)


def _blocks(q, k, v, q_seg, kv_seg, bq, bk):
  b, kh, g, tp, hd = q.shape
  nq, nk = tp // bq, k.shape[2] // bk
  qb = q.reshape(b, kh, g, nq, bq, hd).transpose(3, 0, 1, 2, 4, 5)  # [nq, B, K, G, bq, hd]
  kb = k.reshape(b, kh, nk, bk, hd).transpose(2, 0, 1, 3, 4)  # [nk, B, K, bk, hd]
  vb = v.reshape(b, kh, nk, bk, hd).transpose(2, 0, 1, 3, 4)
  qsb = q_seg.reshape(b, nq, bq).transpose(1, 0, 2)  # [nq, B, bq]
  ksb = kv_seg.reshape(b, nk, bk).transpose(1, 0, 2)  # [nk, B, bk]
  return qb, kb, vb, qsb, ksb


def _forward(q, k, v, q_seg, kv_seg, q_offset, bq, bk, dtype):
  """(output [B, K, G, Tp, hd] in dtype, log-sum-exp [B, K, G, Tp] fp32)."""
  b, kh, g, tp, hd = q.shape
  scale = 1.0 / math.sqrt(hd)
  qb, kb, vb, qsb, ksb = _blocks(q, k, v, q_seg, kv_seg, bq, bk)
  nk = kb.shape[0]

  def one_query_block(args):
    i, q_i, qs_i = args

    def body(j, carry):
      m, l, acc = carry
      scores = _block_scores(q_i, kb[j], qs_i, ksb[j], i, j, q_offset, bq, bk, scale)
      m_new = jnp.maximum(m, scores.max(-1))
      p = jnp.exp(scores - m_new[..., None])
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(dtype), vb[j], preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (
        jnp.full((b, kh, g, bq), NEG_INF, jnp.float32),
        jnp.zeros((b, kh, g, bq), jnp.float32),
        jnp.zeros((b, kh, g, bq, hd), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, _last_k_block(i, q_offset, bq, bk, nk), body, init)
    return (acc / l[..., None]).astype(dtype), m + jnp.log(l)

  out, lse = jax.lax.map(one_query_block, (jnp.arange(qb.shape[0]), qb, qsb))
  out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, kh, g, tp, hd)
  return out, lse.transpose(1, 2, 3, 0, 4).reshape(b, kh, g, tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, q_offset, bq, bk, dtype_name):
  return _forward(q, k, v, q_seg, kv_seg, q_offset, bq, bk, jnp.dtype(dtype_name))[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, bq, bk, dtype_name):
  out, lse = _forward(q, k, v, q_seg, kv_seg, q_offset, bq, bk, jnp.dtype(dtype_name))
  return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(q_offset, bq, bk, dtype_name, res, d_out):
  """FlashAttention-2's backward (Alg. 2): per key block, over the query blocks that see it, recompute
  P = exp(S - lse) and accumulate dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K with dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))."""
  q, k, v, q_seg, kv_seg, out, lse = res
  dtype = jnp.dtype(dtype_name)
  b, kh, g, tp, hd = q.shape
  scale = 1.0 / math.sqrt(hd)
  qb, kb, vb, qsb, ksb = _blocks(q, k, v, q_seg, kv_seg, bq, bk)
  nq = qb.shape[0]
  do = d_out.astype(jnp.float32)
  delta = jnp.sum(do * out.astype(jnp.float32), -1)  # [B, K, G, Tp]
  dob = do.reshape(b, kh, g, nq, bq, hd).transpose(3, 0, 1, 2, 4, 5)
  lseb = lse.reshape(b, kh, g, nq, bq).transpose(3, 0, 1, 2, 4)
  deltab = delta.reshape(b, kh, g, nq, bq).transpose(3, 0, 1, 2, 4)

  def one_key_block(dq, args):
    j, k_j, v_j, ks_j = args

    def body(i, carry):
      dq, dk_j, dv_j = carry
      scores = _block_scores(qb[i], k_j, qsb[i], ks_j, i, j, q_offset, bq, bk, scale)
      p = jnp.exp(scores - lseb[i][..., None])  # [B, K, G, bq, bk]
      dv_j = dv_j + jnp.einsum(
          "bkgqs,bkgqh->bksh", p.astype(dtype), dob[i].astype(dtype), preferred_element_type=jnp.float32
      )
      dp = jnp.einsum("bkgqh,bksh->bkgqs", dob[i].astype(dtype), v_j, preferred_element_type=jnp.float32)
      ds = p * (dp - deltab[i][..., None]) * scale
      dk_j = dk_j + jnp.einsum("bkgqs,bkgqh->bksh", ds, qb[i].astype(jnp.float32))
      dq = dq.at[i].add(jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)))
      return dq, dk_j, dv_j

    zeros = jnp.zeros((b, kh, bk, hd), jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(_first_q_block(j, q_offset, bq, bk), nq, body, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq0 = jnp.zeros((nq, b, kh, g, bq, hd), jnp.float32)
  dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, (jnp.arange(kb.shape[0]), kb, vb, ksb))
  dq = dq.transpose(1, 2, 3, 0, 4, 5).reshape(q.shape)
  dk = dk.transpose(1, 2, 0, 3, 4).reshape(k.shape)
  dv = dv.transpose(1, 2, 0, 3, 4).reshape(v.shape)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
