"""The continuous sampler on a paged KV cache (`Sampler(engine=engines.Paged(kv=PagedKV(...)))`) against the static sampler:
the same responses token for token, with a pool so small that requests wait for pages; shared prompts (one
prefill per group, full pages stored once) against separate prefills."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.transformer import keys_head_dim_major
from minpro_jax.sampling import PagedKV, Sampler, SamplingParams, engines, paged
from minpro_jax.sampling import paged_continuous as pc
from minpro_jax.sampling.continuous import init_state
from minpro_jax.sampling.engines import paged as paged_engine

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3], [71, 72, 73, 74, 75], [12], [8, 9, 10]]
STOPS = tuple(range(3, CFG.vocab_size, 9))  # about 1 id in 9 stops a row: ragged lengths
SP = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def state():
  return nnx.split(init_model(CFG, seed=3))[1]


def _generate_both(pag, static, state):
  """The paged and the static sampler's responses to the 7 prompts x 2 samples at one seed."""
  kw = dict(seed=11, group_size=2, group_ids=[40, 41, 42, 43, 44, 45, 46], policy_version=5)
  return pag.generate(state, PROMPTS, SP, **kw), static.generate(state, PROMPTS, SP, **kw)


def _assert_equal_samples(got, want):
  """Token for token equal; behavior log-probs to 1e-5."""
  for f in ("response_tokens", "response_mask", "lengths", "finish_reason", "group_ids", "sample_index"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)


def test_paged_sampler_equals_static_with_a_pool_of_one_long_row(state):
  """9 pages of 4 tokens hold one request of the longest prompt (11 + 23 tokens) and no second one, so on 4
  decode rows most of the 14 requests wait for pages; pages are freed and reused as rows stop."""
  static = Sampler(CFG, prompt_buckets=(8, 16), engine="static")
  pag = Sampler(
      CFG,
      prompt_buckets=(8, 16),
      engine=engines.Paged(decode_rows=4, refill_rows=2, kv=PagedKV(page_size=4, num_pages=9)),
  )
  got, want = _generate_both(pag, static, state)
  _assert_equal_samples(got, want)
  np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-5, rtol=0)
  assert (got.finish_reason == "stop").any() and len(set(got.lengths.tolist())) > 3  # ragged


def test_paged_options_are_checked(state):
  with pytest.raises(ValueError, match=r"Paged\(kv=16\): must be a PagedKV"):
    engines.Paged(kv=16)
  with pytest.raises(ValueError, match=r"refill_rows=0: must be an int >= 1"):
    engines.Paged(refill_rows=0)
  with pytest.raises(
      ValueError, match=r"engine='pagd'; choose one of \['continuous', 'host_refill', 'paged', 'static'\]"
  ):
    Sampler(CFG, engine="pagd")
  with pytest.raises(ValueError, match="page_size"):
    PagedKV(page_size=0)
  tiny_pool = Sampler(
      CFG, prompt_buckets=(8, 16), engine=engines.Paged(decode_rows=4, kv=PagedKV(page_size=4, num_pages=8))
  )
  with pytest.raises(ValueError, match="needs 9 pages"):  # 11 + 23 tokens: it would wait forever
    tiny_pool.generate(state, PROMPTS, SP, seed=11)


def test_paged_moe_sampler_records_the_routes_of_the_dense_one():
  """MoE with router-route recording: the paged sampler's tokens, log-probs and routes equal the dense
  continuous sampler's (a pool of 10 pages of 4 tokens, so requests wait)."""
  cfg = get_preset("tiny-moe")
  state = nnx.split(init_model(cfg, seed=3))[1]
  sp = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(range(3, cfg.vocab_size, 9)))
  kw = dict(prompt_buckets=(8, 16), record_routes=True)
  want = Sampler(cfg, **kw, engine=engines.Continuous(decode_rows=4, refill_rows=2)).generate(
      state, PROMPTS[:3], sp, seed=11, group_size=2
  )
  paged = engines.Paged(decode_rows=4, refill_rows=2, kv=PagedKV(page_size=4, num_pages=10))
  got = Sampler(cfg, **kw, engine=paged).generate(state, PROMPTS[:3], sp, seed=11, group_size=2)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(want.routes))
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)


