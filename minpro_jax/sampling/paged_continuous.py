"""Continuous batching on a paged KV cache: the algorithm of the paged engine (`sampling.engines.paged`).

The loop of `continuous.decode_with_refills` with the dense per-row cache replaced by a `paged.PagePool`
(carried in `ContinuousState.cache`): a refill prefills each waiting prompt once for the samples of its group
it admits (`refill_units`: one row gets the prompt's real tokens in fresh pages, the others share its full
pages and copy its partial last one); a decode step allocates a page where a row crosses a page boundary and
attends to each row's own pages (`models.paged_attention`, the Pallas kernel on TPU: `PagedKV.kernel`); a
row's pages go back to the pool the step it stops. A refill admits only the waiting units, in order, whose
pages at full length fit the pool next to the live rows' reserved growth (`admissible`, as `paged.can_admit`),
so a full pool delays them and never truncates one. Row keys, positions and the stop rule are `continuous`'s,
so every response equals the static sampler's token for token.

A row holds P + R - 1 tokens at most (P its real prompt, R = max_new_tokens: the last sampled token is never
fed back), which is its admitted capacity.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.moe import ROUTE_DTYPE
from minpro_jax.models.paged_attention import KERNELS, PagedKVCache, has_megacore
from minpro_jax.runtime.sharding import DEFAULT_RULES, logical_split
from minpro_jax.sampling import paged
from minpro_jax.sampling.continuous import ContinuousState, record, refill_rule, start_rows
from minpro_jax.sampling.methods import SamplingParams


@dataclasses.dataclass(frozen=True)
class PagedKV:
  """The paged cache of the continuous sampler.

  page_size: tokens per page (TPU kernels want a multiple of 8; 64-256 at the papers' lengths).
  num_pages: pages per layer; None: decode rows x the pages of the longest possible row (the dense cache's
    memory, so nothing ever waits). Fewer pages hold fewer tokens: requests then wait for rows to finish.
  share_prompts: prefill each prompt once for its group's samples and share its full pages among them
    (`refill_units`); False prefills and stores every sample's prompt (the A/B baseline). Same responses.
  kernel: the decode attention: "xla" (`models.paged_attention.paged_decode_attention`, plain JAX), "pallas"
    (jax's Pallas TPU `paged_attention` on the pool's own layout; TPU only) or "auto" (pallas when the
    sampler's devices, its mesh's or else jax's default, are TPUs).
  pages_per_compute_block: the Pallas kernel's block of pages; None: 1024 tokens' worth (`pallas_decode_attention`).
  """

  page_size: int = 16  # the config default too (sampling.page_size; tests/test_sampler_setup.py)
  num_pages: int | None = None
  share_prompts: bool = True
  kernel: str = "auto"
  pages_per_compute_block: int | None = None

  def __post_init__(self):
    for name in ("page_size", "num_pages", "pages_per_compute_block"):
      v = getattr(self, name)
      if (v is not None or name == "page_size") and (
          not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < 1
      ):
        raise ValueError(f"PagedKV.{name}={v!r} must be a positive int")
      if v is not None:
        object.__setattr__(self, name, int(v))  # numpy ints too, stored as Python ints (static arguments)
    if not isinstance(self.share_prompts, (bool, np.bool_)):
      raise ValueError(f"PagedKV.share_prompts={self.share_prompts!r} must be True or False")
    if self.kernel not in ("auto", *KERNELS):
      raise ValueError(f"PagedKV.kernel={self.kernel!r}; choose one of {('auto', *KERNELS)}")

  def pool_sizes(self, rows: int, p_len: int, max_new_tokens: int) -> dict:
    """`paged.init_pool` sizes for `rows` decode rows and prompts of up to p_len tokens (ints)."""
    per_row = paged.pages_for(p_len + max(max_new_tokens - 1, 0), self.page_size)
    return dict(
        num_pages=self.num_pages or rows * per_row, page_size=self.page_size, rows=rows, max_pages_per_row=per_row
    )

  def group_pool(self, groups: int) -> "PagedKV":
    """The pool of one of `groups` row groups (`row_groups`): num_pages / groups pages (at least 1) where set."""
    return dataclasses.replace(self, num_pages=max(self.num_pages // groups, 1) if self.num_pages else None)

  def kernel_fields(self, mesh=None) -> dict:
    """The `PagedKVCache` kernel fields for a sampler on `mesh` (None: jax's default devices): "auto" resolved
    by the devices' platform, and for the Pallas kernel its block and whether the chips have two cores."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    kernel = self.kernel
    if kernel == "auto":
      kernel = "pallas" if device.platform == "tpu" else "xla"
    elif kernel == "pallas" and device.platform != "tpu":
      raise ValueError(
          f"PagedKV.kernel='pallas' needs TPU devices, the sampler's are {device.platform}: use 'auto' or 'xla'"
      )
    if kernel != "pallas":
      return dict(kernel=kernel)
    return dict(kernel=kernel, pages_per_compute_block=self.pages_per_compute_block, megacore=has_megacore(device))


def _prompt_kv(small_k, small_v, n_real, keys_hd_major: bool):
  """The per-layer prefill caches of M left-padded prompts -> [L, M, P, K, hd] keys/values with each prompt's
  real tokens moved to the front (token t of prompt m at index t)."""
  p = small_v[0].shape[2]
  src = jnp.clip(p - n_real[:, None] + jnp.arange(p)[None], 0, p - 1)  # [M, P]

  def front(a_mkph):
    return jnp.take_along_axis(jnp.swapaxes(a_mkph, 1, 2), src[:, :, None, None], axis=1)  # [M, P, K, hd]

  ks = [front(jnp.swapaxes(k, 2, 3) if keys_hd_major else k) for k in small_k]
  return jnp.stack(ks), jnp.stack([front(v) for v in small_v])


def refill_units(
    s: ContinuousState, nxt, count, m: int, unit: int, prefill_fn, requests, sampling, pad_id, hd_major, proc
):
  """The refill branch: the next `count` (<= m, traced) units of `unit` requests nxt, nxt + 1, ... go into done
  decode rows (done rows first). Each unit's prompt is prefilled once and `paged.admit`ted into its first row; the
  other unit - 1 rows `paged.fork_rows` it (full pages shared, the partial last page copied), and every row samples
  its index 0 from that prefill's logits with its own key. Rows that already stopped are freed.

  Args:
    s: the carry; nxt: int32 scalar, the next waiting request (a multiple of unit).
    m: units one refill prefills (static); unit: requests per unit (static, dividing N; the requests of a unit
      hold one prompt: consecutive samples of one group).
    requests: (tokens [N, P], segments [N, P], groups [N], keys [N, 2]) as `continuous.decode_with_refills`.
    Others as `continuous.refill`.

  Returns:
    (the carry, nxt + count * unit).
  """
  tokens_n, segs_n, groups_n, keys_n = requests
  n, b, mu = tokens_n.shape[0], s.done.shape[0], m * unit
  order = jnp.argsort(~s.done, stable=True)[:mu].astype(jnp.int32)  # done rows first
  j = jnp.arange(mu, dtype=jnp.int32)
  slot_ok = j < count * unit
  rows = jnp.where(slot_ok, order, b)
  reqs = jnp.where(slot_ok, nxt + j, n)
  src = jnp.clip(reqs, 0, n - 1)
  tokens, segs = tokens_n[src[::unit]], segs_n[src[::unit]]  # [m, P]: one prompt per unit
  positions = jnp.where(segs > 0, jnp.cumsum(segs, axis=1) - 1, 0).astype(jnp.int32)
  logits, small = prefill_fn(tokens, positions, segs)
  n_real = jnp.sum(segs > 0, axis=1, dtype=jnp.int32)
  k, v = _prompt_kv(small.k, small.v, n_real, hd_major)
  capacity = n_real + max(sampling.max_new_tokens - 1, 0)
  lead = rows[::unit]
  pool = paged.admit(s.cache, lead, n_real, capacity, k, v)
  if unit > 1:
    rest = rows.reshape(m, unit)[:, 1:].reshape(-1)
    pool = paged.fork_rows(pool, jnp.repeat(lead, unit - 1), rest, jnp.repeat(capacity, unit - 1))
  rep = lambda a: jnp.repeat(a, unit, axis=0)
  st = start_rows(
      s._replace(cache=pool),
      rep(logits),
      rep(positions),
      rows,
      reqs,
      groups_n[src],
      keys_n[src],
      sampling,
      pad_id,
      proc,
  )
  stopped = jnp.zeros((b,), bool).at[rows].set(True, mode="drop") & st.done
  return st._replace(cache=paged.free_rows(st.cache, stopped)), nxt + count * unit


def decode_step(s: ContinuousState, step_fn, sampling: SamplingParams, pad_id: int, processor=None):
  """One token for every live row into its pages, then `record`; rows that stop release their pages.

  step_fn(PagedKVCache, tokens [B], positions [B]) -> (logits [B, V], kv_pages), plus routes [B, L, k] when
  the state records them."""
  live = ~s.done
  pool, page, slot = paged.append_slots(s.cache, live)
  cache = PagedKVCache(pool.kv_pages, page, slot, pool.lengths, pool.page_table)
  logits, kv_pages, *routes = step_fn(cache, s.prev, s.next_pos + s.step - 1)
  s = s._replace(cache=pool._replace(kv_pages=kv_pages))
  if s.routes is not None:  # the experts that fed response index step - 1 forward
    at = jnp.where(live, s.req, s.routes.shape[0])
    s = s._replace(routes=s.routes.at[at, s.step - 1].set(routes[0].astype(ROUTE_DTYPE), mode="drop"))
  s, step, done, prev = record(s, logits, s.step, live, s.req, s.group, s.keys, sampling, pad_id, processor)
  return s._replace(step=step, done=done, prev=prev, cache=paged.free_rows(s.cache, done & live))


def admissible(pool: paged.PagePool, segs_n, nxt, m: int, max_new_tokens: int, unit: int = 1):
  """int32 scalar: how many of the waiting units (of `unit` requests) starting at request nxt, at most m, fit the
  pool now, in order (`paged.request_pages`: a unit's full prompt pages count once)."""
  n = segs_n.shape[0]
  idx = nxt + unit * jnp.arange(m)
  n_real = jnp.sum(segs_n[jnp.clip(idx, 0, n - 1)] > 0, axis=1, dtype=jnp.int32)
  need = paged.request_pages(n_real, max(max_new_tokens - 1, 0), pool.page_size, unit)
  pages = jnp.where(idx < n, need, 0)
  room = paged.free_pages(pool) - paged.outstanding_pages(pool)
  return jnp.sum((jnp.cumsum(pages) <= room) & (idx < n), dtype=jnp.int32)


def decode_with_refills(
    st,
    step_fn,
    prefill_fn,
    requests,
    refill_rows: int,
    sampling,
    pad_id,
    hd_major,
    proc=None,
    unit: int = 1,
    any_group=lambda x: x,
):
  """`continuous.decode_with_refills` on a page pool, in units of `unit` requests that share one prompt
  (`refill_units`): an iteration refills done rows with the next waiting units that fit the pool (`refill_rule`
  counted in units: at least min(refill units, waiting units) units of done rows, and at least one fits), else
  decodes one step. A refill prefills max(1, refill_rows // unit) units.

  Args: as `continuous.decode_with_refills`, with `st.cache` a `paged.PagePool` of B >= unit rows and N a
  multiple of unit; `any_group`: bool scalar -> bool scalar, true where it is true in any row group (`run`'s
  split), so the groups step in lockstep: an iteration refills where any group refills (a group that would not
  refills nothing) and the loop runs until every group is done. Returns: the final carry (every request done;
  its pool's `errors` 0 in a correct run)."""
  segs_n = requests[1]
  n, m = segs_n.shape[0], max(1, refill_rows // unit)
  r = sampling.max_new_tokens

  def plan(s, nxt):
    go, count = refill_rule(jnp.sum(s.done.astype(jnp.int32)) // unit, (n - nxt) // unit, m)
    fit = admissible(s.cache, segs_n, nxt, m, r, unit)
    return go & (fit > 0), jnp.minimum(count, fit)

  def refill_branch(c):
    s, nxt = c
    go, count = plan(s, nxt)
    count = jnp.where(go, count, 0)
    return refill_units(s, nxt, count, m, unit, prefill_fn, requests, sampling, pad_id, hd_major, proc)

  def step_branch(c):
    s, nxt = c
    return decode_step(s, step_fn, sampling, pad_id, proc), nxt

  def cond(c):
    s, nxt = c
    return any_group((nxt < n) | ~jnp.all(s.done))

  def body(c):
    s, nxt = c
    return jax.lax.cond(any_group(plan(s, nxt)[0]), refill_branch, step_branch, c)

  return jax.lax.while_loop(cond, body, (st, jnp.zeros((), jnp.int32)))[0]


def share_unit(
    paged_kv: PagedKV,
    group_size: int,
    rows: int,
    prompt_lens,
    p_len: int,
    max_new_tokens: int,
    refill_rows: int | None = None,
) -> int:
  """Requests per shared prefill (host side): the largest divisor u of group_size with u <= rows (and u <=
  refill_rows where given) whose unit of the longest prompt fits an empty pool (so a pool that holds one request
  but not a whole group still runs, unshared); 1 with `share_prompts` off. A refill admits whole units, so a unit
  larger than the refill size keeps done rows idle until that many are done (Qwen3-8B on v5p-64, 64 rows a group,
  refills of 8: units of 16 take 7 % more decode steps than units of 8, `aot.paged_schedule`)."""
  if not paged_kv.share_prompts:
    return 1
  sizes = paged_kv.pool_sizes(rows, p_len, max_new_tokens)
  longest = max(int(x) for x in prompt_lens)
  for u in range(min(group_size, rows, refill_rows or rows), 0, -1):
    need = paged.request_pages(longest, max(max_new_tokens - 1, 0), paged_kv.page_size, u)
    if group_size % u == 0 and need <= sizes["num_pages"]:
      return u
  return 1


def row_group_axes(mesh, rules) -> tuple[tuple[str, ...], int]:
  """(mesh axes, their size G) of the sampler's "batch" rule that do not split the KV heads: the row groups a
  paged call on `mesh` splits into where G divides its rows and requests (`row_groups`); ((), 1) without a mesh.
  Axes of size 1 count (G may be 1): the call then still runs its loop in the `shard_map` over them, where XLA:TPU
  carries the pool through the loop's refill / decode `cond` in place; outside a shard_map it copied every layer's
  pool once per iteration (Qwen3-8B on v5p-8 at tensor=4, 32 rows: 80.9 GB of temporaries against 28.3 GB,
  2026-12-06, compile-only)."""
  if mesh is None:
    return (), 1
  rules, shape = rules or DEFAULT_RULES, dict(mesh.shape)
  heads = set(logical_split(shape, "act_kv_heads", rules)[0])
  axes = tuple(a for a in logical_split(shape, "batch", rules)[0] if a not in heads and a in shape)
  return axes, int(np.prod([shape[a] for a in axes])) if axes else 1
