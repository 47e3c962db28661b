"""Ragged paged attention in plain JAX: each query attends to its own sequence's keys, read from KV pages.

The semantics of `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (the TPU kernel vLLM's tpu-inference
and MaxText use), on the pool's heads-major pages [num_pages, 2K, page_size, head_dim] with keys at even and values
at odd combined heads (`sampling.paged`; the kernel reads token-major pages, `kernel_layout`); sequence s owns
`page_indices[s]` in token order and holds `kv_lens[s]` tokens, the last q_len of which are its queries
(cu_q_lens[s]..cu_q_lens[s + 1]); a query at kv position p sees keys 0..p (and only the last `sliding_window` of
them when set). Grouped-query heads as in `attention_core`: query head h reads KV head h // G. Scores are fp32:
(q · k) * sm_scale, then soft_cap * tanh(scores / soft_cap) when set, then the mask; probabilities and the output
are in the queries' dtype, as `masked_attention`.

This is the CPU/GPU path and the reference the Pallas kernel is tested against. `ragged_paged_attention`
gathers every query's whole page list, O(tokens x pages_per_seq x page_size) work, so it is meant for small
prefills; `paged_decode_attention` (one query per row) gathers only the leading pages of every row up to a
bucket >= the longest row's (`live_page_buckets`), so a decode step's cost follows the live tokens. A query with
no visible key (an idle row, a padding token) gets zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minpro_jax.models.attention_core import NEG_INF
from minpro_jax.runtime import sharding

KERNELS = ("xla", "pallas")  # `paged_decode_attention` (plain JAX) or `pallas_decode_attention` (TPU)
LIVE_MIN_PAGE_SLOTS = 32  # the shortest live-page bucket, in tokens (a gather costs its pages, so buckets can be short)


def live_page_buckets(pages_per_row: int, page_size: int, min_slots: int = LIVE_MIN_PAGE_SLOTS) -> tuple[int, ...]:
  """Page counts `paged_decode_attention` switches between for rows of `pages_per_row` pages: m, 2m, 4m, ...
  below pages_per_row, then pages_per_row itself, m = max(1, min_slots // page_size). Unlike the dense cache's
  `attention_core.live_length_buckets` (a slice of the cache costs a copy on top of its dots), the pages are
  gathered in every case, so every bucket below the page table saves its share of the copy. Plain ints in, a
  strictly increasing tuple of ints out (pages_per_row 9, page_size 16: (2, 4, 8, 9))."""
  out, n = [], max(1, int(min_slots) // int(page_size))
  while n < pages_per_row:
    out.append(n)
    n *= 2
  return (*out, int(pages_per_row))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv_pages", "page", "slot", "lengths", "page_table"],
    meta_fields=["kernel", "num_kv_pages_per_block", "num_queries_per_block"],
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """What a decode step of `Transformer` reads and writes with a paged cache (one new token per row; built by
  the sampler from `sampling.paged.append_slots`). A pytree whose arrays are its leaves; the kernel choice is
  static.

  kv_pages: L arrays [num_pages, 2K, page_size, head_dim] (one array inside a layer).
  page, slot: [B] int32 page and slot the row's new token goes to (page num_pages: no write).
  lengths: [B] int32 tokens of each row, the new one included (0: an idle row).
  page_table: [B, pages_per_row] int32.
  kernel: the decode attention `attend` runs, one of `KERNELS`: "xla" (`paged_decode_attention`, any
    platform) or "pallas" (`pallas_decode_attention`, TPU only).
  num_kv_pages_per_block, num_queries_per_block: the Pallas kernel's block sizes (None: its tuned table, which
    needs a TPU runtime; give both to compile for TPU on another host).
  """

  kv_pages: tuple[jax.Array, ...] | jax.Array
  page: jax.Array
  slot: jax.Array
  lengths: jax.Array
  page_table: jax.Array
  kernel: str = "xla"
  num_kv_pages_per_block: int | None = None
  num_queries_per_block: int | None = None

  def __post_init__(self):
    if self.kernel not in KERNELS:
      raise ValueError(f"PagedKVCache.kernel={self.kernel!r}; choose one of {KERNELS}")

  def _replace(self, **changes) -> "PagedKVCache":
    return dataclasses.replace(self, **changes)

  def attend(self, q_rhd: jax.Array, kv_pages: jax.Array) -> jax.Array:
    """Decode attention of one query per row [rows, q_heads, head_dim] over one layer's `kv_pages` (the new
    token already written), by `kernel`."""
    if self.kernel == "pallas":
      blocks = dict(
          num_kv_pages_per_block=self.num_kv_pages_per_block, num_queries_per_block=self.num_queries_per_block
      )
      return pallas_decode_attention(q_rhd, kv_pages, self.lengths, self.page_table, **blocks)
    return paged_decode_attention(q_rhd, kv_pages, self.lengths, self.page_table)


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
  """[..., K, hd] keys and values -> [..., 2K, hd] with keys at even and values at odd combined heads."""
  return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def kernel_layout(kv_pages: jax.Array) -> jax.Array:
  """One layer's pool pages [num_pages, 2K, page_size, hd] -> the token-major [num_pages, page_size, 2K, hd] the
  Pallas kernel reads (a transpose: on TPU a copy of the pages it is given, so call it on a chip's share only)."""
  return jnp.swapaxes(kv_pages, 1, 2)


def write_per_head(kv_pages: jax.Array, page: jax.Array, slot: jax.Array, kv: jax.Array) -> jax.Array:
  """kv_pages[page[i], c, slot[i]] = kv[i, c] for every combined head c: a scatter indexed by (page, head, slot)
  whose window is one [head_dim] row of a [page_size, head_dim] tile, so a pool split by KV head is written where
  it lies, in its own layout (a scatter of [2K, head_dim] windows wants the heads minor, and TPU relayouts the pool
  around it).

  Args:
    kv_pages: [num_pages, 2K, page_size, hd]; page, slot: [...] int32 (page num_pages drops the write).
    kv: [..., 2K, hd] the tokens' combined heads (`combine_kv`), cast to the pool's dtype.

  Returns:
    The pages, updated.
  """
  heads = jnp.arange(kv_pages.shape[1], dtype=jnp.int32)
  return kv_pages.at[page[..., None], heads, slot[..., None]].set(kv.astype(kv_pages.dtype), mode="drop")


def write_slots(kv_pages: jax.Array, page: jax.Array, slot: jax.Array, k_rkh: jax.Array, v_rkh: jax.Array) -> jax.Array:
  """Write one token per row into one layer's pages (`write_per_head`).

  Args:
    kv_pages: [num_pages, 2K, page_size, hd] one layer's pages.
    page, slot: [rows] int32 (`sampling.paged.append_slots`); page num_pages drops the row's write.
    k_rkh, v_rkh: [rows, K, hd] the new keys/values (RoPE applied).

  Returns:
    The layer's pages, with kv_pages[page[r], 2k, slot[r]] = k_rkh[r, k] and [.., 2k + 1, ..] = v_rkh[r, k].
  """
  return write_per_head(kv_pages, page, slot, combine_kv(k_rkh, v_rkh))


def _check(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array, soft_cap, window) -> None:
  if q.ndim != 3 or kv_pages.ndim != 4:
    raise ValueError(
        f"paged attention: q must be [tokens, q_heads, head_dim] and kv_pages [num_pages, 2K, page_size, head_dim], "
        f"got {q.shape} and {kv_pages.shape}"
    )
  kk, hd = kv_pages.shape[1], kv_pages.shape[3]
  if kk % 2 or q.shape[2] != hd or q.shape[1] % (kk // 2):
    raise ValueError(
        f"paged attention: kv_pages {kv_pages.shape} needs an even combined-head count 2K with K dividing the "
        f"{q.shape[1]} query heads and head_dim {q.shape[2]}"
    )
  if page_indices.ndim != 2 or kv_lens.shape != page_indices.shape[:1]:
    raise ValueError(
        f"paged attention: page_indices must be [seqs, pages_per_seq] and kv_lens [seqs], got "
        f"{page_indices.shape} and {kv_lens.shape}"
    )
  for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices)):
    if a.dtype != jnp.int32:
      raise ValueError(f"paged attention: {name} must be int32, got {a.dtype}")
  if soft_cap is not None and soft_cap == 0.0:
    raise ValueError("paged attention: soft_cap must not be 0 (None turns it off)")
  if window is not None and window <= 0:
    raise ValueError(f"paged attention: sliding_window={window} must be positive (None turns it off)")