def test_the_share_unit_is_the_largest_group_divisor_that_fits_the_pool():
  """Requests per shared prefill: the longest prompt (11 tokens, 23 more) in pages of 4 needs 2 shared prompt
  pages + 7 per sample, so a unit of 4 needs 30 pages, of 2 needs 16, of 1 needs 9."""
  unit = lambda num_pages, g=4, rows=8, share=True: pc.share_unit(
      PagedKV(page_size=4, num_pages=num_pages, share_prompts=share), g, rows, [3, 11], 16, 24
  )
  assert (unit(30), unit(29), unit(16), unit(15), unit(9)) == (4, 2, 2, 1, 1)
  assert unit(30, rows=2) == 2 and unit(100, g=6, rows=4) == 3 and unit(100, g=5, rows=4) == 1
  assert unit(30, share=False) == 1 and unit(30, g=1) == 1
  kv = PagedKV(page_size=4, num_pages=100)
  assert [pc.share_unit(kv, 4, 8, [3, 11], 16, 24, refill_rows=m) for m in (1, 2, 3, 8)] == [1, 2, 2, 4]


def test_shared_prompts_give_the_responses_of_separate_prefills(state):
  """Group size 4 on 8 decode rows: with the prompts shared (one prefill per group, `fork_rows`) the responses
  equal those of separate prefills (share_prompts=False) and the static sampler's, token for token. The pool of 30
  pages holds one group of the longest prompt (2 shared + 4 x 7 pages) and never two groups of 11 + 23 or
  5 + 23 tokens, so groups wait for pages."""
  prompts, g = [PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[0]], 4
  assert pc.share_unit(PagedKV(page_size=4, num_pages=30), g, 8, [11, 5, 1, 3], 16, SP.max_new_tokens) == g
  kw = dict(seed=5, group_size=g, group_ids=[7, 8, 9, 10])
  want = Sampler(CFG, prompt_buckets=(8, 16), engine="static").generate(state, prompts, SP, **kw)
  for share in (True, False):
    kv = PagedKV(page_size=4, num_pages=30, share_prompts=share)
    got = Sampler(CFG, prompt_buckets=(8, 16), engine=engines.Paged(decode_rows=8, refill_rows=4, kv=kv)).generate(
        state, prompts, SP, **kw
    )
    for f in ("response_tokens", "response_mask", "finish_reason", "sample_index"):
      np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"{f}, share_prompts={share}")
    np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)
  assert len(set(map(tuple, want.response_tokens[:g].tolist()))) == g  # the samples of a group differ


