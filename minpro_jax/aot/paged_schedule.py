"""The paged sampler's loop iterations and the KV pages its attention reads, replayed on a length draw.

`paged_schedule` replays `minpro_jax.sampling.paged_continuous.decode_with_refills` (the paged engine, `sampling.engines.paged`) on
N response lengths with the pool's own admission: requests go in units of `unit` samples of one prompt (the unit's
full prompt pages stored once and shared, `paged.request_pages`); an iteration refills when `refill_rule` (counted
in units) says so and at least one waiting unit's pages at full length fit the free pages left after every live
row's outstanding growth (`paged_continuous.admissible`), else it decodes one step for every live row. A row of
response length L holds P tokens after its refill, P + t after decode step t = 1 .. L - 1, and returns its pages
the step it stops (a unit's shared pages when its last row stops).

Between two row ends nothing the admission reads changes (a page a row allocates leaves the free pages and its
outstanding growth alike), so the replay jumps from one row end to the next and stays exact: 4,096 rows of 20k
tokens take a second.

On a mesh with data-parallel axes the call splits into `groups` row groups (`paged_continuous.run`): each runs
its own rows, pool and block of N / G requests, in lockstep with the others (an iteration refills where any
group's admission refills; the others refill nothing). Per decode step the attention reads each live row's
ceil((P + t) / page_size) pages (the Pallas kernel: rounded up to whole blocks, `read_block`); each group's chips
read their own rows' pages, and a step lasts as long as its busiest group: `kv_pages_read` sums, over decode
steps, the pages of the group that reads most.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from minpro_jax.aot.schedule import Schedule
from minpro_jax.models.paged_attention import kernel_block
from minpro_jax.runtime.sharding import DEFAULT_RULES, logical_split
from minpro_jax.sampling.continuous import refill_rule
from minpro_jax.sampling.engines.paged import row_groups
from minpro_jax.sampling.paged import pages_for, request_pages
from minpro_jax.sampling.paged_continuous import share_unit


@dataclasses.dataclass(frozen=True)
class PagedSchedule(Schedule):
  """`Schedule` of a paged sampler call (no live-length buckets: attention reads each row's own pages).

  kv_pages_read: over decode steps, the pages read by the busiest row group (pages, per layer; see module doc).
  kv_pages_read_all: over decode steps, the pages read by every live row (pages, per layer).
  peak_pages: the most pages held at once; num_pages: the pool's pages; page_size: tokens per page.
  pool_wait_steps: decode steps taken while `refill_rule` asked for a refill the pool could not admit.
  unit, groups: as `paged_schedule`; num_pages and the pages counted are one group's.
  """

  kv_pages_read: int
  kv_pages_read_all: int
  peak_pages: int
  num_pages: int
  page_size: int
  pool_wait_steps: int
  unit: int
  groups: int


def _pages_sum(lo, hi, page_size: int):
  """sum over x in (lo, hi] of ceil(x / page_size), elementwise over int arrays lo <= hi."""

  def s(n):  # sum_{x=1}^{n} ceil(x / ps)
    q, r = n // page_size, n % page_size
    return page_size * q * (q + 1) // 2 + r * (q + 1)

  return s(np.asarray(hi, np.int64)) - s(np.asarray(lo, np.int64))


def paged_schedule(
    lengths,
    *,
    rows: int,
    refill_rows: int,
    prompt_len: int,
    max_new_tokens: int,
    page_size: int,
    num_pages: int,
    unit: int = 1,
    groups: int = 1,
    read_block: int = 1,
) -> PagedSchedule:
  """The paged continuous sampler's iterations on requests of `lengths` (module docstring).

  Args:
    lengths: [N] ints in [1, max_new_tokens], tokens each response gets (stop token included), in request order.
    rows: decode rows B of one group (>= unit); refill_rows: one group's refill size (units per refill:
      max(1, refill_rows // unit), as `decode_with_refills`).
    prompt_len: P, real prompt tokens of every request (what a row stores before its response).
    max_new_tokens: R; a row is admitted for P + R - 1 tokens (its capacity).
    page_size, num_pages: one group's pool (`PagedKV.pool_sizes`).
    unit: requests per shared prefill (`paged_continuous.share_unit`).
    groups: G row groups in lockstep (`paged_continuous.run`'s split): group g runs requests [g N / G, (g + 1)
      N / G) on its own B rows and pool; an iteration refills where any group's admission refills (the others
      refill nothing), else every group decodes one step.
    read_block: pages the attention reads at a time: a row of n pages reads ceil(n / read_block) x read_block
      (the Pallas kernel loads whole blocks of `pages_per_compute_block` pages; 1: only the row's own pages).

  Raises:
    ValueError: G x unit not dividing N, unit > rows, or a request that could never fit the empty pool (it
      would wait forever, as `paged.check_request` refuses).
  """
  lengths = np.asarray(lengths, np.int64)
  n_all, b, ps, gs = int(lengths.size), int(rows), int(page_size), int(groups)
  rb = int(read_block)  # the reads count in blocks of rb pages, rb * ps tokens
  if n_all % (gs * unit) or unit > b:
    raise ValueError(f"paged_schedule: groups {gs} x unit {unit} must divide N={n_all}, unit <= rows {b}")
  n = n_all // gs  # requests per group
  m = max(1, refill_rows // unit)
  cap = prompt_len + max(max_new_tokens - 1, 0)
  need = int(request_pages(prompt_len, max(max_new_tokens - 1, 0), ps, unit))
  if need > num_pages:
    raise ValueError(f"paged_schedule: a unit needs {need} pages, the pool has {num_pages}: it would wait forever")
  shared = prompt_len // ps if unit > 1 else 0  # full prompt pages a unit stores once
  cap_pages = int(pages_for(cap, ps))
  prompt_pages = int(pages_for(prompt_len, ps))

  # rows of every group side by side: group g holds rows [g B, (g + 1) B)
  done = np.ones(gs * b, bool)
  left = np.zeros(gs * b, np.int64)  # decode steps the row still runs
  length = np.zeros(gs * b, np.int64)  # tokens the row stores
  row_unit = np.full(gs * b, -1, np.int64)
  group_of = np.arange(gs * b) // b
  unit_live: dict[int, int] = {}  # unit id (global) -> its rows still live
  used = np.zeros(gs, np.int64)  # pages with a reference, per group
  nxt = np.zeros(gs, np.int64)  # next waiting request of each group, within its block
  decode = refills = live_steps = waits = 0
  read_max = read_all = peak = 0

  def free(ended):
    for r in np.flatnonzero(ended):
      g = group_of[r]
      used[g] -= int(pages_for(length[r], ps)) - shared
      u = int(row_unit[r])
      unit_live[u] -= 1
      if unit_live[u] == 0:
        used[g] -= shared
        del unit_live[u]
    done[ended] = True
    length[ended] = 0

  while (nxt < n).any() or not done.all():
    plans = []
    for g in range(gs):
      mine = slice(g * b, (g + 1) * b)
      live = ~done[mine]
      go, count = refill_rule(int(done[mine].sum()) // unit, int(n - nxt[g]) // unit, m, minimum=min)
      outstanding = int(np.sum(cap_pages - pages_for(length[mine][live], ps)))
      fit = min((num_pages - int(used[g]) - outstanding) // need, m, int(n - nxt[g]) // unit)
      plans.append((go, min(count, fit) if go and fit > 0 else 0))
    if any(c > 0 for _, c in plans):
      for g, (_, count) in enumerate(plans):
        if not count:
          continue
        at = g * b + np.flatnonzero(done[g * b : (g + 1) * b])[: count * unit]
        reqs = g * n + nxt[g] + np.arange(count * unit)
        left[at] = lengths[reqs] - 1
        length[at] = prompt_len
        row_unit[at] = reqs // unit
        for u in range(count):
          unit_live[int((g * n + nxt[g]) // unit) + u] = unit
        used[g] += count * (shared + unit * (prompt_pages - shared))
        done[at] = False
        free(np.isin(np.arange(gs * b), at) & (left <= 0))  # a response of one token stops at its prefill
        nxt[g] += count * unit
      peak = max(peak, int(used.max()))
      refills += 1
      continue
    live = ~done
    k = int(left[live].min())  # decode steps until the next row ends (admission cannot change before)
    waits += k if any(go for go, _ in plans) else 0
    lo, hi = length[live], length[live] + k
    read_all += rb * int(_pages_sum(lo, hi, rb * ps).sum())
    if gs == 1:
      read_max += rb * int(_pages_sum(lo, hi, rb * ps).sum())
    else:  # per step, the group that reads most (steps 1..k of the jump)
      by_group = np.zeros((gs, k), np.int64)
      for g in range(gs):
        mine = group_of[live] == g
        if mine.any():
          by_group[g] = rb * pages_for(lo[mine][:, None] + np.arange(1, k + 1)[None, :], rb * ps).sum(axis=0)
      read_max += int(by_group.max(axis=0).sum())
    np.add.at(used, group_of[live], pages_for(hi, ps) - pages_for(lo, ps))
    peak = max(peak, int(used.max()))
    live_steps += int(live.sum()) * k
    length[live] = hi
    left[live] -= k
    decode += k
    free(live & (left <= 0))
  return PagedSchedule(
      decode_steps=decode,
      refills=refills,
      buckets=(),
      bucket_steps=(),
      mean_live_rows=live_steps / max(decode, 1),
      kv_pages_read=read_max,
      kv_pages_read_all=read_all,
      peak_pages=peak,
      num_pages=int(num_pages),
      page_size=ps,
      pool_wait_steps=waits,
      unit=int(unit),
      groups=gs,
  )


def page_bytes_per_device(model_config, page_size: int, mesh, rules) -> float:
  """Bytes of one page over all layers (keys and values) that one device of the sampler's layout holds and its
  attention reads: page_size x layers x 2 K x head_dim x itemsize, the KV heads split as "act_kv_heads" splits
  them where it divides K (`models.paged_attention.pallas_decode_attention`, the paged engine)."""
  cfg = model_config
  heads = logical_split(dict(mesh.shape), "act_kv_heads", rules or DEFAULT_RULES)[1] if mesh is not None else 1
  heads = heads if cfg.num_kv_heads % heads == 0 else 1
  per_token = 2 * cfg.num_kv_heads // heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
  return float(page_size * cfg.num_layers * per_token)


def analytic_kv(sched: PagedSchedule, page_bytes: float, hbm_bytes_per_s: float) -> dict:
  """The KV bytes the ragged attention reads on one device over the call, which the HLO cost cannot see (a
  Pallas custom call): the busiest row group's pages per decode step x `page_bytes` (one device's share of a
  page, `page_bytes_per_device`). Returns {"bytes_per_device", "seconds" (None without a bandwidth),
  "bytes_per_decode_step", "page_bytes_per_device", "source": "analytic"}."""
  total = float(sched.kv_pages_read) * page_bytes
  return {
      "source": "analytic: pages read per decode step (aot.paged_schedule) x page bytes per device",
      "bytes_per_device": total,
      "bytes_per_decode_step": total / max(sched.decode_steps, 1),
      "page_bytes_per_device": page_bytes,
      "seconds": total / hbm_bytes_per_s if hbm_bytes_per_s else None,
  }


def add_analytic_kv(row: dict, kv: dict, calls: float, iterations: int) -> None:
  """Adds `analytic_kv`'s seconds to a budget row in place (its totals, its time per iteration over
  `iterations` loop iterations of one call, its ratio to its bound) and records the term under "analytic_kv"."""
  row["analytic_kv"] = kv
  if kv["seconds"] is None or row.get("seconds_overlapped") is None:
    return
  extra = kv["seconds"] * calls
  row["seconds_overlapped"] += extra
  row["seconds_serial"] += extra
  row["seconds_per_iteration"] += kv["seconds"] / max(iterations, 1)
  if "seconds_per_iteration_serial" in row:
    row["seconds_per_iteration_serial"] += kv["seconds"] / max(iterations, 1)
  if row.get("bound_seconds"):
    row["ratio"] = row["seconds_overlapped"] / row["bound_seconds"]


def sampler_paged_schedule(
    sampler, lengths, num_requests: int, prompt_len: int, prompt_bucket: int, max_new_tokens: int, group_size: int
) -> PagedSchedule:
  """`paged_schedule` of a paged `Sampler`'s call on `num_requests` requests of `prompt_len` real prompt tokens
  (compiled at `prompt_bucket`), `group_size` samples per prompt, as the paged engine runs it: its
  decode rows and refill size (`rows_and_refill`) split into its `row_groups`, each group's pool
  (`PagedKV.group_pool`), the unit its host side picks and, with the Pallas kernel, its block of pages."""
  engine = sampler.engine
  rows, refill = engine.rows_and_refill(num_requests)
  g = row_groups(engine.core, rows, num_requests)[1]
  kv = engine.kv.group_pool(g)
  sizes = kv.pool_sizes(rows // g, prompt_bucket, max_new_tokens)
  unit = share_unit(kv, group_size, rows // g, [prompt_len], prompt_bucket, max_new_tokens, max(1, refill // g))
  unit = math.gcd(unit, num_requests // g)
  fields, block = kv.kernel_fields(sampler.mesh), 1
  if fields["kernel"] == "pallas":
    block = kernel_block(fields["pages_per_compute_block"], kv.page_size, sizes["max_pages_per_row"])
  return paged_schedule(
      lengths,
      rows=rows // g,
      refill_rows=max(1, refill // g),
      prompt_len=prompt_len,
      max_new_tokens=max_new_tokens,
      page_size=kv.page_size,
      num_pages=sizes["num_pages"],
      unit=unit,
      groups=g,
      read_block=block,
  )
