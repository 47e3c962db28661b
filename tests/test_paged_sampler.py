"""The continuous sampler on a paged KV cache (`Sampler(paged_kv=PagedKV(...))`) against the static sampler:
the same responses token for token, with a pool so small that requests wait for pages."""

import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.sampling import PagedKV, Sampler, SamplingParams

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3], [71, 72, 73, 74, 75], [12], [8, 9, 10]]
STOPS = tuple(range(3, CFG.vocab_size, 9))  # about 1 id in 9 stops a row: ragged lengths
SP = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def state():
  return nnx.split(init_model(CFG, seed=3))[1]


def test_paged_sampler_equals_static_with_a_pool_of_one_long_row(state):
  """9 pages of 4 tokens hold one request of the longest prompt (11 + 23 tokens) and no second one, so on 4
  decode rows most of the 14 requests wait for pages; pages are freed and reused as rows stop."""
  static = Sampler(CFG, prompt_buckets=(8, 16), continuous=False)
  pag = Sampler(CFG, prompt_buckets=(8, 16), decode_rows=4, refill_rows=2, paged_kv=PagedKV(page_size=4, num_pages=9))
  kw = dict(seed=11, group_size=2, group_ids=[40, 41, 42, 43, 44, 45, 46], policy_version=5)
  want = static.generate(state, PROMPTS, SP, **kw)
  got = pag.generate(state, PROMPTS, SP, **kw)
  for f in ("response_tokens", "response_mask", "lengths", "finish_reason", "group_ids", "sample_index"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-5, rtol=0)
  assert (got.finish_reason == "stop").any() and len(set(got.lengths.tolist())) > 3  # ragged


def test_paged_options_are_checked(state):
  with pytest.raises(ValueError, match="in_loop_refill"):
    Sampler(CFG, paged_kv=PagedKV(page_size=4), continuous=False)
  with pytest.raises(ValueError, match="page_size"):
    PagedKV(page_size=0)
  tiny_pool = Sampler(CFG, prompt_buckets=(8, 16), decode_rows=4, paged_kv=PagedKV(page_size=4, num_pages=8))
  with pytest.raises(ValueError, match="needs 9 pages"):  # 11 + 23 tokens: it would wait forever
    tiny_pool.generate(state, PROMPTS, SP, seed=11)


def test_paged_moe_sampler_records_the_routes_of_the_dense_one():
  """MoE with router-route recording: the paged sampler's tokens, log-probs and routes equal the dense
  continuous sampler's (a pool of 10 pages of 4 tokens, so requests wait)."""
  cfg = get_preset("tiny-moe")
  state = nnx.split(init_model(cfg, seed=3))[1]
  sp = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(range(3, cfg.vocab_size, 9)))
  kw = dict(prompt_buckets=(8, 16), decode_rows=4, refill_rows=2, record_routes=True)
  want = Sampler(cfg, **kw).generate(state, PROMPTS[:3], sp, seed=11, group_size=2)
  got = Sampler(cfg, **kw, paged_kv=PagedKV(page_size=4, num_pages=10)).generate(
      state, PROMPTS[:3], sp, seed=11, group_size=2
  )
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(want.routes))
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)