def _refill(state, unit: int, prompts, g: int):
  """One `refill_units` of len(prompts) x g requests into an empty pool of 8 rows and 24 pages of 4 tokens,
  eagerly; returns the carry."""
  sampler = Sampler(CFG, engine=engines.Paged(kv=PagedKV(page_size=4)))
  core = sampler.engine.core
  model = core.model(sampler.prepare_params(state).state)
  sp = SamplingParams(temperature=1.0, max_new_tokens=8)
  n, p = len(prompts) * g, 16
  tokens, segs = np.zeros((n, p), np.int32), np.zeros((n, p), np.int32)
  for i in range(n):
    tokens[i, p - len(prompts[i // g]) :], segs[i, p - len(prompts[i // g]) :] = prompts[i // g], 1
  keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), n)), np.uint32)
  requests = (jnp.asarray(tokens), jnp.asarray(segs), jnp.arange(n, dtype=jnp.int32) // g, jnp.asarray(keys))
  pool = paged.init_pool(
      num_layers=CFG.num_layers, num_pages=24, page_size=4, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
      rows=8, max_pages_per_row=6,
  )  # fmt: skip
  st = init_state(sampler.config, 8, n, 1, sp.max_new_tokens, 0)._replace(cache=pool)
  hd_major = keys_head_dim_major(sampler.config.jnp_dtype)
  m = n // unit
  st, nxt = pc.refill_units(st, 0, m, m, unit, core.prefill_fn(model), requests, sp, 0, hd_major, None)
  assert int(nxt) == n
  return st


def test_a_shared_prefill_stores_the_prompts_full_pages_once(state):
  """2 prompts x 3 samples in one refill: with units of 3, the 11-token prompt's 2 full pages exist once with
  reference count 3 and each sample has its own copy of the partial third page; the 3-token prompt (no full
  page) gets 3 partial pages. 8 pages in use instead of 12, and every row's stored keys/values, index-0 token
  and log-prob equal those of 6 separate prefills."""
  prompts = [PROMPTS[1], PROMPTS[0]]
  shared, alone = _refill(state, 3, prompts, 3), _refill(state, 1, prompts, 3)
  for st in (shared, alone):
    assert int(st.cache.errors) == 0
    np.testing.assert_array_equal(np.asarray(st.cache.lengths), [11, 11, 11, 3, 3, 3, 0, 0])
  pool = shared.cache
  refcount, table = np.asarray(pool.refcount), np.asarray(pool.page_table)
  used = lambda p: int(np.sum(np.asarray(p.refcount) > 0))
  assert (used(pool), used(alone.cache)) == (2 + 3 + 3, 3 * 3 + 3)
  long_rows = np.flatnonzero(np.asarray(pool.lengths) == 11)
  full = table[long_rows, :2]
  assert (full == full[0]).all() and (refcount[full[0]] == 3).all()  # the full pages, once, shared by 3
  partial = np.concatenate([table[long_rows, 2], table[np.asarray(pool.lengths) == 3, 0]])
  assert len(set(partial.tolist())) == 6 and (refcount[partial] == 1).all()
  by_req = lambda st: np.argsort(np.where(np.asarray(st.req) < 6, np.asarray(st.req), 99))[:6]

  def row_kv(p, r):  # [layers, 2 (k, v), K, tokens, hd] of row r in token order
    n_pages = -(-int(p.lengths[r]) // 4)
    kv = np.stack(
        [np.stack([np.asarray(a)[:, np.asarray(p.page_table)[r, :n_pages]] for a in layer]) for layer in p.kv_pages]
    )
    return kv.reshape(*kv.shape[:3], -1, kv.shape[-1])[:, :, :, : int(p.lengths[r])]

  for a, b in zip(by_req(shared), by_req(alone)):
    np.testing.assert_allclose(row_kv(pool, a), row_kv(alone.cache, b), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(shared.tokens[:, 0]), np.asarray(alone.tokens[:, 0]))
  np.testing.assert_allclose(np.asarray(shared.logp[:, 0]), np.asarray(alone.logp[:, 0]), atol=1e-5, rtol=0)


def test_paged_kernel_choice():
  """ "auto" takes the plain-JAX path off TPU; the Pallas block, and whether the chips have two cores, go only to
  the Pallas kernel."""
  kv = PagedKV(pages_per_compute_block=8)
  assert kv.kernel_fields() == {"kernel": "xla"}  # the tests' CPU devices
  chip = lambda cores: types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="tpu", num_cores=cores)]))
  assert PagedKV(kernel="pallas", pages_per_compute_block=8).kernel_fields(chip(2)) == {
      "kernel": "pallas",
      "pages_per_compute_block": 8,
      "megacore": True,
  }
  assert PagedKV(kernel="auto").kernel_fields(chip(1)) == {
      "kernel": "pallas",
      "pages_per_compute_block": None,
      "megacore": False,
  }
  with pytest.raises(ValueError, match=r"^PagedKV.kernel='pallas' needs TPU devices, the sampler's are cpu"):
    PagedKV(kernel="pallas").kernel_fields()
  with pytest.raises(ValueError, match="kernel"):
    PagedKV(kernel="mosaic")
  with pytest.raises(ValueError, match="pages_per_compute_block"):
    PagedKV(pages_per_compute_block=0)
  with pytest.raises(ValueError, match=r"^PagedKV.share_prompts='no' must be True or False"):
    PagedKV(share_prompts="no")
  kv = PagedKV(page_size=np.int64(16), num_pages=np.int32(40))
  assert (kv.page_size, kv.num_pages) == (16, 40) and type(kv.page_size) is int