def _attend(q, kv_pages, page_ids, kv_len, pos, valid, *, sm_scale, soft_cap, window=None, k_scale=None, v_scale=None):
  """Per query t: attend q[t] to the kv_len[t] tokens of pages page_ids[t], keys 0..pos[t] only."""
  t, h, hd = q.shape
  kh = kv_pages.shape[1] // 2
  g = h // kh
  dt = q.dtype
  # one gather per operand of whole [page_size, hd] tiles into heads-major [T, K, P, ps, hd] (combined head 2k:
  # keys, 2k + 1: values), so the dots below batch over (T, K) with no transpose or strided copy of the pages
  heads = 2 * jnp.arange(kh)[None, :, None]
  ids = page_ids[:, None, :]  # [T, 1, P]
  k = kv_pages[ids, heads].reshape(t, kh, -1, hd)  # [T, K, S, hd], S = P * page_size in token order
  v = kv_pages[ids, heads + 1].reshape(t, kh, -1, hd)
  if k_scale is not None:
    k = k.astype(jnp.float32) * k_scale
  if v_scale is not None:
    v = v.astype(jnp.float32) * v_scale
  qg = q.reshape(t, kh, g, hd)
  scores = jnp.einsum("tkgd,tksd->tkgs", qg, k.astype(dt), preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  s = jnp.arange(k.shape[2])[None]
  mask = (s <= pos[:, None]) & (s < kv_len[:, None]) & valid[:, None]  # [T, S]
  if window is not None:
    mask = mask & (s > pos[:, None] - window)
  scores = jnp.where(mask[:, None, None], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = jnp.einsum("tkgs,tksd->tkgd", probs, v.astype(dt), preferred_element_type=jnp.float32)
  out = jnp.where(jnp.any(mask, axis=1)[:, None, None, None], out, 0.0)
  return out.reshape(t, h, hd).astype(dt)


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
  """Mixed prefill and decode attention over paged KV, the Pallas kernel's signature and semantics (on the pool's
  heads-major pages: `ragged_paged_attention(q, kv, ...)` equals the kernel's `(q, kernel_layout(kv), ...)`).

  Args:
    q: [tokens, q_heads, head_dim] the queries of all sequences, concatenated.
    kv_pages: [num_pages, 2K, page_size, head_dim] one layer's pages (keys even, values odd combined heads;
      the kernel's own layout is `kernel_layout` of it).
    kv_lens: [max_seqs] int32 tokens in each sequence's cache, its queries included (the last q_len).
    page_indices: [max_seqs, pages_per_seq] int32 pages of each sequence in token order.
    cu_q_lens: [max_seqs + 1] int32 cumulative query counts; sequence s's queries are rows
      cu_q_lens[s]..cu_q_lens[s + 1] of q.
    num_seqs: [1] int32, the sequences that count (the first num_seqs).
    sm_scale: multiplies q · k (the kernel's default 1.0; `attention_core` uses 1 / sqrt(head_dim)).
    sliding_window, soft_cap, k_scale, v_scale: as the kernel's (None: off).

  Returns:
    [tokens, q_heads, head_dim] in q's dtype; rows past cu_q_lens[num_seqs] are zeros (the kernel's are
    unspecified).

  Raises:
    ValueError: on shapes that do not match the layout above, non-int32 indices, soft_cap 0 or a
      non-positive sliding_window.
  """
  _check(q, kv_pages, kv_lens, page_indices, soft_cap, sliding_window)
  if cu_q_lens.shape != (kv_lens.shape[0] + 1,) or num_seqs.shape != (1,):
    raise ValueError(
        f"ragged_paged_attention: cu_q_lens must be [max_seqs + 1] and num_seqs [1], got {cu_q_lens.shape} and "
        f"{num_seqs.shape} for {kv_lens.shape[0]} sequences"
    )
  tok = jnp.arange(q.shape[0], dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, kv_lens.shape[0] - 1)
  valid = (tok < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])
  return _attend(
      q,
      kv_pages,
      page_indices[seq],
      kv_lens[seq],
      pos,
      valid,
      sm_scale=sm_scale,
      soft_cap=soft_cap,
      window=sliding_window,
      k_scale=k_scale,
      v_scale=v_scale,
  )


def paged_decode_attention(
    q_rhd: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    buckets: tuple[int, ...] | None = None,
) -> jax.Array:
  """Decode attention: row r's one query (its newest token, already in the pages) attends to the lengths[r]
  tokens of its pages `page_table[r]`.

  Only the first n pages of every row are gathered and scored, n the smallest of `buckets` >= the longest
  row's pages (a `lax.switch` over the static counts), so the work follows the longest live row, not the page
  table. The pages past a row's own are masked in every bucket, so the output is the same as over the whole
  table up to fp32 rounding of the softmax sums (they run over fewer exact zeros).

  Args:
    q_rhd: [rows, q_heads, head_dim] queries (compute dtype), query head h reads KV head h // G.
    kv_pages: [num_pages, 2K, page_size, head_dim] one layer's pages (`sampling.paged.PagePool.kv_pages`).
    lengths: [rows] int32 tokens of each row, the query's own included (0: an idle row, output zeros).
    page_table: [rows, pages_per_row] int32 (`PagePool.page_table`).
    sm_scale: score scale (default 1 / sqrt(head_dim), `attention_core`'s).
    soft_cap: optional logit soft cap (None: off, as the models here).
    buckets: strictly increasing page counts ending at pages_per_row (default `live_page_buckets`).

  Returns:
    [rows, q_heads, head_dim] in q's dtype.

  Raises:
    ValueError: as `ragged_paged_attention`; if the buckets do not end at pages_per_row.
  """
  _check(q_rhd, kv_pages, lengths, page_table, soft_cap, None)
  if q_rhd.shape[0] != lengths.shape[0]:
    raise ValueError(f"paged_decode_attention: {q_rhd.shape[0]} queries for {lengths.shape[0]} rows")
  ps, maxp = kv_pages.shape[2], page_table.shape[1]
  buckets = live_page_buckets(maxp, ps) if buckets is None else tuple(int(b) for b in buckets)
  if buckets[-1] != maxp or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
    raise ValueError(
        f"paged_decode_attention: buckets {buckets} must be strictly increasing positive page counts ending at "
        f"pages_per_row={maxp}"
    )
  scale = 1.0 / math.sqrt(q_rhd.shape[-1]) if sm_scale is None else sm_scale

  def branch(n: int):
    def run(q, kv, lens, table):  # the first n pages of every row
      return _attend(q, kv, table[:, :n], lens, lens - 1, lens > 0, sm_scale=scale, soft_cap=soft_cap)

    return run

  operands = (q_rhd, kv_pages, lengths, page_table)
  if len(buckets) == 1:
    return branch(maxp)(*operands)
  need = (jnp.max(lengths) + ps - 1) // ps
  idx = jnp.clip(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), need), 0, len(buckets) - 1)
  return jax.lax.switch(idx, [branch(n) for n in buckets], *operands)


