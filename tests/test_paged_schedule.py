"""`minpro_jax.aot.paged_schedule` against a naive loop: one iteration at a time, a reference count per page, and
the paged sampler's admission written out (`paged.can_admit` / `paged_continuous.admissible`)."""

import numpy as np
import pytest

from minpro_jax.aot.paged_schedule import paged_schedule


def _naive(lengths, *, rows, refill_rows, prompt_len, max_new_tokens, page_size, num_pages, unit, groups):
  """The paged sampler's loop on the host, one iteration at a time, each page with its own reference count."""
  ceil = lambda x: -(-x // page_size)
  n, m = len(lengths), max(1, refill_rows // unit)
  cap = prompt_len + max_new_tokens - 1
  refcount = np.zeros(num_pages, int)
  table = [[] for _ in range(rows)]
  length, left, done = [0] * rows, [0] * rows, [True] * rows
  nxt = decode = refills = waits = 0
  read_max = read_all = peak = 0

  def alloc():
    p = int(np.flatnonzero(refcount == 0)[0])
    refcount[p] += 1
    return p

  def free(r):
    for p in table[r]:
      refcount[p] -= 1
    table[r], length[r], done[r] = [], 0, True

  while nxt < n or not all(done):
    n_done = sum(done) // unit
    waiting = (n - nxt) // unit
    go = waiting > 0 and n_done >= min(m, waiting)
    count = min(n_done, m, waiting)
    outstanding = sum(ceil(cap) - ceil(length[r]) for r in range(rows) if not done[r])
    room = int(np.sum(refcount == 0)) - outstanding
    shared = prompt_len // page_size if unit > 1 else 0
    need = shared + unit * (ceil(cap) - shared)
    fit = 0
    while fit < min(m, waiting) and (fit + 1) * need <= room:
      fit += 1
    if go and fit > 0:
      free_rows = [r for r in range(rows) if done[r]]
      for u in range(min(count, fit)):
        rs = free_rows[u * unit : (u + 1) * unit]
        lead = [alloc() for _ in range(ceil(prompt_len))]
        for i, r in enumerate(rs):
          if i == 0:
            table[r] = lead
          else:  # fork: full pages shared, the partial one copied
            for p in lead[:shared]:
              refcount[p] += 1
            table[r] = lead[:shared] + [alloc() for _ in range(ceil(prompt_len) - shared)]
          length[r], left[r], done[r] = prompt_len, lengths[nxt] - 1, False
          nxt += 1
        for r in rs:
          if left[r] <= 0:
            free(r)
      peak = max(peak, int(np.sum(refcount > 0)))
      refills += 1
      continue
    waits += int(go)
    per_group = [0] * groups
    for r in range(rows):
      if done[r]:
        continue
      if length[r] % page_size == 0:
        table[r].append(alloc())
      length[r] += 1
      per_group[r // (rows // groups)] += ceil(length[r])
      left[r] -= 1
    read_all += sum(per_group)
    read_max += max(per_group)
    peak = max(peak, int(np.sum(refcount > 0)))
    decode += 1
    for r in range(rows):
      if not done[r] and left[r] <= 0:
        free(r)
  return dict(decode_steps=decode, refills=refills, pool_wait_steps=waits, kv_pages_read=read_max,
              kv_pages_read_all=read_all, peak_pages=peak)  # fmt: skip


CASES = [
    # (rows, refill_rows, prompt_len, max_new_tokens, page_size, num_pages, unit, groups): a roomy pool, a pool
    # that makes units wait, shared prompts with a partial page, two row groups, a prompt of whole pages
    (4, 2, 5, 12, 4, 64, 1, 1),
    (4, 2, 5, 12, 4, 9, 1, 1),
    (6, 3, 6, 10, 4, 20, 3, 1),
    (8, 4, 3, 9, 2, 40, 2, 2),
    (4, 4, 8, 7, 4, 12, 2, 2),
]


@pytest.mark.parametrize("case", CASES)
def test_paged_schedule_matches_naive_loop(case):
  rows, refill, p, r, ps, pages, unit, groups = case
  rng = np.random.default_rng(sum(case))
  lengths = rng.integers(1, r + 1, size=12)
  kw = dict(rows=rows, refill_rows=refill, prompt_len=p, max_new_tokens=r, page_size=ps, num_pages=pages,
            unit=unit, groups=groups)  # fmt: skip
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


def test_paged_schedule_refuses_a_unit_the_pool_cannot_hold():
  with pytest.raises(ValueError, match="wait forever"):
    paged_schedule([4], rows=2, refill_rows=1, prompt_len=4, max_new_tokens=8, page_size=4, num_pages=2)
