"""Paged decode attention in plain JAX and through jax's Pallas TPU kernel: each row's one query attends to its own
tokens, read from KV pages.

The pages are jax's `paged_attention` kernel's own layout (`jax.experimental.pallas.ops.tpu.paged_attention`, the
decode kernel of JetStream): per layer a `KVPages` of keys and values, each [K, num_pages, page_size, head_dim],
so a page of one KV head is a [page_size, head_dim] tile and a pool split by KV head (tensor parallelism) is
written, admitted, forked and read where it lies, with no relayout (docs/sampler.md, "The kernel"). Row r owns
`page_table[r]` in token order and holds `lengths[r]` tokens, its newest (the query's own) included.
Grouped-query heads as in `attention_core`: query head h reads KV head h // G. Scores are fp32: (q · k) *
sm_scale, then soft_cap * tanh(scores / soft_cap) when set, then the mask; probabilities and the output are in
the queries' dtype, as `masked_attention`. A row with no token (an idle row) gets zeros.

`paged_decode_attention` is the CPU/GPU path and the reference the kernel is tested against (TPU interpret mode):
it gathers only the leading pages of every row up to a bucket >= the longest row's (`live_page_buckets`), so a
decode step's cost follows the live tokens. `pallas_decode_attention` calls the kernel per device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minpro_jax.models.attention_core import NEG_INF
from minpro_jax.runtime import sharding

KERNELS = ("xla", "pallas")  # `paged_decode_attention` (plain JAX) or `pallas_decode_attention` (TPU)
# KV tokens per block of the Pallas kernel where `pages_per_compute_block` is unset (8 pages of 128): about the
# block that jax's ragged kernel's tuned table holds; 16k tokens a block overflowed a v5p's VMEM at compile time
KV_BLOCK_TOKENS = 1024
LIVE_MIN_PAGE_SLOTS = 32  # the shortest live-page bucket, in tokens (a gather costs its pages, so buckets can be short)


class KVPages(NamedTuple):
  """One layer's pages: k, v each [K, num_pages, page_size, head_dim] (k[h, p, s]: the key of KV head h at
  slot s of page p), the Pallas `paged_attention` kernel's k_pages / v_pages."""

  k: jax.Array
  v: jax.Array


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
    meta_fields=["kernel", "pages_per_compute_block", "megacore"],
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """What a decode step of `Transformer` reads and writes with a paged cache (one new token per row; built by
  the sampler from `sampling.paged.append_slots`). A pytree whose arrays are its leaves; the kernel choice is
  static.

  kv_pages: L `KVPages` (one inside a layer).
  page, slot: [B] int32 page and slot the row's new token goes to (page num_pages: no write).
  lengths: [B] int32 tokens of each row, the new one included (0: an idle row).
  page_table: [B, pages_per_row] int32.
  kernel: the decode attention `attend` runs, one of `KERNELS`: "xla" (`paged_decode_attention`, any
    platform) or "pallas" (`pallas_decode_attention`, TPU only).
  pages_per_compute_block, megacore: the Pallas kernel's block and whether its chip has two TensorCores
    (`pallas_decode_attention`).
  """

  kv_pages: tuple[KVPages, ...] | KVPages
  page: jax.Array
  slot: jax.Array
  lengths: jax.Array
  page_table: jax.Array
  kernel: str = "xla"
  pages_per_compute_block: int | None = None
  megacore: bool = False

  def __post_init__(self):
    if self.kernel not in KERNELS:
      raise ValueError(f"PagedKVCache.kernel={self.kernel!r}; choose one of {KERNELS}")

  def _replace(self, **changes) -> "PagedKVCache":
    return dataclasses.replace(self, **changes)

  def attend(self, q_rhd: jax.Array, pages: KVPages) -> jax.Array:
    """Decode attention of one query per row [rows, q_heads, head_dim] over one layer's `pages` (the new token
    already written), by `kernel`."""
    if self.kernel == "pallas":
      return pallas_decode_attention(
          q_rhd,
          pages,
          self.lengths,
          self.page_table,
          pages_per_compute_block=self.pages_per_compute_block,
          megacore=self.megacore,
      )
    return paged_decode_attention(q_rhd, pages, self.lengths, self.page_table)


