"""Continuous batching (`Sampler(engine=engines.Continuous())`, the default) against the static sampler, row by row, and
live-length cache attention against full-cache attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.config_lib.defaults import get_config
from minpro_jax.models import get_preset, init_model
from minpro_jax.models.attention_core import live_length_attention, live_length_buckets, masked_attention
from minpro_jax.models.transformer import KVCache
from minpro_jax.run.sampler_setup import engine_name
from minpro_jax.sampling import Sampler, SamplingParams, engines

CFG = get_preset("tiny")
# 7 ragged prompts x 2 samples = 14 requests on 4 decode rows: refills, and a final partial wave of 2
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3], [71, 72, 73, 74, 75], [12], [8, 9, 10]]
STOPS = tuple(range(3, CFG.vocab_size, 9))  # about 1 id in 9 stops a row: ragged lengths
R = 24
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=R, stop_token_ids=STOPS),
    "t1": SamplingParams(temperature=1.0, max_new_tokens=R, stop_token_ids=STOPS),
    "t0.7-topk": SamplingParams(temperature=0.7, top_k=40, max_new_tokens=R, stop_token_ids=STOPS),
    "t1.3-topp": SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=R, stop_token_ids=STOPS),
}


@pytest.fixture(scope="module")
def state():
  return nnx.split(init_model(CFG, seed=3))[1]


@pytest.fixture(scope="module")
def static():
  return Sampler(CFG, prompt_buckets=(8, 16), engine="static")


@pytest.fixture(scope="module")
def cont():  # host-driven chunks, refilled as soon as one row is done
  return Sampler(CFG, prompt_buckets=(8, 16), engine=engines.HostRefill(decode_rows=4, refill_rows=1))


@pytest.fixture(scope="module")
def loop():  # the default: refills inside the jitted loop, 2 rows at a time
  return Sampler(CFG, prompt_buckets=(8, 16), engine=engines.Continuous(decode_rows=4, refill_rows=2))


def _assert_same(got, want):
  for f in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "lengths", "finish_reason"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  for f in ("group_ids", "sample_index"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-5, rtol=0)
  assert (got.kept_logp_threshold is None) == (want.kept_logp_threshold is None)  # recorded when truncating
  if want.kept_logp_threshold is not None:
    np.testing.assert_allclose(got.kept_logp_threshold, want.kept_logp_threshold, atol=1e-5, rtol=0)
  assert got.policy_version == want.policy_version and got.temperature == want.temperature


@pytest.mark.parametrize("name", list(CASES))
def test_continuous_equals_static_row_by_row(state, static, cont, name):
  sp = CASES[name]
  kw = dict(seed=11, group_size=2, group_ids=[40, 41, 42, 43, 44, 45, 46], policy_version=5)
  want = static.generate(state, PROMPTS, sp, **kw)
  got = cont.generate(state, PROMPTS, sp, **kw)
  _assert_same(got, want)
  assert got.policy_version == 5 and list(got.group_ids[:4]) == [40, 40, 41, 41]
  if not sp.greedy:  # the case is ragged: some rows stop early, some run out of budget
    assert (got.finish_reason == "stop").any() and len(set(got.lengths.tolist())) > 3


def test_in_loop_refill_equals_static(state, static, cont, loop):
  sp, kw = CASES["t1"], dict(seed=11, group_size=2)
  assert loop.engine.name == "continuous" and cont.engine.name == "host_refill"
  _assert_same(loop.generate(state, PROMPTS, sp, **kw), static.generate(state, PROMPTS, sp, **kw))


@pytest.mark.parametrize("mode", ["chunks", "in_loop"])
def test_rows_stopping_at_step_zero_and_more_rows_than_prompts(state, static, cont, loop, mode):
  """Stop ids = the first greedy token of prompts 0 and 2: those rows stop at index 0, freeing their decode
  row at once; 3 prompts x 1 sample on a 4-row bucket leave rows that never hold a request."""
  probe = static.generate(state, PROMPTS, CASES["greedy"], group_size=1)
  first = probe.response_tokens[:, 0]
  sp = SamplingParams(temperature=0.0, max_new_tokens=R, stop_token_ids=(int(first[0]), int(first[2])))
  want = static.generate(state, PROMPTS, sp, group_size=1)
  assert want.lengths[0] == 1 and want.lengths[2] == 1 and want.lengths.max() > 1
  s = cont if mode == "chunks" else loop
  _assert_same(s.generate(state, PROMPTS, sp, group_size=1), want)
  _assert_same(s.generate(state, PROMPTS[:3], sp, group_size=1), static.generate(state, PROMPTS[:3], sp))


def test_static_is_selectable_and_continuous_is_the_trainer_default(cont, static):
  assert static.engine.name == "static" and Sampler(CFG).engine.name == "continuous"  # the front's default
  assert engine_name(get_config()) == "paged"  # the trainer's default: continuous on the paged cache
  c = get_config()
  c.sampling.continuous = False  # keeps the static sampler (A/B)
  assert engine_name(c) == "static"
  with pytest.raises(ValueError, match="decode_rows"):
    Sampler(CFG, engine=engines.Continuous(decode_rows=0))


def test_live_length_attention_equals_full_cache_attention_at_every_length():
  """Random cache of S = 300 slots, one query per row at slots 0..S-1: scoring the bucket of slots up to the
  longest row gives the full-cache output on every row whose slot is below live_len."""
  b, k, g, hd, s = 3, 2, 2, 16, 300
  ks = jax.random.split(jax.random.key(0), 4)
  qg = jax.random.normal(ks[0], (b, k, g, 1, hd))
  k_all = jax.random.normal(ks[1], (b, k, hd, s))
  v_all = jax.random.normal(ks[2], (b, k, s, hd))
  kv_seg = jnp.ones((b, s), jnp.int32).at[1, :7].set(0)  # row 1: 7 left pads
  q_seg = jnp.ones((b, 1), jnp.int32)
  buckets = live_length_buckets(s, 64)
  assert buckets == (64, 128, 300)

  @jax.jit
  def both(slot_b, live_len):
    mask = (jnp.arange(s)[None, None, :] <= slot_b[:, None, None]) & (kv_seg[:, None, :] == 1)
    full = masked_attention(qg, k_all, v_all, mask, keys_hd_major=True, dtype=jnp.float32)
    live = live_length_attention(
        qg,
        k_all,
        v_all,
        slot_b[:, None],
        q_seg,
        kv_seg,
        live_len,
        keys_hd_major=True,
        dtype=jnp.float32,
        buckets=buckets,
    )
    return full, live

  worst = 0.0
  for top in range(7, s):
    slots = jnp.array([top, max(top - 5, 7), top // 2 + 7], jnp.int32)  # rows at different lengths
    full, live = both(slots, top + 1)
    worst = max(worst, float(jnp.max(jnp.abs(full - live))))
  assert worst <= 1e-6, worst


def test_live_length_decode_equals_full_cache_decode_at_every_step(state):
  """500 decode steps of the tiny model on a 516-slot cache (buckets 128, 256, 516): the logits of every step
  with live-length attention equal those of attention over the whole cache."""
  cfg = Sampler(CFG).config
  model = Sampler(CFG).engine.core.model(Sampler(CFG).prepare_params(state).state)
  b, p, steps = 2, 16, 500
  s = p + steps
  assert len(live_length_buckets(s)) == 3
  prompt = jnp.tile(jnp.arange(1, p + 1, dtype=jnp.int32)[None], (b, 1))

  @jax.jit
  def run(prompt):
    out = model(prompt, cache=KVCache.zeros(cfg, b, s), cache_index=0)
    first = jnp.argmax(out.out[:, -1], -1).astype(jnp.int32)

    def step(carry, i):
      c_live, c_full, tok = carry
      pos = jnp.full((b, 1), p + i, jnp.int32)
      slot = jnp.full((b,), p + i, jnp.int32)
      lv = model(tok[:, None], pos, jnp.ones_like(pos), cache=c_live, cache_index=slot, live_len=p + i + 1)
      fu = model(tok[:, None], pos, jnp.ones_like(pos), cache=c_full, cache_index=p + i)
      diff = jnp.max(jnp.abs(lv.out - fu.out))
      return (lv.cache, fu.cache, jnp.argmax(fu.out[:, 0], -1).astype(jnp.int32)), (diff, jnp.max(jnp.abs(fu.out)))

    _, (diff, scale) = jax.lax.scan(step, (out.cache, out.cache, first), jnp.arange(steps))
    return diff, scale

  diff, scale = jax.device_get(run(prompt))
  assert diff.shape == (steps,) and scale.min() > 0.1
  assert diff.max() <= 1e-5, (int(diff.argmax()), float(diff.max()))


# The trainer's sampler as the step budget compiles it (Qwen3-8B's layers on v5p-64, data=8 x tensor=4, bf16),
# cut to 2 layers and short lengths: its whole call (the continuous engine's `program`) for TPU, and every `copy` in the
# computations its `while` loop runs (the decode and refill branches, the live-length switch, nested loops).
_TPU_CACHE_COPIES = """
from minpro_jax.aot import hlo_text
from minpro_jax.aot.environment import run_config_of
from minpro_jax.aot.programs import RunPrograms, model_config, run_shapes
from minpro_jax.aot.topologies import parse_slice
from minpro_jax.runtime.sharding import make_mesh
sl = parse_slice("v5p-64")
_, c = run_config_of(["--config=configs/paper/qwen3_8b.py", "--config.sampling.mesh=auto",
                      "--config.sampling.decode_rows=64", "--config.sampling.max_new_tokens=1024",
                      "--config.data.max_prompt_tokens=256"])
