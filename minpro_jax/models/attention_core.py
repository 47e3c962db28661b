"""The attention core, softmax(q·kᵀ / √head_dim + mask) · v, on heads-major grouped-query operands.

Queries come grouped by KV head, qg [B, K, G, T, hd] (query head k * G + j is group j of KV head k, HF's
`repeat_kv` order), so every dot is a batched [G * T, hd] x [hd, S] matmul over (B, K) without repeating the
keys. Scores and the softmax are fp32 whatever the compute dtype.

`masked_attention` scores every query against every key slot and is what the KV-cache path uses.
`causal_block_attention` is for a forward without a cache (training, scoring), where query t sits in key
slot t: it splits the queries into blocks and scores each block only against the keys up to its last
query. The keys it skips are masked in every case (they lie after every query of the block), so a query
with at least one visible key gets the same output either way, up to float rounding (the softmax sums run
over fewer exact zeros). A fully masked query row (padding) gets the uniform average of the values it
scored: over all S slots in `masked_attention`, over its block's keys in `causal_block_attention`; so
padding rows differ between the two, and callers never read them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked (padding) rows give a uniform softmax instead of NaN
MIN_BLOCK_QUERIES = 64  # shorter query blocks cost more in per-op overhead and compile time than they save


def causal_block_count(seq_len: int, max_blocks: int) -> int:
  """Query blocks `causal_block_attention` should use for `seq_len` queries: at most `max_blocks`
  (`ModelConfig.attn_causal_blocks`), each of at least MIN_BLOCK_QUERIES queries, and at least 1
  (T = 256, max 4: 4 blocks; T < 128: 1, the full score matrix). Plain ints in, int out; a max_blocks
  below 1 gives 1 (`ModelConfig` rejects it earlier)."""
  return max(1, min(max_blocks, seq_len // MIN_BLOCK_QUERIES))


def masked_attention(
    qg_bkgth: jax.Array, k_all: jax.Array, v_bksh: jax.Array, mask_bts: jax.Array, *, keys_hd_major: bool, dtype
) -> jax.Array:
  """Attention of T queries over S key slots with an explicit mask: scaled dot-product attention (Vaswani et
  al. 2017, eq. 1) with grouped-query heads, as HF's `eager_attention_forward` computes it.

  Args:
    qg_bkgth: [B, K, G, T, hd] queries (compute dtype), grouped by KV head.
    k_all: [B, K, S, hd] keys, or [B, K, hd, S] when `keys_hd_major` (the fp32 KV cache layout).
    v_bksh: [B, K, S, hd] values.
    mask_bts: [B, T, S] bool, True where query t may attend to slot s.
    keys_hd_major: the layout of `k_all`.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, K, G, T, hd] in `dtype`.
  """
  hd = qg_bkgth.shape[-1]
  scores = jnp.einsum(
      "bkgth,bkhs->bkgts" if keys_hd_major else "bkgth,bksh->bkgts",
      qg_bkgth,
      k_all.astype(dtype),
      preferred_element_type=jnp.float32,
  )
  scores = jnp.where(mask_bts[:, None, None], scores * (1.0 / math.sqrt(hd)), NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bksh->bkgth", probs, v_bksh.astype(dtype), preferred_element_type=jnp.float32)
  return out.astype(dtype)


def causal_block_attention(
    qg_bkgth: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, mask_btt: jax.Array, num_blocks: int, *, dtype
) -> jax.Array:
  """`masked_attention` for queries in slots 0..T-1 of their own T keys, skipping the keys after each block.

  Query block i covers rows [eᵢ, eᵢ₊₁) with eᵢ = round(i * T / n) and is scored against keys [0, eᵢ₊₁),
  which is (n + 1) / (2n) of the T x T work for equal blocks (n = 4: 62.5 %); the same blocking as the
  causal block skipping of FlashAttention (Dao et al. 2022), done here with whole-block XLA matmuls. The
  mask enters as an additive 0 / NEG_INF bias, which gives the same scores as `masked_attention`'s select
  and has no select in its gradient.

  Args:
    qg_bkgth: [B, K, G, T, hd] queries (compute dtype).
    k_bksh, v_bksh: [B, K, T, hd] keys and values of the same T tokens.
    mask_btt: [B, T, T] bool attention mask; must already be causal (True only at s <= t).
    num_blocks: number of query blocks n >= 1 (capped at T); 1 is one full score matrix.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, K, G, T, hd] in `dtype`; equal to `masked_attention` up to float rounding on every row with a
    visible key.

  Raises:
    ValueError: if the mask is not [B, T, T], the keys or values are not the T queries' own, or
      num_blocks < 1.
  """
  t, hd = qg_bkgth.shape[3], qg_bkgth.shape[4]
  if mask_btt.ndim != 3:
    raise ValueError(f"causal_block_attention: mask_btt must be [B, T, T] bool, got shape {mask_btt.shape}")
  if k_bksh.shape[2] != t or v_bksh.shape[2] != t or mask_btt.shape[1:] != (t, t):
    raise ValueError(
        f"causal_block_attention needs the T={t} queries' own keys: got keys "
        f"{k_bksh.shape}, values {v_bksh.shape}, mask {mask_btt.shape}; use masked_attention "
        "for a KV cache"
    )
  if num_blocks < 1:
    raise ValueError(f"causal_block_attention: num_blocks={num_blocks} must be >= 1")
  n = min(num_blocks, t)
  edges = [round(i * t / n) for i in range(n + 1)]
  bias = jnp.where(mask_btt, 0.0, NEG_INF).astype(jnp.float32)[:, None, None]  # [B, 1, 1, T, T]
  k, v = k_bksh.astype(dtype), v_bksh.astype(dtype)
  outs = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    scores = jnp.einsum("bkgth,bksh->bkgts", qg_bkgth[:, :, :, lo:hi], k[:, :, :hi], preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd)) + bias[..., lo:hi, :hi]
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    outs.append(jnp.einsum("bkgts,bksh->bkgth", probs, v[:, :, :hi], preferred_element_type=jnp.float32))
  return (outs[0] if n == 1 else jnp.concatenate(outs, axis=3)).astype(dtype)


LIVE_MIN_SLOTS = 128  # the shortest live-length bucket (fewer slots save less than a switch branch costs)


def live_length_buckets(num_slots: int, min_slots: int = LIVE_MIN_SLOTS) -> tuple[int, ...]:
  """Key-slot counts `live_length_attention` switches between for a cache of `num_slots` slots: min_slots,
  2 * min_slots, 4 * min_slots, ... up to num_slots / 2, then num_slots itself. A bucket below the cache size
  is a strided slice that XLA copies out of the cache before its dots, so it costs about twice its slots;
  one above half the cache would cost more than scoring the whole cache. Plain ints in, a strictly increasing
  tuple of ints out."""
  out, n = [], max(1, int(min_slots))
  while 2 * n <= num_slots:
    out.append(n)
    n *= 2
  return (*out, int(num_slots))


def live_length_attention(
    qg_bkgth: jax.Array,
    k_all: jax.Array,
    v_bksh: jax.Array,
    q_slot_bt: jax.Array,
    q_segment_bt: jax.Array,
    kv_segment_bs: jax.Array,
    live_len: jax.Array,
    *,
    keys_hd_major: bool,
    dtype,
    buckets: tuple[int, ...] | None = None,
) -> jax.Array:
  """`masked_attention` over a KV cache that scores only its first L slots, L the smallest bucket >= live_len.

  The mask is the KV-cache rule (slot s <= the query's slot, same non-zero segment id), built on the L slots
  only; a `lax.switch` over the static `buckets` picks L, so the cost of a call follows the longest live
  row instead of the cache size. A query whose slot is < L sees exactly the keys it sees in the full cache
  (every slot >= L lies after it), so its output equals `masked_attention` on the whole cache up to fp32
  rounding of the softmax sums (they run over fewer exact zeros). Queries at slot >= L (finished rows whose
  output nobody reads) see only the first L slots.

  Args:
    qg_bkgth: [B, K, G, T, hd] queries (compute dtype).
    k_all: [B, K, S, hd] keys, or [B, K, hd, S] when `keys_hd_major`.
    v_bksh: [B, K, S, hd] values.
    q_slot_bt: [B, T] int32 cache slot of each query.
    q_segment_bt: [B, T] int32 segment ids of the queries (0: padding, attends to nothing).
    kv_segment_bs: [B, S] int32 segment ids of the cache slots.
    live_len: int32 scalar, the number of leading slots any query that matters may see (max slot + 1);
      values above the largest bucket score all S slots.
    keys_hd_major: the layout of `k_all`.
    dtype: compute dtype of the probabilities and the output.
    buckets: strictly increasing slot counts ending at S (default `live_length_buckets(S)`).

  Returns:
    [B, K, G, T, hd] in `dtype`.

  Raises:
    ValueError: if the buckets do not end at the cache's S slots.
  """
  s = v_bksh.shape[2]
  buckets = live_length_buckets(s) if buckets is None else tuple(int(b) for b in buckets)
  if buckets[-1] != s or list(buckets) != sorted(set(buckets)):
    raise ValueError(f"live_length_attention: buckets {buckets} must be strictly increasing and end at S={s}")

  def branch(n: int):
    def run(qg, k_all, v_all, q_slot, q_seg, kv_seg):
      k = k_all[..., :n] if keys_hd_major else k_all[:, :, :n]
      mask = (jnp.arange(n)[None, None, :] <= q_slot[:, :, None]) & (q_seg[:, :, None] == kv_seg[:, None, :n])
      mask = mask & (q_seg[:, :, None] != 0)
      return masked_attention(qg, k, v_all[:, :, :n], mask, keys_hd_major=keys_hd_major, dtype=dtype)

    return run

  operands = (qg_bkgth, k_all, v_bksh, q_slot_bt, q_segment_bt, kv_segment_bs)
  if len(buckets) == 1:
    return branch(s)(*operands)
  idx = jnp.clip(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), live_len.astype(jnp.int32)), 0, len(buckets) - 1)
  return jax.lax.switch(idx, [branch(n) for n in buckets], *operands)