def write_slots(pages: KVPages, page: jax.Array, slot: jax.Array, k: jax.Array, v: jax.Array) -> KVPages:
  """Write tokens into one layer's pages: pages.k[h, page[i], slot[i]] = k[i, h] for every KV head h (and v
  likewise). A scatter indexed by (head, page, slot) whose window is one [head_dim] row of a [page_size,
  head_dim] tile, so a pool split by KV head is written where it lies, in its own layout.

  Under a mesh whose "act_kv_heads" axes split the KV heads (`use_mesh`; inside a `jax.shard_map`, its auto axes)
  the scatter runs per device in a `jax.shard_map` over those axes: each chip writes its own KV heads from its own
  share of k and v. Left to GSPMD, the scatter's (head, page, slot) index array made it replicate the new tokens'
  keys and values on every chip first: one all-gather of bf16[rows, K, 1, hd] per layer and decode step (issue
  54). The page and slot arrays are whole on every chip (a row's token goes to every chip that holds its pages).

  Args:
    pages: one layer's `KVPages`.
    page, slot: [...] int32 (`sampling.paged.append_slots`: [rows]; `admit`: [M, T]); page num_pages drops the
      write.
    k, v: [..., K, head_dim] the tokens' keys / values (RoPE applied), cast to the pages' dtype.

  Returns:
    The pages, updated.
  """
  mesh = jax.sharding.get_abstract_mesh()
  heads = ()
  if mesh is not None and not mesh.empty and sharding.auto_axes(mesh):
    heads = sharding.mesh_axes(mesh, "act_kv_heads", pages.k.shape[0])
  if not heads:
    return _write_slots(pages, page, slot, k, v)
  kv_spec = P(heads, None, None, None)
  new_spec = P(*([None] * (k.ndim - 2)), heads, None)
  write = jax.shard_map(
      _write_slots,
      mesh=mesh,
      in_specs=(KVPages(kv_spec, kv_spec), P(), P(), new_spec, new_spec),
      out_specs=KVPages(kv_spec, kv_spec),
      axis_names=sharding.auto_axes(mesh),
      check_vma=False,
  )
  return write(pages, page, slot, k, v)


def _write_slots(pages: KVPages, page: jax.Array, slot: jax.Array, k: jax.Array, v: jax.Array) -> KVPages:
  """`write_slots` on one device (or left to GSPMD): the scatter over every KV head of `pages`."""
  heads = jnp.arange(pages.k.shape[0], dtype=jnp.int32)
  ix = (heads, page[..., None], slot[..., None])
  return KVPages(
      k=pages.k.at[ix].set(k.astype(pages.k.dtype), mode="drop"),
      v=pages.v.at[ix].set(v.astype(pages.v.dtype), mode="drop"),
  )


def _check(q: jax.Array, pages: KVPages, lengths: jax.Array, page_table: jax.Array, soft_cap) -> None:
  if q.ndim != 3 or pages.k.ndim != 4 or pages.k.shape != pages.v.shape:
    raise ValueError(
        f"paged attention: q must be [rows, q_heads, head_dim] and pages.k, pages.v both [K, num_pages, page_size, "
        f"head_dim], got {q.shape}, {pages.k.shape} and {pages.v.shape}"
    )
  kh, hd = pages.k.shape[0], pages.k.shape[3]
  if q.shape[2] != hd or q.shape[1] % kh:
    raise ValueError(
        f"paged attention: pages of {kh} KV heads and head_dim {hd} need K dividing the {q.shape[1]} query heads "
        f"and q's head_dim {q.shape[2]} equal to it"
    )
  if page_table.ndim != 2 or lengths.shape != page_table.shape[:1] or q.shape[0] != lengths.shape[0]:
    raise ValueError(
        f"paged attention: page_table must be [rows, pages_per_row] and lengths [rows], got {page_table.shape} "
        f"and {lengths.shape}, for {q.shape[0]} queries"
    )
  for name, a in (("lengths", lengths), ("page_table", page_table)):
    if a.dtype != jnp.int32:
      raise ValueError(f"paged attention: {name} must be int32, got {a.dtype}")
  if soft_cap is not None and soft_cap == 0.0:
    raise ValueError("paged attention: soft_cap must not be 0 (None turns it off)")