# The paged sampler's whole call (the paged engine's `program`, shared prompts in units of 8) for a v5p-8 (4 chips) on the
# sampler's layout data=D x tensor=T (argv): Qwen3-8B's heads and 2 layers in bf16, 64 decode rows, 256 prompts of
# 256 tokens, 1024 new tokens, pages of 64, split into D row groups. Every instruction of the computations its
# `while` loop runs (the refill and decode branches, nested loops), and the copies as large as one chip's share of a
# layer's page pool (its group's pages, its KV heads).
_TPU_PAGED = """
import math
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from minpro_jax.aot import hlo_text
from minpro_jax.models import get_preset
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
from minpro_jax.runtime.sharding import make_mesh
from minpro_jax.sampling import PagedKV, Sampler, SamplingParams, engines

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")

topology = topologies.get_topology_desc(
    platform="tpu", topology_name="v5p:2x2x1", chip_config_name="default", chips_per_host_bounds=(2, 2, 1),
    num_slices=1,
)
data, tensor, top_p = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
mesh = make_mesh({"data": data, "tensor": tensor}, devices=topology.devices)
cfg = get_preset("qwen3-8b").replace(num_layers=2)
kv = PagedKV(page_size=64, num_pages=512)  # kernel "auto"
s = Sampler(cfg, precision="bf16", mesh=mesh, rules=INFERENCE_RULES, prompt_buckets=(256,), engine=engines.Paged(decode_rows=64, kv=kv))
with nnx.use_eager_sharding(False):
  raw = nnx.split(nnx.eval_shape(lambda: Transformer(s._input_config, rngs=nnx.Rngs(0))))[1]
state = jax.tree_util.tree_map_with_path(
    lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.param_shardings[jax.tree_util.keystr(p)]),
    jax.eval_shape(s.jitted_prepare, raw),
)
n, p = 256, 256
arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, PartitionSpec()))
requests = (arg((n, p), jnp.int32), arg((n, p), jnp.int32), arg((n,), jnp.int32), arg((n, 2), jnp.uint32))
rows, refill = s.engine.rows_and_refill(n)
sp = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=1024)
with s.mesh_context():
  lowered = s.engine.program.lower(state, requests, sampling=sp, p_len=p, rows=rows, refill=refill, unit=8)
comps = hlo_text.parse_hlo(lowered.compile().as_text())
entry = next(x for x in comps.values() if x.entry)
seen, todo = set(), [b for i in entry.instrs if i.opcode == "while" for b in hlo_text.called(i.attrs, "body")]
while todo:
  name = todo.pop()
  if name not in seen and name in comps:
    seen.add(name)
    todo += [n for i in comps[name].instrs for k in ("calls", "body", "condition", "branch_computations", "to_apply")
             for n in hlo_text.called(i.attrs, k)]
instrs = [i for x in seen for i in comps[x].instrs]
kernels = [i for i in instrs if i.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in i.attrs]
names = sorted({re.sub(r"[.]\\d+$", "", i.name) for i in kernels})
pool = (cfg.num_kv_heads // tensor, kv.num_pages // data, kv.page_size, cfg.head_dim)  # a chip's k or v share
big = [i for i in instrs if i.opcode == "copy" and math.prod(hlo_text.dims(i.shape) or [0]) >= math.prod(pool)]
# the decode step: the computations that call the kernel (one per layer) and those they call
step = {x for x in seen if any(i.opcode == "custom-call" and "paged_attention" in i.attrs for i in comps[x].instrs)}
todo = list(step)
while todo:
  for i in comps[todo.pop()].instrs:
    for k in ("calls", "body", "condition", "branch_computations", "to_apply"):
      new = [n for n in hlo_text.called(i.attrs, k) if n in comps and n not in step]
      step.update(new)
      todo += new
coll = [i for x in step for i in comps[x].instrs if i.opcode.removesuffix("-start") in COLLECTIVES]
gathers = [hlo_text.dims(i.shape) or [0] for i in coll if i.opcode.startswith("all-gather")]
rows = 64 // data  # a row group's decode rows
kv_gathers = [d for d in gathers if cfg.head_dim in d and cfg.num_kv_heads in d]
logit_gathers = [d for d in gathers if math.prod(d) >= rows * cfg.vocab_size // tensor]
print(f"RESULT computations={len(seen)} kernels={','.join(names)} "
      f"calls={sum('paged_attention' in i.attrs for i in kernels)} pool_copies={len(big)} "
      f"step_collectives={len(coll)} kv_gathers={len(kv_gathers)} logit_gathers={len(logit_gathers)} "
      f"step_ops={','.join(sorted(i.opcode for i in coll))}")
"""


# the paper's training draw (temperature 1) on 2 x 2, the evaluation's (top-p 0.95) on 1 x 4
TOP_P = {(2, 2): 1.0, (1, 4): 0.95}


