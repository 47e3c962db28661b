"""Paged KV (`sampling/paged.py`) and paged decode attention (`models/paged_attention.py`): attention equals dense
attention over each row's own length while rows are admitted, grow, finish and reuse pages; the pool's
bookkeeping equals a naive Python model step by step. The Pallas kernel: tests/test_paged_kernels.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.models.attention_core import masked_attention
from minpro_jax.models.paged_attention import (
    KVPages,
    live_page_buckets,
    paged_decode_attention,
    pallas_decode_attention,
)
from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
from minpro_jax.runtime.sharding import make_mesh, use_mesh
from minpro_jax.sampling import paged

K, H, HD = 2, 4, 8  # KV heads, query heads (G = 2), head_dim


def pages_of(kv, dtype=jnp.float32) -> KVPages:
  """[num_pages, 2K, ps, hd] with keys at even and values at odd heads (how the tests below draw them) -> the
  pool's `KVPages` (each [K, num_pages, ps, hd])."""
  kv = jnp.asarray(kv, dtype)
  return KVPages(*(jnp.transpose(kv[:, i::2], (1, 0, 2, 3)) for i in (0, 1)))


def dense_decode(q_rhd, hist_k, hist_v, lengths, dtype):
  """masked_attention (the KV-cache decode path) over a dense [rows, K, S, hd] cache of each row's tokens."""
  rows, s = len(hist_k), max(16, max(lengths))  # one cache size: one compiled program for every step
  k = np.zeros((rows, K, s, HD), np.float32)
  v = np.zeros_like(k)
  for r in range(rows):
    if lengths[r]:
      k[r, :, : lengths[r]] = np.stack(hist_k[r][: lengths[r]], axis=1)
      v[r, :, : lengths[r]] = np.stack(hist_v[r][: lengths[r]], axis=1)
  qg = jnp.asarray(q_rhd).reshape(rows, K, H // K, 1, HD).astype(dtype)
  mask = np.arange(s)[None, None] < np.asarray(lengths)[:, None, None]  # [rows, 1, S]
  out = masked_attention(
      qg, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(mask), keys_hd_major=False, dtype=dtype
  )
  return np.asarray(out.reshape(rows, H, HD).astype(jnp.float32))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_decode_attention_equals_dense_on_ragged_rows(dtype, tol):
  """Random page tables (a page shared by two rows, pages out of order), lengths not multiples of the page
  size, an idle row (zeros)."""
  rng = np.random.default_rng(0)
  ps, lengths = 4, [5, 1, 11, 0, 8]
  kv = rng.standard_normal((16, 2 * K, ps, HD)).astype(np.float32)
  table = np.array([[3, 9, 0], [7, 0, 0], [12, 3, 5], [0, 0, 0], [2, 14, 0]], np.int32)  # page 3 in rows 0 and 2
  hist_k = [[kv[table[r, i // ps], 0::2, i % ps] for i in range(n)] for r, n in enumerate(lengths)]
  hist_v = [[kv[table[r, i // ps], 1::2, i % ps] for i in range(n)] for r, n in enumerate(lengths)]
  q = rng.standard_normal((5, H, HD)).astype(np.float32)
  got = paged_decode_attention(
      jnp.asarray(q, dtype), pages_of(kv, dtype), jnp.asarray(lengths, jnp.int32), jnp.asarray(table)
  )
  assert got.dtype == dtype and got.shape == (5, H, HD)
  got = np.asarray(got.astype(jnp.float32))
  want = dense_decode(q, hist_k, hist_v, lengths, dtype)
  live = np.array(lengths) > 0
  np.testing.assert_allclose(got[live], want[live], atol=tol, rtol=tol)
  assert np.all(got[~live] == 0)


def test_live_page_buckets():
  assert live_page_buckets(9, 16) == (2, 4, 8, 9)
  assert live_page_buckets(8, 16) == (2, 4, 8)
  assert live_page_buckets(2, 16) == (2,)
  assert live_page_buckets(1, 64) == (1,)
  assert live_page_buckets(5, 4, min_slots=4) == (1, 2, 4, 5)


def test_decode_attention_reads_only_the_live_pages():
  """With buckets (1, 2, 4) over a table of 4 pages, a call whose longest row needs 1, 2 or 3 pages gathers only
  the leading 1, 2 or 4 (the table's entries past them point at a page of NaNs: reading it would show; the
  masked entries inside the bucket at a page of finite garbage) and equals dense attention over each row's own
  tokens; one jitted program serves every bucket."""
  rng = np.random.default_rng(5)
  ps, maxp = 4, 4
  kv = rng.standard_normal((12, 2 * K, ps, HD)).astype(np.float32)
  kv[10], kv[11] = 1e3, np.nan
  pages = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32)
  q = rng.standard_normal((3, H, HD)).astype(np.float32)
  decode = jax.jit(paged_decode_attention, static_argnames="buckets")
  for lengths, bucket in (([3, 1, 0], 1), ([2, 7, 4], 2), ([9, 5, 12], 4)):  # longest row: 1, 2, 3 pages
    table = np.full((3, maxp), 11, np.int32)
    table[:, :bucket] = 10
    for r, n in enumerate(lengths):
      table[r, : -(-n // ps)] = pages[r, : -(-n // ps)]
    hist_k = [[kv[table[r, i // ps], 0::2, i % ps] for i in range(n)] for r, n in enumerate(lengths)]
    hist_v = [[kv[table[r, i // ps], 1::2, i % ps] for i in range(n)] for r, n in enumerate(lengths)]
    got = decode(jnp.asarray(q), pages_of(kv), jnp.asarray(lengths, jnp.int32), jnp.asarray(table), buckets=(1, 2, 4))
    live = np.array(lengths) > 0
    want = dense_decode(q, hist_k, hist_v, lengths, jnp.float32)
    np.testing.assert_allclose(np.asarray(got)[live], want[live], atol=2e-6, rtol=2e-6)
    assert np.all(np.asarray(got)[~live] == 0)
  assert decode._cache_size() == 1
  table = jnp.zeros((3, maxp), jnp.int32)
  with pytest.raises(ValueError, match="buckets"):
    paged_decode_attention(jnp.asarray(q), pages_of(kv), jnp.ones((3,), jnp.int32), table, buckets=(1, 2))


def _kernel_as_reference(calls=None):
  """A stand-in with the signature of jax's Pallas `paged_attention` (pre-scaled q, k / v pages, lengths >= 1, a
  table padded to whole blocks): the plain path at scale 1, recording the shapes it is given."""

  def kernel(q, k_pages, v_pages, lengths, table, *, pages_per_compute_block, megacore_mode):
    assert table.shape[1] % pages_per_compute_block == 0
    if not isinstance(lengths, jax.core.Tracer):  # the kernel needs every row to hold a token
      assert int(jnp.min(lengths)) >= 1
    if calls is not None:
      calls.append((q.shape, k_pages.shape, table.shape, megacore_mode))
    return paged_decode_attention(q, KVPages(k_pages, v_pages), lengths, table, sm_scale=1.0)

  return kernel


def test_pallas_wrapper_passes_the_kernel_decode_arguments():
  """`pallas_decode_attention` with a stand-in for the kernel equals the plain path: q scaled by 1 / sqrt(hd)
  before the call, idle rows zeroed, a table of 3 pages padded to blocks of 2; a soft cap is refused."""
  rng = np.random.default_rng(2)
  kv = pages_of(rng.standard_normal((12, 2 * K, 3, HD)))
  lengths = jnp.array([4, 0, 7], jnp.int32)
  table = jnp.asarray(rng.permutation(12)[:9].reshape(3, 3), jnp.int32)
  q = jnp.asarray(rng.standard_normal((3, H, HD)), jnp.float32)
  want = paged_decode_attention(q, kv, lengths, table)
  calls = []
  got = pallas_decode_attention(q, kv, lengths, table, pages_per_compute_block=2, kernel=_kernel_as_reference(calls))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
  assert np.all(np.asarray(got)[1] == 0) and calls == [((3, H, HD), (K, 12, 3, HD), (3, 4), None)]
  with pytest.raises(ValueError, match="soft cap"):
    pallas_decode_attention(q, kv, lengths, table, soft_cap=3.0, kernel=_kernel_as_reference())


def test_pallas_wrapper_runs_per_device_under_a_mesh():
  """Under the sampler's mesh (data=4 x tensor=2 on cpu:8, `INFERENCE_RULES`) `pallas_decode_attention` runs the
  kernel in a shard_map, rows over data and KV heads over tensor, each device its KV heads' pages in the pool's
  own layout (no relayout): with a stand-in for the kernel it equals the plain path on the whole arrays; with
  `megacore` each device's 2 rows split over the cores ("batch")."""
  rng = np.random.default_rng(3)
  kv = pages_of(rng.standard_normal((16, 2 * K, 3, HD)))
  lengths = jnp.array([4, 0, 7, 9, 1, 3, 8, 2], jnp.int32)
  table = jnp.asarray(rng.integers(0, 16, (8, 3)), jnp.int32)  # rows may share pages: attention only reads them
  q = jnp.asarray(rng.standard_normal((8, H, HD)), jnp.float32)
  want = paged_decode_attention(q, kv, lengths, table)
  calls = []
  mesh = make_mesh({"data": 4, "tensor": 2}, devices=jax.devices()[:8])
  fn = functools.partial(pallas_decode_attention, megacore=True, kernel=_kernel_as_reference(calls))
  with use_mesh(mesh, INFERENCE_RULES):
    got = jax.jit(fn)(q, kv, lengths, table)
  assert calls == [((2, H // 2, HD), (1, 16, 3, HD), (2, 3), "batch")]  # one device's rows and head, every page
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_bad_shapes_raise():
  q, kv = jnp.zeros((2, H, HD)), pages_of(jnp.zeros((4, 2 * K, 2, HD)))
  lengths, table = jnp.ones((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32)
  with pytest.raises(ValueError, match="K dividing the 4 query heads"):
    paged_decode_attention(q, KVPages(jnp.zeros((3, 4, 2, HD)), jnp.zeros((3, 4, 2, HD))), lengths, table)
  with pytest.raises(ValueError, match="both"):
    paged_decode_attention(q, KVPages(kv.k, kv.v[:, :3]), lengths, table)
  with pytest.raises(ValueError, match="int32"):
    paged_decode_attention(q, kv, lengths.astype(jnp.float32), table)
  with pytest.raises(ValueError, match="for 2 queries"):
    paged_decode_attention(q, kv, jnp.ones((3,), jnp.int32), jnp.zeros((3, 2), jnp.int32))
  with pytest.raises(ValueError, match="soft_cap"):
    paged_decode_attention(q, kv, lengths, table, soft_cap=0.0)
  with pytest.raises(ValueError, match="positive int"):
    paged.init_pool(num_layers=1, num_pages=0, page_size=4, num_kv_heads=K, head_dim=HD, rows=2, max_pages_per_row=2)


_append = jax.jit(paged.append_token)
_admit = jax.jit(paged.admit)
_fork = jax.jit(paged.fork_rows)
_free = jax.jit(paged.free_rows)
_decode = jax.jit(paged_decode_attention)
_can_admit = jax.jit(paged.can_admit, static_argnums=3)


def test_schedule_rows_admitted_and_finishing_at_different_steps():
  """Requests wait for pages (FIFO), are prefilled into fresh pages, decode one token per step and stop at
  different steps; freed pages are reused by later requests. At every step and in both layers, paged
  attention equals dense attention over each row's own tokens. Page size 3 divides few of the lengths."""
  rng = np.random.default_rng(3)
  layers, rows, ps, t_bucket = 2, 3, 3, 8
  pool = paged.init_pool(
      num_layers=layers, num_pages=7, page_size=ps, num_kv_heads=K, head_dim=HD, rows=rows, max_pages_per_row=5
  )
  queue = [(int(rng.integers(2, 8)), int(rng.integers(2, 8))) for _ in range(9)]  # (prompt, new tokens)
  hist = [None] * rows  # per row: (k list per layer, v list per layer), each token [K, hd]
  todo, req_of = [0] * rows, [-1] * rows
  pages_of_req, waits, step = {}, 0, 0
  while queue or any(r >= 0 for r in req_of):
    while queue and -1 in req_of:
      p, new = queue[0]
      paged.check_request(pool, p, new)
      if not bool(_can_admit(pool, p, new, 1)):
        waits += 1
        break
      queue.pop(0)
      r = req_of.index(-1)
      k = rng.standard_normal((layers, 1, t_bucket, K, HD)).astype(np.float32)
      v = rng.standard_normal((layers, 1, t_bucket, K, HD)).astype(np.float32)
      pool = _admit(pool, jnp.array([r]), jnp.array([p]), jnp.array([p + new]), jnp.asarray(k), jnp.asarray(v))
      hist[r] = ([list(k[i, 0, :p]) for i in range(layers)], [list(v[i, 0, :p]) for i in range(layers)])
      req_of[r], todo[r] = step, new
    active = np.array([req_of[r] >= 0 and todo[r] > 0 for r in range(rows)])
    k = rng.standard_normal((layers, rows, K, HD)).astype(np.float32)
    v = rng.standard_normal((layers, rows, K, HD)).astype(np.float32)
    pool = _append(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(active))
    lengths = [0] * rows
    for r in np.flatnonzero(active):
      for i in range(layers):
        hist[r][0][i].append(k[i, r])
        hist[r][1][i].append(v[i, r])
      todo[r] -= 1
      lengths[r] = len(hist[r][0][0])
      n_pages = paged.pages_for(lengths[r], ps)
      pages_of_req.setdefault(req_of[r], set()).update(np.asarray(pool.page_table[r, :n_pages]).tolist())
    np.testing.assert_array_equal(np.asarray(pool.lengths)[active], np.array(lengths)[active])
    q = rng.standard_normal((rows, H, HD)).astype(np.float32)
    for i in range(layers):
      got = np.asarray(_decode(jnp.asarray(q), pool.kv_pages[i], jnp.asarray(lengths, jnp.int32), pool.page_table))
      hk = [hist[r][0][i] if active[r] else [] for r in range(rows)]
      hv = [hist[r][1][i] if active[r] else [] for r in range(rows)]
      want = dense_decode(q, hk, hv, lengths, jnp.float32)
      np.testing.assert_allclose(got[active], want[active], atol=2e-6, rtol=2e-6)
    done = np.array([req_of[r] >= 0 and (todo[r] == 0 or rng.random() < 0.15) for r in range(rows)])
    pool = _free(pool, jnp.asarray(done))
    for r in np.flatnonzero(done):
      req_of[r], todo[r] = -1, 0
    step += 1
  assert int(pool.errors) == 0
  assert waits > 0, "the pool never filled: the test did not exercise admission waiting"
  owners = {}
  for req, pages_used in pages_of_req.items():
    for p in pages_used:
      owners.setdefault(p, set()).add(req)
  assert max(len(o) for o in owners.values()) > 1, "no page was reused after a free"
  np.testing.assert_array_equal(np.asarray(pool.refcount), 0)  # every page back in the pool


class NaivePool:
  """The pool's bookkeeping in plain Python: lowest free ids first, requests in order."""

  def __init__(self, num_pages, ps, rows, maxp):
    self.n, self.ps, self.maxp = num_pages, ps, maxp
    self.ref, self.table = [0] * num_pages, [[] for _ in range(rows)]
    self.len, self.cap = [0] * rows, [0] * rows

  def take(self):
    p = next(i for i in range(self.n) if self.ref[i] == 0)
    self.ref[p] = 1
    return p

  def can_admit(self, p, new, g=1):
    ceil = lambda x: -(-x // self.ps)  # noqa: E731
    full = p // self.ps if g > 1 else 0
    need = full + g * (ceil(p + new) - full)
    outstanding = sum(max(ceil(c) - ceil(n), 0) for c, n in zip(self.cap, self.len))
    free = sum(r == 0 for r in self.ref)
    return need + outstanding <= free and sum(c == 0 for c in self.cap) >= g and ceil(p + new) <= self.maxp

  def admit(self, r, p, cap):
    self.table[r] = [self.take() for _ in range(-(-p // self.ps))]
    self.len[r], self.cap[r] = p, cap

  def fork(self, src, dst, cap):
    full = self.len[src] // self.ps
    self.table[dst] = self.table[src][:full]
    for q in self.table[dst]:
      self.ref[q] += 1
    if self.len[src] % self.ps:
      self.table[dst].append(self.take())
    self.len[dst], self.cap[dst] = self.len[src], cap

  def append(self, active):
    for r in np.flatnonzero(active):
      if self.len[r] % self.ps == 0:
        self.table[r].append(self.take())
      self.len[r] += 1

  def free(self, done):
    for r in np.flatnonzero(done):
      for q in self.table[r]:
        self.ref[q] -= 1
      self.table[r], self.len[r], self.cap[r] = [], 0, 0


def assert_same(pool, model):
  np.testing.assert_array_equal(np.asarray(pool.refcount), model.ref)
  np.testing.assert_array_equal(np.asarray(pool.lengths), model.len)
  np.testing.assert_array_equal(np.asarray(pool.capacity), model.cap)
  table = np.asarray(pool.page_table)
  counts = np.zeros(model.n, int)
  for r, pages in enumerate(model.table):
    assert table[r, : len(pages)].tolist() == pages and not table[r, len(pages) :].any()
    counts[pages] += 1
  np.testing.assert_array_equal(np.asarray(pool.refcount), counts)  # a page's count is its owners
  assert int(pool.errors) == 0


def test_pool_bookkeeping_equals_a_naive_model():
  """Random admissions (only when `can_admit`), forks of live rows, decode steps of random row subsets and
  frees, checked after every operation: refcounts, page tables, lengths, capacities, admission decisions."""
  rng = np.random.default_rng(4)
  ps, rows, maxp, num_pages, t_bucket = 4, 5, 4, 12, 9
  pool = paged.init_pool(
      num_layers=1, num_pages=num_pages, page_size=ps, num_kv_heads=1, head_dim=2, rows=rows, max_pages_per_row=maxp
  )
  model = NaivePool(num_pages, ps, rows, maxp)
  kv0 = jnp.zeros((1, 2, t_bucket, 1, 2))
  seen = {"admit": 0, "refuse": 0, "fork": 0, "append": 0, "free": 0}
  for _ in range(80):
    op = rng.choice(["admit", "fork", "append", "free"])
    free_rows = [r for r in range(rows) if model.cap[r] == 0]
    live = [r for r in range(rows) if model.cap[r] > 0]
    if op == "admit" and free_rows:
      p, new = int(rng.integers(1, t_bucket + 1)), int(rng.integers(0, 8))
      for g in (1, 2, 3):
        assert bool(_can_admit(pool, p, new, g)) == model.can_admit(p, new, g), (p, new, g)
      if model.can_admit(p, new):
        pool = _admit(pool, jnp.array([free_rows[0], -1]), jnp.array([p, 1]), jnp.array([p + new, 1]), kv0, kv0)
        model.admit(free_rows[0], p, p + new)
        seen["admit"] += 1
      else:
        seen["refuse"] += 1
    elif op == "fork" and free_rows and live:
      src = int(rng.choice(live))
      cap = model.len[src] + int(rng.integers(0, 4))
      if model.can_admit(model.len[src], cap - model.len[src]) and -(-cap // ps) <= maxp:
        pool = _fork(pool, jnp.array([src, 0]), jnp.array([free_rows[0], rows]), jnp.array([cap, 0]))
        model.fork(src, free_rows[0], cap)
        seen["fork"] += 1
    elif op == "append":
      active = np.array([model.cap[r] > model.len[r] and rng.random() < 0.7 for r in range(rows)])
      pool = _append(pool, jnp.zeros((1, rows, 1, 2)), jnp.zeros((1, rows, 1, 2)), jnp.asarray(active))
      model.append(active)
      seen["append"] += 1
    elif op == "free" and live:
      done = np.array([r in live and rng.random() < 0.4 for r in range(rows)])
      pool = _free(pool, jnp.asarray(done))
      model.free(done)
      seen["free"] += 1
    assert_same(pool, model)
  assert min(seen.values()) > 0, seen


def test_shared_prompt_pages_exist_once_and_free_at_zero():
  """A 10-token prompt (page size 4) forked to 2 more rows: its 2 full pages are shared (count 3), each row
  owns a copy of the partial page; the rows attend alike, diverge after their own tokens, and a shared page
  returns to the pool only when its last row is freed."""
  rng = np.random.default_rng(5)
  pool = paged.init_pool(
      num_layers=1, num_pages=8, page_size=4, num_kv_heads=K, head_dim=HD, rows=3, max_pages_per_row=4
  )
  k = jnp.asarray(rng.standard_normal((1, 1, 12, K, HD)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, 1, 12, K, HD)), jnp.float32)
  assert bool(paged.can_admit(pool, 10, 4, group_size=3))  # 2 shared + 3 x 2 own pages = 8
  assert paged.request_pages(10, 4, 4, group_size=3) == 8
  pool = _admit(pool, jnp.array([0]), jnp.array([10]), jnp.array([14]), k, v)
  pool = _fork(pool, jnp.array([0, 0]), jnp.array([1, 2]), jnp.array([14, 14]))
  table = np.asarray(pool.page_table)
  assert (table[:, :2] == table[0, :2]).all() and len(set(table[:, 2])) == 3
  assert len(set(table[:, :3].ravel())) == 5  # the prompt's pages: 2 shared + 3 partial copies
  np.testing.assert_array_equal(np.asarray(pool.refcount)[table[0, :2]], 3)
  q = jnp.asarray(np.repeat(rng.standard_normal((1, H, HD)), 3, axis=0), jnp.float32)
  out = np.asarray(_decode(q, pool.kv_pages[0], pool.lengths, pool.page_table))
  np.testing.assert_array_equal(out[1], out[0])
  np.testing.assert_array_equal(out[2], out[0])
  kn = jnp.asarray(rng.standard_normal((1, 3, K, HD)), jnp.float32)
  pool = _append(pool, kn, kn, jnp.array([True, True, True]))  # different 11th tokens
  out = np.asarray(_decode(q, pool.kv_pages[0], pool.lengths, pool.page_table))
  assert not np.allclose(out[1], out[0]) and not np.allclose(out[2], out[0])
  shared = table[0, :2]
  pool = _free(pool, jnp.array([True, False, False]))
  np.testing.assert_array_equal(np.asarray(pool.refcount)[shared], 2)
  pool = _free(pool, jnp.array([False, True, True]))
  np.testing.assert_array_equal(np.asarray(pool.refcount), 0)
  assert int(pool.errors) == 0


def test_full_pool_makes_admission_wait_and_broken_contracts_are_flagged():
  ps = 4
  pool = paged.init_pool(
      num_layers=1, num_pages=6, page_size=ps, num_kv_heads=1, head_dim=2, rows=3, max_pages_per_row=4
  )
  kv = jnp.zeros((1, 2, 8, 1, 2))
  pool = _admit(pool, jnp.array([0, 1]), jnp.array([5, 5]), jnp.array([12, 12]), kv, kv)  # 2 pages each, 3 at most
  assert int(paged.free_pages(pool)) == 2 and int(paged.outstanding_pages(pool)) == 2
  assert not bool(paged.can_admit(pool, 1, 0))  # 2 free pages, both reserved for rows 0 and 1: wait
  step = jnp.zeros((1, 3, 1, 2))
  for _ in range(7):  # both rows grow to their capacity: the reserved pages were there
    pool = _append(pool, step, step, jnp.array([True, True, False]))
  assert int(pool.errors) == 0 and np.asarray(pool.lengths).tolist() == [12, 12, 0]
  assert not bool(paged.can_admit(pool, 1, 0))  # no page free at all
  pool = _free(pool, jnp.array([True, False, False]))
  assert bool(paged.can_admit(pool, 5, 7)) and not bool(paged.can_admit(pool, 5, 8))
  with pytest.raises(ValueError, match="max_pages_per_row=4"):
    paged.check_request(pool, 10, 7)
  with pytest.raises(ValueError, match="raise num_pages"):
    paged.check_request(pool, 8, 8, group_size=3)
  bad = _append(pool, step, step, jnp.array([False, True, False]))  # row 1 is at its capacity
  with pytest.raises(RuntimeError, match="past its admitted capacity"):
    paged.raise_on_errors(bad.errors)
  np.testing.assert_array_equal(np.asarray(bad.lengths), np.asarray(pool.lengths))  # nothing written
  bad = _admit(pool, jnp.array([1, 2]), jnp.array([5, 5]), jnp.array([8, 8]), kv, kv)  # row 1 is busy
  with pytest.raises(RuntimeError, match="not freed"):
    paged.raise_on_errors(bad.errors)
  bad = _admit(pool, jnp.array([0, 2]), jnp.array([8, 8]), jnp.array([8, 8]), kv, kv)  # 4 pages, 3 free
  with pytest.raises(RuntimeError, match="no free page"):
    paged.raise_on_errors(bad.errors)


def test_the_pool_layout_is_the_kernels_k_and_v_pages():
  """The layout the TPU path relies on (docs/sampler.md): a prompt's token t of KV head h lands at
  kv_pages[l].k[h, page_table[row, t // ps], t % ps] (its value in .v at the same index), for `admit`,
  `append_token` and the partial page `fork_rows` copies: jax's Pallas `paged_attention` reads exactly these
  [K, num_pages, ps, hd] arrays as its k_pages / v_pages."""
  rng = np.random.default_rng(9)
  ps, layers = 4, 2
  pool = paged.init_pool(
      num_layers=layers, num_pages=8, page_size=ps, num_kv_heads=K, head_dim=HD, rows=2, max_pages_per_row=3
  )
  assert pool.kv_pages[0].k.shape == pool.kv_pages[0].v.shape == (K, 8, ps, HD) and pool.page_size == ps
  k = rng.standard_normal((layers, 1, 6, K, HD)).astype(np.float32)
  v = rng.standard_normal((layers, 1, 6, K, HD)).astype(np.float32)
  pool = _admit(pool, jnp.array([0]), jnp.array([6]), jnp.array([8]), jnp.asarray(k), jnp.asarray(v))
  kn = rng.standard_normal((layers, 2, K, HD)).astype(np.float32)
  vn = rng.standard_normal((layers, 2, K, HD)).astype(np.float32)
  pool = _append(pool, jnp.asarray(kn), jnp.asarray(vn), jnp.array([True, False]))  # token 6 of row 0
  pool = _fork(pool, jnp.array([0]), jnp.array([1]), jnp.array([8]))  # row 1: page 0 shared, page 1 copied
  assert int(pool.errors) == 0
  keys = np.concatenate([k[:, 0], kn[:, :1]], axis=1)  # [layers, 7, K, hd] in token order
  values = np.concatenate([v[:, 0], vn[:, :1]], axis=1)
  table = np.asarray(pool.page_table)
  assert table[1, 0] == table[0, 0] and table[1, 1] != table[0, 1]
  for i in range(layers):
    kp, vp = (np.asarray(a) for a in pool.kv_pages[i])
    for row in (0, 1):
      for t in range(7):
        page, slot = table[row, t // ps], t % ps
        for h in range(K):
          np.testing.assert_array_equal(kp[h, page, slot], keys[i, t, h])
          np.testing.assert_array_equal(vp[h, page, slot], values[i, t, h])