def pallas_decode_attention(
    q_rhd: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    kernel=None,
) -> jax.Array:
  """`paged_decode_attention` through the Pallas TPU kernel (`ragged_paged_attention`, one query per row).

  Idle rows (length 0) are passed with length 1, which the kernel requires (q_len <= kv_len), and their
  output is zeroed. The pool's heads-major pages reach the kernel in its token-major layout (`kernel_layout`,
  inside the per-device function, so a chip transposes its own share of the pages only). The block sizes go to
  the kernel (None: its tuned table, which needs a TPU runtime, so a compile-only lowering on a CPU host must give
  both). `kernel` replaces the kernel with a function of the same signature, token-major pages included (tests
  pass jax's `ref_ragged_paged_attention`). Under a mesh (`use_mesh`; a Mosaic kernel is not
  partitioned automatically) it runs per device in a `jax.shard_map`, as `splash_attention`: heads split over the
  mesh axes of "act_kv_heads" (query heads and the pool's combined heads alike, where they divide K), rows over
  those of "batch" (where they divide the rows), the pages whole on every device of a row group. Shapes and the
  error raised as `paged_decode_attention`; the kernel adds its own tiling limits (e.g. 2K a multiple of 8 / 16
  unless it is 2, 4 or 8).
  """
  _check(q_rhd, kv_pages, lengths, page_table, soft_cap, None)
  if kernel is None:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
  rows = q_rhd.shape[0]
  scale = 1.0 / math.sqrt(q_rhd.shape[-1]) if sm_scale is None else sm_scale
  if num_kv_pages_per_block is not None:  # the kernel refuses a block of more pages than a row's table holds
    num_kv_pages_per_block = min(num_kv_pages_per_block, page_table.shape[1])
  blocks = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block)
  blocks = {k: v for k, v in blocks.items() if v is not None}

  def per_device(q, kv, lens, table):
    n = q.shape[0]
    cu_q_lens, num_seqs = jnp.arange(n + 1, dtype=jnp.int32), jnp.array([n], jnp.int32)
    kv, lens = kernel_layout(kv), jnp.maximum(lens, 1)
    return kernel(q, kv, lens, table, cu_q_lens, num_seqs, sm_scale=scale, soft_cap=soft_cap, **blocks)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and sharding.auto_axes(mesh):  # within a shard_map: its auto axes
    heads = sharding.mesh_axes(mesh, "act_kv_heads", kv_pages.shape[1] // 2) or None
    batch = sharding.mesh_axes(mesh, "batch", rows, exclude=heads or ()) or None
    per_device = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(batch, heads, None), P(None, heads, None, None), P(batch), P(batch, None)),
        out_specs=P(batch, heads, None),
        axis_names=sharding.auto_axes(mesh),
        check_vma=False,
    )
  out = per_device(q_rhd, kv_pages, lengths, page_table)
  return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q_rhd.dtype)
