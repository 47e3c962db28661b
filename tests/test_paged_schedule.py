"""`minpro_jax.aot.paged_schedule` against a naive loop: one iteration at a time, a reference count per page, and
the paged sampler's admission written out (`paged.can_admit` / `paged_continuous.admissible`)."""

import numpy as np
import pytest

from minpro_jax.aot.paged_schedule import paged_schedule


def _naive(lengths, *, rows, refill_rows, prompt_len, max_new_tokens, page_size, num_pages, unit, groups, read_block=1):
  """The paged sampler's loop on the host, one iteration at a time: `groups` row groups in lockstep, each with its
  rows, its block of requests and its pool, each page with its own reference count; a row's attention reads its
  pages in whole blocks of `read_block`."""
  ceil = lambda x: -(-x // page_size)
  blocks = lambda pages: -(-pages // read_block) * read_block
  n, m = len(lengths) // groups, max(1, refill_rows // unit)
  cap = prompt_len + max_new_tokens - 1
  shared = prompt_len // page_size if unit > 1 else 0
  need = shared + unit * (ceil(cap) - shared)
  refcount = [np.zeros(num_pages, int) for _ in range(groups)]
  table = [[[] for _ in range(rows)] for _ in range(groups)]
  length = [[0] * rows for _ in range(groups)]
  left = [[0] * rows for _ in range(groups)]
  done = [[True] * rows for _ in range(groups)]
  nxt = [0] * groups
  decode = refills = waits = read_max = read_all = peak = 0

  def alloc(g):
    p = int(np.flatnonzero(refcount[g] == 0)[0])
    refcount[g][p] += 1
    return p

  def free(g, r):
    for p in table[g][r]:
      refcount[g][p] -= 1
    table[g][r], length[g][r], done[g][r] = [], 0, True

  while any(x < n for x in nxt) or not all(all(d) for d in done):
    plans = []
    for g in range(groups):
      n_done, waiting = sum(done[g]) // unit, (n - nxt[g]) // unit
      go = waiting > 0 and n_done >= min(m, waiting)
      count = min(n_done, m, waiting)
      outstanding = sum(ceil(cap) - ceil(length[g][r]) for r in range(rows) if not done[g][r])
      room = int(np.sum(refcount[g] == 0)) - outstanding
      fit = 0
      while fit < min(m, waiting) and (fit + 1) * need <= room:
        fit += 1
      plans.append((go, min(count, fit) if go and fit > 0 else 0))
    if any(c for _, c in plans):
      for g, (_, count) in enumerate(plans):
        free_rows = [r for r in range(rows) if done[g][r]]
        for u in range(count):
          rs = free_rows[u * unit : (u + 1) * unit]
          lead = [alloc(g) for _ in range(ceil(prompt_len))]
          for i, r in enumerate(rs):
            if i == 0:
              table[g][r] = lead
            else:  # fork: full pages shared, the partial one copied
              for p in lead[:shared]:
                refcount[g][p] += 1
              table[g][r] = lead[:shared] + [alloc(g) for _ in range(ceil(prompt_len) - shared)]
            length[g][r], left[g][r], done[g][r] = prompt_len, lengths[g * n + nxt[g]] - 1, False
            nxt[g] += 1
          for r in rs:
            if left[g][r] <= 0:
              free(g, r)
      peak = max(peak, max(int(np.sum(rc > 0)) for rc in refcount))
      refills += 1
      continue
    waits += int(any(go for go, _ in plans))
    per_group = [0] * groups
    for g in range(groups):
      for r in range(rows):
        if done[g][r]:
          continue
        if length[g][r] % page_size == 0:
          table[g][r].append(alloc(g))
        length[g][r] += 1
        per_group[g] += blocks(ceil(length[g][r]))
        left[g][r] -= 1
    read_all += sum(per_group)
    read_max += max(per_group)
    peak = max(peak, max(int(np.sum(rc > 0)) for rc in refcount))
    decode += 1
    for g in range(groups):
      for r in range(rows):
        if not done[g][r] and left[g][r] <= 0:
          free(g, r)
  return dict(decode_steps=decode, refills=refills, pool_wait_steps=waits, kv_pages_read=read_max,
              kv_pages_read_all=read_all, peak_pages=peak)  # fmt: skip


CASES = [
    # (rows, refill_rows, prompt_len, max_new_tokens, page_size, num_pages, unit, groups), rows, refill rows and
    # pages of one group: a roomy pool, a pool that makes units wait, shared prompts with a partial page, two row
    # groups in lockstep, two groups that wait for pages with a prompt of whole pages
    (4, 2, 5, 12, 4, 64, 1, 1),
    (4, 2, 5, 12, 4, 9, 1, 1),
    (6, 3, 6, 10, 4, 20, 3, 1),
    (4, 2, 3, 9, 2, 20, 2, 2),
    (2, 2, 8, 7, 4, 7, 2, 2),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("read_block", [1, 3])
def test_paged_schedule_matches_naive_loop(case, read_block):
  rows, refill, p, r, ps, pages, unit, groups = case
  rng = np.random.default_rng(sum(case))
  lengths = rng.integers(1, r + 1, size=12)
  kw = dict(rows=rows, refill_rows=refill, prompt_len=p, max_new_tokens=r, page_size=ps, num_pages=pages,
            unit=unit, groups=groups, read_block=read_block)  # fmt: skip
  got = paged_schedule(lengths, **kw)
  want = _naive(list(lengths), **kw)
  assert {k: getattr(got, k) for k in want} == want
  assert got.iterations == want["decode_steps"] + want["refills"]


def test_paged_schedule_by_hand():
  # two rows, page size 2, prompt of 3 tokens, responses of 3 and 2 tokens, both admitted by one refill: decode
  # step 1 reads ceil(4/2) + ceil(4/2) = 4 pages, step 2 the first row alone ceil(5/2) = 3
  s = paged_schedule([3, 2], rows=2, refill_rows=2, prompt_len=3, max_new_tokens=3, page_size=2, num_pages=8)
  assert (s.refills, s.decode_steps, s.kv_pages_read_all, s.peak_pages) == (1, 2, 7, 4)
  # a pool of 3 pages holds one row at full length (3 + 2 tokens = 3 pages): the second waits for the first
  s = paged_schedule([3, 2], rows=2, refill_rows=2, prompt_len=3, max_new_tokens=3, page_size=2, num_pages=3)
  assert (s.refills, s.decode_steps, s.pool_wait_steps, s.kv_pages_read_all) == (2, 3, 2, 2 + 3 + 2)
  # the Pallas kernel's blocks of 2 pages: step 1 reads 2 + 2, step 2 ceil(3 / 2) x 2 = 4 pages
  s = paged_schedule([3, 2], rows=2, refill_rows=2, prompt_len=3, max_new_tokens=3, page_size=2, num_pages=8,
                     read_block=2)  # fmt: skip
  assert (s.decode_steps, s.kv_pages_read_all) == (2, 4 + 4)


def test_paged_schedule_refuses_a_unit_the_pool_cannot_hold():
  with pytest.raises(ValueError, match="wait forever"):
    paged_schedule([4], rows=2, refill_rows=1, prompt_len=4, max_new_tokens=8, page_size=4, num_pages=2)
