"""A paged KV cache: a pool of fixed-size pages per layer, a page table per decode row, and admission.

Memory follows live tokens instead of rows x maximum length (vLLM's PagedAttention, Kwon et al. 2023). Every
function here is a pure, jit-traceable function of an explicit `PagePool` pytree; the host keeps no state.

Layout: per layer a `models.paged_attention.KVPages` of keys and values, each [K, num_pages, page_size,
head_dim], the layout of jax's Pallas `paged_attention` kernel: a page of one KV head is a [page_size, head_dim]
tile, so a pool split by KV head (tensor parallelism) is written, admitted, forked and read in place, by the
plain-JAX attention and the kernel alike. All layers share one page table: page p of a row holds the same tokens
in every layer.

Invariants (docs/sampler.md):
- refcount[p] is the number of page-table entries, over all rows, that own page p; a page is free iff its count
  is 0. Row r owns table entries j < ceil(lengths[r] / page_size); the entries after them are 0 and never read.
- Only full pages are shared (`fork_rows`); the page a row writes its next token into is its own (count 1),
  so no write ever reaches another row's tokens.
- A row admitted with capacity C (prompt + max new tokens) may grow to C tokens. `can_admit` admits a request
  only if its pages fit the free pages left after every live row's outstanding growth, so a reserved
  allocation cannot fail: a full pool makes admission wait, it never truncates a row or drops a request.
- A contract broken inside jit (no free page, admission into an occupied row, growth past capacity) cannot
  raise: its writes are dropped and a sticky bit is set in `errors`; `raise_on_errors` raises on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.paged_attention import KVPages, write_slots

ERR_NO_PAGE = 1  # an allocation found no free page (admission was not checked)
ERR_ROW_BUSY = 2  # admission or fork into a row that still holds a request
ERR_ROW_FULL = 4  # a row grew past its capacity or its page table
_ERROR_TEXT = {
    ERR_NO_PAGE: "an allocation found no free page (admit only what can_admit allows)",
    ERR_ROW_BUSY: "a request was admitted into a row that was not freed",
    ERR_ROW_FULL: "a row grew past its admitted capacity (stop it at its budget)",
}


class PagePool(NamedTuple):
  """The KV pages of all layers and their bookkeeping (a pytree; donate it between steps).

  kv_pages: L `KVPages` (compute dtype), keys and values each [K, num_pages, page_size, head_dim]
    (kv_pages[l].k[h, p, s]: the key of KV head h at slot s of page p).
  refcount: [num_pages] int32, page-table entries owning each page (0: free).
  page_table: [rows, max_pages_per_row] int32, the pages of each row in token order (0 past its own).
  lengths: [rows] int32, tokens stored per row.
  capacity: [rows] int32, tokens the row was admitted for (0: a free row).
  errors: int32 scalar, OR of the ERR_* bits of broken contracts (0 in a correct run).
  """

  kv_pages: tuple[KVPages, ...]
  refcount: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  capacity: jax.Array
  errors: jax.Array

  @property
  def num_pages(self) -> int:
    return self.refcount.shape[0]

  @property
  def page_size(self) -> int:
    return self.kv_pages[0].k.shape[2]

  @property
  def rows(self) -> int:
    return self.page_table.shape[0]

  @property
  def max_pages_per_row(self) -> int:
    return self.page_table.shape[1]


def pages_for(tokens, page_size: int):
  """Pages that hold `tokens` tokens, ceil(tokens / page_size) (ints or int arrays, elementwise)."""
  return (tokens + page_size - 1) // page_size


def init_pool(
    *,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    rows: int,
    max_pages_per_row: int,
    dtype=jnp.float32,
) -> PagePool:
  """An empty pool: every page free, every row free.

  Raises:
    ValueError: if any size is not a positive int.
  """
  sizes = dict(
      num_layers=num_layers,
      num_pages=num_pages,
      page_size=page_size,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      rows=rows,
      max_pages_per_row=max_pages_per_row,
  )
  for name, n in sizes.items():
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"init_pool: {name}={n!r} must be a positive int")
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  return PagePool(
      kv_pages=tuple(KVPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)),
      refcount=jnp.zeros((num_pages,), jnp.int32),
      page_table=jnp.zeros((rows, max_pages_per_row), jnp.int32),
      lengths=jnp.zeros((rows,), jnp.int32),
      capacity=jnp.zeros((rows,), jnp.int32),
      errors=jnp.zeros((), jnp.int32),
  )


def free_pages(pool: PagePool) -> jax.Array:
  """int32 scalar: pages with reference count 0."""
  return jnp.sum(pool.refcount == 0, dtype=jnp.int32)


def outstanding_pages(pool: PagePool) -> jax.Array:
  """int32 scalar: pages the live rows may still allocate before they reach their capacity."""
  ps = pool.page_size
  return jnp.sum(jnp.maximum(pages_for(pool.capacity, ps) - pages_for(pool.lengths, ps), 0), dtype=jnp.int32)


def request_pages(prompt_len, max_new_tokens, page_size: int, group_size: int = 1):
  """Pages a request needs at its full length: its G rows' ceil((P + R) / page_size) pages, with the P //
  page_size full prompt pages counted once when G > 1 (they are shared, `fork_rows`). Ints or int arrays."""
  total = pages_for(prompt_len + max_new_tokens, page_size)
  shared = prompt_len // page_size if group_size > 1 else 0
  return shared + group_size * (total - shared)


def check_request(pool: PagePool, prompt_len: int, max_new_tokens: int, group_size: int = 1) -> None:
  """Raise if a request could never be admitted, even into an empty pool (it would wait forever).

  Raises:
    ValueError: naming the size to raise, if the request needs more rows, pages per row or pages than the
      pool has, or a length is negative.
  """
  if prompt_len < 1 or max_new_tokens < 0 or group_size < 1:
    raise ValueError(
        f"paged KV: a request needs prompt_len >= 1, max_new_tokens >= 0, group_size >= 1, got "
        f"{prompt_len}, {max_new_tokens}, {group_size}"
    )
  per_row = pages_for(prompt_len + max_new_tokens, pool.page_size)
  if per_row > pool.max_pages_per_row:
    raise ValueError(
        f"paged KV: {prompt_len} + {max_new_tokens} tokens need {per_row} pages of {pool.page_size}, more than "
        f"max_pages_per_row={pool.max_pages_per_row}; raise it or lower max_new_tokens"
    )
  need = request_pages(prompt_len, max_new_tokens, pool.page_size, group_size)
  if need > pool.num_pages or group_size > pool.rows:
    raise ValueError(
        f"paged KV: a group of {group_size} x ({prompt_len} + {max_new_tokens}) tokens needs {need} pages and "
        f"{group_size} rows; the pool has {pool.num_pages} pages and {pool.rows} rows; raise num_pages / rows "
        "(PagedKV.num_pages or config sampling.num_pages; the sampler's decode_rows). Where the sampler's batch "
        "axes split the call into row groups (paged_continuous.row_groups), each group's pool is num_pages / groups "
        "pages: raise num_pages by that factor"
    )


def can_admit(pool: PagePool, prompt_len, max_new_tokens, group_size: int = 1) -> jax.Array:
  """bool scalar: a request of `group_size` rows of `prompt_len` + `max_new_tokens` tokens fits now: enough free
  rows, each row's pages fit its page table, and its pages (`request_pages`) fit the free pages left after the
  live rows' outstanding growth. False means wait for rows to finish (see `check_request` for never)."""
  need = request_pages(prompt_len, max_new_tokens, pool.page_size, group_size)
  per_row = pages_for(prompt_len + max_new_tokens, pool.page_size)
  rows_free = jnp.sum(pool.capacity == 0)
  fits = need + outstanding_pages(pool) <= free_pages(pool)
  return fits & (rows_free >= group_size) & (per_row <= pool.max_pages_per_row)