cfg = model_config(c)[0].replace(num_layers=2)
progs = RunPrograms(c, cfg, make_mesh({"fsdp": 32}, devices=sl.devices()), run_shapes(c), hbm_bytes=sl.chip.hbm_bytes)
comps = hlo_text.parse_hlo(progs.lower_continuous(512).compile().as_text())
entry = next(x for x in comps.values() if x.entry)
seen, todo = set(), [b for i in entry.instrs if i.opcode == "while" for b in hlo_text.called(i.attrs, "body")]
while todo:
  name = todo.pop()
  if name not in seen and name in comps:
    seen.add(name)
    todo += [n for i in comps[name].instrs for k in ("calls", "body", "condition", "branch_computations")
             for n in hlo_text.called(i.attrs, k)]
s = progs.trainer_sampler
rows, tensor = s.engine.rows_and_refill(512)[0] // s.mesh.shape["data"], s.mesh.shape["tensor"]
layer = sorted([rows, cfg.num_kv_heads // tensor, 256 + 1024, cfg.head_dim])  # one layer's K (or V) per chip
copies = [i for x in seen for i in comps[x].instrs if i.opcode == "copy" and sorted(hlo_text.dims(i.shape)) == layer]
print(f"RESULT computations={len(seen)} layer={','.join(map(str, layer))} cache_copies={len(copies)}")
"""


def test_the_compiled_tpu_decode_loop_writes_its_kv_cache_in_place():
  """No copy of a layer's KV cache inside the sampler's loop on TPU (issue 36): the token write used to relayout
  every layer's cache to [B, S, K, hd] tiles and back (4 copies a layer), and each live-length branch copied it
  again (2 a layer)."""
  from tests.tpu_helpers import run_with_libtpu

  (r,) = run_with_libtpu(_TPU_CACHE_COPIES, timeout=400)
  assert int(r["computations"]) > 10  # the loop's branches and nested loops were walked
  assert r["layer"] == "2,8,128,1280"  # 64 rows / data=8, 8 KV heads / tensor=4, 256 + 1024 slots, head_dim
  assert r["cache_copies"] == "0", r