def _attend(q, pages: KVPages, page_ids, lengths, *, sm_scale, soft_cap):
  """Row r's one query over the lengths[r] tokens of pages page_ids[r]."""
  t, h, hd = q.shape
  kh = pages.k.shape[0]
  g = h // kh
  dt = q.dtype
  # one gather per operand of whole [page_size, hd] tiles into [rows, K, n, ps, hd], so the dots below batch over
  # (rows, K) with no transpose or strided copy of the pages
  heads, ids = jnp.arange(kh)[None, :, None], page_ids[:, None, :]
  k = pages.k[heads, ids].reshape(t, kh, -1, hd)  # [rows, K, S, hd], S = n * page_size in token order
  v = pages.v[heads, ids].reshape(t, kh, -1, hd)
  qg = q.reshape(t, kh, g, hd)
  scores = jnp.einsum("tkgd,tksd->tkgs", qg, k.astype(dt), preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  mask = jnp.arange(k.shape[2])[None] < lengths[:, None]  # [rows, S]
  scores = jnp.where(mask[:, None, None], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = jnp.einsum("tkgs,tksd->tkgd", probs, v.astype(dt), preferred_element_type=jnp.float32)
  out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
  return out.reshape(t, h, hd).astype(dt)


def paged_decode_attention(
    q_rhd: jax.Array,
    pages: KVPages,
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
    pages: one layer's `KVPages` (`sampling.paged.PagePool.kv_pages`).
    lengths: [rows] int32 tokens of each row, the query's own included (0: an idle row, output zeros).
    page_table: [rows, pages_per_row] int32 (`PagePool.page_table`).
    sm_scale: score scale (default 1 / sqrt(head_dim), `attention_core`'s).
    soft_cap: optional logit soft cap (None: off, as the models here).
    buckets: strictly increasing page counts ending at pages_per_row (default `live_page_buckets`).

  Returns:
    [rows, q_heads, head_dim] in q's dtype.

  Raises:
    ValueError: on shapes that do not match the above, non-int32 lengths or table, soft_cap 0, or buckets that
      do not end at pages_per_row.
  """
  _check(q_rhd, pages, lengths, page_table, soft_cap)
  ps, maxp = pages.k.shape[2], page_table.shape[1]
  buckets = live_page_buckets(maxp, ps) if buckets is None else tuple(int(b) for b in buckets)
  if buckets[-1] != maxp or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
    raise ValueError(
        f"paged_decode_attention: buckets {buckets} must be strictly increasing positive page counts ending at "
        f"pages_per_row={maxp}"
    )
  scale = 1.0 / math.sqrt(q_rhd.shape[-1]) if sm_scale is None else sm_scale

  def branch(n: int):
    def run(q, pages, lens, table):  # the first n pages of every row
      return _attend(q, pages, table[:, :n], lens, sm_scale=scale, soft_cap=soft_cap)

    return run

  operands = (q_rhd, pages, lengths, page_table)
  if len(buckets) == 1:
    return branch(maxp)(*operands)
  need = (jnp.max(lengths) + ps - 1) // ps
  idx = jnp.clip(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), need), 0, len(buckets) - 1)
  return jax.lax.switch(idx, [branch(n) for n in buckets], *operands)


def kernel_block(pages_per_compute_block: int | None, page_size: int, pages_per_row: int) -> int:
  """Pages per block of the Pallas kernel: `pages_per_compute_block` (None: `KV_BLOCK_TOKENS` tokens' worth, at
  least 1), at most a row's pages. The kernel loads whole blocks, so a row of n pages reads ceil(n / block)
  blocks."""
  return min(pages_per_compute_block or max(1, KV_BLOCK_TOKENS // page_size), pages_per_row)


def has_megacore(device) -> bool:
  """Whether `device` is a TPU chip of two TensorCores under one device (`num_cores` 2: v4, v5p), whose
  kernels split their grid over both cores (`megacore_mode`)."""
  return getattr(device, "platform", None) == "tpu" and getattr(device, "num_cores", 1) == 2


def megacore_mode(rows: int, kv_heads: int) -> str | None:
  """The kernel's `megacore_mode` on a megacore chip for one device's share of rows and KV heads: "batch"
  (rows even), else "kv_head" (K even), else None (one core)."""
  return "batch" if rows % 2 == 0 else "kv_head" if kv_heads % 2 == 0 else None


def pallas_decode_attention(
    q_rhd: jax.Array,
    pages: KVPages,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    pages_per_compute_block: int | None = None,
    megacore: bool = False,
    kernel=None,
) -> jax.Array:
  """`paged_decode_attention` through jax's Pallas TPU kernel (`paged_attention`), which reads the pages in their
  own layout.

  The kernel takes pre-scaled queries (scaled here in fp32), no soft cap (refused) and rows of at least one
  token: idle rows (length 0) are passed with length 1 and their output zeroed. Its block of
  `pages_per_compute_block` pages (None: `KV_BLOCK_TOKENS` tokens' worth; capped at the table) must divide the page table,
  which is padded with page 0 to a multiple of it (the kernel reads no page past a row's length).
  `megacore` (a chip of two cores, `has_megacore`; the kernel may hang when told of a second core that is not
  there) splits each device's grid over its cores (`megacore_mode`). `kernel` replaces the kernel with a function of the
  same signature (tests). Under a mesh (`use_mesh`; a Mosaic kernel is not partitioned automatically) it runs
  per device in a `jax.shard_map`, as `splash_attention`: heads split over the mesh axes of "act_kv_heads"
  (where they divide K), rows over those of "batch" (where they divide the rows), the pages whole on every device
  of a row group. Shapes and errors as `paged_decode_attention`; ValueError for a soft cap.
  """
  _check(q_rhd, pages, lengths, page_table, soft_cap)
  if soft_cap is not None:
    raise ValueError("pallas_decode_attention: jax's paged_attention kernel has no soft cap; use kernel 'xla'")
  if kernel is None:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel
  rows, ps, maxp = q_rhd.shape[0], pages.k.shape[2], page_table.shape[1]
  scale = 1.0 / math.sqrt(q_rhd.shape[-1]) if sm_scale is None else sm_scale
  block = kernel_block(pages_per_compute_block, ps, maxp)
  pad = -maxp % block

  def per_device(q, pages, lens, table):
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    table = jnp.pad(table, ((0, 0), (0, pad)))
    mode = megacore_mode(q.shape[0], pages.k.shape[0]) if megacore else None
    return kernel(q, pages.k, pages.v, jnp.maximum(lens, 1), table, pages_per_compute_block=block, megacore_mode=mode)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and sharding.auto_axes(mesh):  # within a shard_map: its auto axes
    heads = sharding.mesh_axes(mesh, "act_kv_heads", pages.k.shape[0]) or None
    batch = sharding.mesh_axes(mesh, "batch", rows, exclude=heads or ()) or None
    kv_spec = P(heads, None, None, None)
    per_device = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(batch, heads, None), KVPages(kv_spec, kv_spec), P(batch), P(batch, None)),
        out_specs=P(batch, heads, None),
        axis_names=sharding.auto_axes(mesh),
        check_vma=False,
    )
  out = per_device(q_rhd, pages, lengths, page_table)
  return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q_rhd.dtype)