def _allocate(refcount: jax.Array, counts: jax.Array, max_each: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Take counts[m] free pages for each m (lowest free ids first).

  Returns ([M, max_each] page ids, num_pages where j >= counts[m] or no page was free; the refcount with the
  taken pages at 1; bool scalar: some requested page was not free)."""
  n = refcount.shape[0]
  m = counts.shape[0]
  free_ids = jnp.nonzero(refcount == 0, size=m * max_each, fill_value=n)[0]
  start = jnp.cumsum(counts) - counts  # [M] offset of each request into the free list
  j = jnp.arange(max_each)[None, :]
  want = j < counts[:, None]
  ids = jnp.where(want, free_ids[jnp.clip(start[:, None] + j, 0, m * max_each - 1)], n)
  ids = jnp.where(start[:, None] + j < m * max_each, ids, n)
  short = jnp.any(want & (ids == n))
  return ids, refcount.at[ids.reshape(-1)].add(1, mode="drop"), short


def admit(
    pool: PagePool,
    rows: jax.Array,
    prompt_lens: jax.Array,
    capacities: jax.Array,
    k_lmtkh: jax.Array,
    v_lmtkh: jax.Array,
) -> PagePool:
  """Admit M prefilled requests: fresh pages for each prompt, its keys/values written into them.

  Args:
    pool: the pool.
    rows: [M] distinct int32 rows, one per request; a value outside [0, rows) skips that entry (padding).
    prompt_lens: [M] int32 tokens P of each prompt (1 <= P <= T).
    capacities: [M] int32 tokens each row may grow to (P + max new tokens), checked by `can_admit`.
    k_lmtkh, v_lmtkh: [L, M, T, K, head_dim] prefill keys/values (RoPE applied), T >= every P; tokens at
      t >= P are padding and not stored.

  Returns:
    The pool with the rows' lengths P and their ceil(P / page_size) pages. An occupied row sets ERR_ROW_BUSY,
    a capacity below P or beyond the page table (or P > T) ERR_ROW_FULL (the entry is skipped); a pool out of
    pages ERR_NO_PAGE.
  """
  ps, maxp, n, nrows = pool.page_size, pool.max_pages_per_row, pool.num_pages, pool.rows
  t = k_lmtkh.shape[2]
  valid = (rows >= 0) & (rows < nrows)
  row_ix = jnp.clip(rows, 0, nrows - 1)
  busy = valid & (pool.capacity[row_ix] > 0)
  too_long = valid & ((pages_for(capacities, ps) > maxp) | (capacities < prompt_lens) | (prompt_lens > t))
  ok = valid & ~busy & ~too_long
  ids, refcount, short = _allocate(pool.refcount, jnp.where(ok, pages_for(prompt_lens, ps), 0), maxp)
  tok = jnp.arange(t)
  page = jnp.where(tok[None] < prompt_lens[:, None], ids[:, jnp.minimum(tok // ps, maxp - 1)], n)  # [M, T]
  page = jnp.where(ok[:, None], page, n)
  slot = jnp.broadcast_to(tok % ps, page.shape)
  kv_pages = tuple(write_slots(p, page, slot, k_lmtkh[i], v_lmtkh[i]) for i, p in enumerate(pool.kv_pages))
  dst = jnp.where(ok, row_ix, nrows)
  errors = pool.errors | jnp.where(jnp.any(busy), ERR_ROW_BUSY, 0) | jnp.where(jnp.any(too_long), ERR_ROW_FULL, 0)
  return PagePool(
      kv_pages=kv_pages,
      refcount=refcount,
      page_table=pool.page_table.at[dst].set(jnp.where(ids < n, ids, 0), mode="drop"),
      lengths=pool.lengths.at[dst].set(prompt_lens, mode="drop"),
      capacity=pool.capacity.at[dst].set(capacities, mode="drop"),
      errors=errors | jnp.where(short, ERR_NO_PAGE, 0),
  )


def fork_rows(pool: PagePool, src: jax.Array, dst: jax.Array, capacities: jax.Array) -> PagePool:
  """Start rows `dst` as copies of rows `src` (the G samples of one prefilled prompt): the source's full pages
  are shared (reference count + 1), its partial last page is copied into a fresh page of the new row.

  Args:
    pool: the pool.
    src: [M] int32 rows to copy (each holding a request); dst: [M] distinct int32 free rows (outside
      [0, rows): skip).
    capacities: [M] int32 tokens each new row may grow to.

  Returns:
    The pool; an occupied dst row sets ERR_ROW_BUSY, a capacity below the source's length or beyond the page
    table ERR_ROW_FULL (the entry is skipped), a pool out of pages ERR_NO_PAGE.
  """
  ps, maxp, n, nrows = pool.page_size, pool.max_pages_per_row, pool.num_pages, pool.rows
  valid = (dst >= 0) & (dst < nrows)
  dst_ix, src_ix = jnp.clip(dst, 0, nrows - 1), jnp.clip(src, 0, nrows - 1)
  busy = valid & (pool.capacity[dst_ix] > 0)
  length = pool.lengths[src_ix]  # [M]
  too_long = valid & ((pages_for(capacities, ps) > maxp) | (capacities < length))
  ok = valid & ~busy & ~too_long
  full = length // ps
  partial = ok & (length % ps != 0)
  new_ids, refcount, short = _allocate(pool.refcount, partial.astype(jnp.int32), 1)
  new_page = new_ids[:, 0]  # [M], n when no partial page
  src_table = pool.page_table[src_ix]  # [M, maxp]
  j = jnp.arange(maxp)[None]
  shared = ok[:, None] & (j < full[:, None])
  refcount = refcount.at[jnp.where(shared, src_table, n).reshape(-1)].add(1, mode="drop")
  table = jnp.where(shared, src_table, 0)
  table = jnp.where((j == full[:, None]) & partial[:, None] & (new_page[:, None] < n), new_page[:, None], table)
  src_partial = jnp.take_along_axis(src_table, jnp.minimum(full, maxp - 1)[:, None], axis=1)[:, 0]
  to = jnp.where(partial, new_page, n)
  kv_pages = tuple(KVPages(*(a.at[:, to].set(a[:, src_partial], mode="drop") for a in p)) for p in pool.kv_pages)
  out = jnp.where(ok, dst_ix, nrows)
  return PagePool(
      kv_pages=kv_pages,
      refcount=refcount,
      page_table=pool.page_table.at[out].set(table, mode="drop"),
      lengths=pool.lengths.at[out].set(length, mode="drop"),
      capacity=pool.capacity.at[out].set(capacities, mode="drop"),
      errors=pool.errors
      | jnp.where(jnp.any(busy), ERR_ROW_BUSY, 0)
      | jnp.where(jnp.any(too_long), ERR_ROW_FULL, 0)
      | jnp.where(short, ERR_NO_PAGE, 0),
  )


def append_slots(pool: PagePool, active: jax.Array) -> tuple[PagePool, jax.Array, jax.Array]:
  """Make room for one more token in every active row (a decode step), allocating a page where a row crosses
  a page boundary. Call once per step for all layers, then `models.paged_attention.write_slots` per layer.

  Args:
    pool: the pool.
    active: [rows] bool, the rows that decode this step.

  Returns:
    (the pool with lengths + 1 on active rows; [rows] int32 page of each new token, num_pages (a dropped
    write) on inactive rows; [rows] int32 slot within that page). A row at its capacity sets ERR_ROW_FULL and
    gets no slot; a pool out of pages ERR_NO_PAGE.
  """
  ps, n = pool.page_size, pool.num_pages
  full = active & (pool.lengths >= pool.capacity)
  grow = active & ~full
  need = grow & (pool.lengths % ps == 0)
  ids, refcount, short = _allocate(pool.refcount, need.astype(jnp.int32), 1)
  j = pool.lengths // ps
  rows = jnp.arange(pool.rows)
  table = pool.page_table.at[jnp.where(need & (ids[:, 0] < n), rows, pool.rows), j].set(ids[:, 0], mode="drop")
  page = jnp.where(grow, table[rows, jnp.minimum(j, pool.max_pages_per_row - 1)], n)
  page = jnp.where(need & (ids[:, 0] == n), n, page)
  errors = pool.errors | jnp.where(jnp.any(full), ERR_ROW_FULL, 0) | jnp.where(short, ERR_NO_PAGE, 0)
  slot = pool.lengths % ps
  pool = pool._replace(refcount=refcount, page_table=table, lengths=pool.lengths + grow, errors=errors)
  return pool, page, slot


def append_token(pool: PagePool, k_lrkh: jax.Array, v_lrkh: jax.Array, active: jax.Array) -> PagePool:
  """`append_slots` then `write_slots` for every layer: k_lrkh, v_lrkh are [L, rows, K, hd]."""
  pool, page, slot = append_slots(pool, active)
  kv = tuple(write_slots(p, page, slot, k_lrkh[i], v_lrkh[i]) for i, p in enumerate(pool.kv_pages))
  return pool._replace(kv_pages=kv)


def free_rows(pool: PagePool, done: jax.Array) -> PagePool:
  """Release the rows in `done` ([rows] bool): each page they own loses one reference (a page shared with a
  live row stays), their table entries, lengths and capacities go to 0. Freeing a free row does nothing."""
  n, maxp = pool.num_pages, pool.max_pages_per_row
  owned = done[:, None] & (jnp.arange(maxp)[None] < pages_for(pool.lengths, pool.page_size)[:, None])
  refcount = pool.refcount.at[jnp.where(owned, pool.page_table, n).reshape(-1)].add(-1, mode="drop")
  return pool._replace(
      refcount=refcount,
      page_table=jnp.where(done[:, None], 0, pool.page_table),
      lengths=jnp.where(done, 0, pool.lengths),
      capacity=jnp.where(done, 0, pool.capacity),
  )


def raise_on_errors(errors) -> None:
  """Host check after a jitted run, of `PagePool.errors` (an int32 array or int; an array of several pools'
  errors, e.g. one per row group, is OR-ed). Raises RuntimeError naming each broken contract."""
  bits = int(np.bitwise_or.reduce(np.ravel(np.asarray(jax.device_get(errors), np.int64)), initial=0))
  if bits:
    raise RuntimeError("paged KV pool: " + "; ".join(t for b, t in _ERROR_TEXT.items() if bits & b))