@functools.lru_cache(maxsize=None)
def _tpu_paged(data: int, tensor: int) -> dict:
  """The RESULT of `_TPU_PAGED` on data x tensor (one compile per layout, shared by the tests below)."""
  from tests.tpu_helpers import run_with_libtpu

  argv = f"['{data}', '{tensor}', '{TOP_P[data, tensor]}']"
  (r,) = run_with_libtpu(f"import sys; sys.argv[1:] = {argv}\n" + _TPU_PAGED, timeout=400)
  return r


@pytest.mark.parametrize("data,tensor", [(2, 2), (1, 4)])
def test_the_compiled_tpu_paged_loop_calls_the_pallas_kernel_and_never_copies_the_pool(data, tensor):
  """On TPU ("auto" on v5p chips, compile-only) every decode step's attention is jax's Pallas paged attention
  kernel (per chip, `pallas_decode_attention`'s shard_map), one call per layer, and the loop has no copy as large as
  a chip's share of a layer's keys or values: the pool is the kernel's own layout, written, admitted and forked in
  place. Measured 2026-12-06 (libtpu 0.0.42.1, docs/sampler.md): the token-major pool of before had 10 such copies at
  tensor=4 and none at tensor=2; the heads-major [pages, 2K, ps, hd] pool with the ragged kernel had 2 on both (its
  token-major operand, one per layer and decode step)."""
  r = _tpu_paged(data, tensor)
  assert int(r["computations"]) > 10  # the loop's branches and nested loops were walked
  assert any("paged_attention" in k for k in r["kernels"].split(",")), r
  assert r["calls"] == "2", r  # one per layer
  assert r["pool_copies"] == "0", r


# collectives of a decode step's draw beyond the embedding's and the layers' (vocab_draw's module docstring)
DRAW_COLLECTIVES = {
    1.0: 4,  # the max, the next shard's head, the block sums, the token
    # + the candidates (one all-gather of [rows, 2, t * 1024]), the kept mass, the threshold's bounds; past the
    # candidates (lax.cond, counted once): the bisection's all-reduce, two minima (its bracket, the threshold), the
    # threshold's mass, the ties (counts, i_tau)
    0.95: 7 + 6,
}


@pytest.mark.parametrize("data,tensor", [(2, 2), (1, 4)])
def test_the_compiled_tpu_decode_step_gathers_neither_keys_values_nor_logits(data, tensor):
  """The decode step on TPU (the computations that call the kernel, and what they call) holds no all-gather of the
  new token's keys / values (`write_slots` per chip in a shard_map) and none of a chip's share of the [rows, vocab]
  logits or more (`sampling.vocab_draw`, top-p past its candidates included), and 2 collectives per layer + 1 (the
  vocabulary-split embedding's all-reduce) + the draw's (`DRAW_COLLECTIVES`) (issue 54). Measured 2026-12-07 (libtpu
  0.0.42.1): temperature 1 on 2 x 2, 9; top-p 0.95 on 1 x 4, 17 (before the bisection its past-the-candidates branch
  all-gathered the logits); before the vocabulary-split draw, 22 at temperature 1, with all-gathers of
  bf16[64,1,8,128] keys and values per layer and of f32[64,76032] logits."""
  r = _tpu_paged(data, tensor)
  assert r["kv_gathers"] == "0", r
  assert r["logit_gathers"] == "0", r
  assert int(r["step_collectives"]) <= 2 * 2 + 1 + DRAW_COLLECTIVES[TOP_P[data, tensor]], r
  assert r["step_ops"].count("all-gather") == (TOP_P[data, tensor] < 1), r  # the top-p candidates only


def test_paged_sampler_on_row_groups_equals_static(state):
  """On the sampler's layout data=2 x tensor=2 the paged call splits into 2 row groups (`row_groups`), each with
  its own loop, rows and pool of 12 pages (a unit waits for pages); the responses are the static sampler's."""
  from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
  kv = PagedKV(page_size=4, num_pages=24)
  engine = engines.Paged(decode_rows=4, refill_rows=2, kv=kv)
  pag = Sampler(CFG, prompt_buckets=(8, 16), mesh=mesh, rules=INFERENCE_RULES, engine=engine)
  assert paged_engine.row_groups(pag.engine.core, 4, 14) == (("data",), 2)
  assert paged_engine.row_groups(pag.engine.core, 4, 7)[1] == 1  # 7 requests do not split in two
  static = Sampler(CFG, prompt_buckets=(8, 16), engine="static")
  got, want = _generate_both(pag, static, state)
  _assert_equal_samples(got, want)
