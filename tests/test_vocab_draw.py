"""The vocabulary-sharded token draw (`sampling.vocab_draw`, issue 54): on a data=2 x tensor=4 mesh of the 8 CPU
devices, with the logits split by vocabulary over tensor, `get_next_tokens` returns the one-device draw's tokens,
log-probs, entropies and kept-set thresholds bit for bit, and the one-device draw returns the tokens of the draw of
before (sums over the whole vocabulary in one reduction) with log-probs equal to fp32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
from minpro_jax.runtime.sharding import make_mesh, use_mesh
from minpro_jax.sampling import SamplingParams, get_next_tokens, truncation_logits, vocab_draw
from minpro_jax.sampling.methods import sample_categorical
from minpro_jax.sampling.vocab_draw import block_layout, tree_sum

ROWS = 16
SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "top_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "top_k20": SamplingParams(temperature=1.0, top_k=20),
    "top_k20_top_p0.95": SamplingParams(temperature=1.0, top_k=20, top_p=0.95),
    "t0.7_top_p0.5": SamplingParams(temperature=0.7, top_p=0.5),
    "greedy": SamplingParams(temperature=0.0),
}


def _before(logits, keys, sp):
  """The draw of before issue 54 (methods.get_next_tokens of 2026-12-06): the same blocks and uniforms, with z, the
  entropy's sum and the kept mass summed over the whole vocabulary in one reduction."""
  scaled = logits.astype(jnp.float32) / sp.logprob_temperature
  shifted = scaled - jnp.max(scaled, axis=-1, keepdims=True)
  e = jnp.exp(shifted)
  z = jnp.sum(e, axis=-1)
  entropy = jnp.log(z) - jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1) / z
  if sp.greedy:
    tokens = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    norm = z
  elif sp.truncates:
    e = jnp.where(jnp.isfinite(truncation_logits(scaled, sp.top_k, sp.top_p)), e, 0.0)
    tokens, norm = sample_categorical(e, keys), jnp.sum(e, axis=-1)
  else:
    tokens, norm = sample_categorical(e, keys), z
  return tokens, jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - jnp.log(norm), entropy


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"data": 2, "tensor": 4}, axis_names=("data", "tensor"), devices=jax.devices()[:8])


def _inputs(v: int, seed: int, scale: float = 3.0):
  logits = jax.random.normal(jax.random.key(seed), (ROWS, v)) * scale
  logits = logits.at[:, 7].set(0.0).at[:, 8].set(-0.0)  # a signed-zero tie (one value for top-k)
  return logits, jax.random.split(jax.random.key(seed + 1), ROWS)


def _draw_both(mesh, logits, keys, sp):
  one = jax.jit(lambda x, k: get_next_tokens(x, k, sp))(logits, keys)
  with use_mesh(mesh, INFERENCE_RULES):
    split = jax.device_put(logits, NamedSharding(mesh, P(None, "tensor")))
    sharded = jax.jit(lambda x, k: get_next_tokens(x, k, sp))(split, keys)
  return one, sharded


# V = 4000: shards of 1000 tokens whose bounds fall inside blocks of 256 (the next shard's head is passed on);
# V = 400: shards shorter than a block (the shards' logits are gathered: a tiny vocabulary)
@pytest.mark.parametrize(
    "v,name", [(4000, name) for name in SETTINGS] + [(400, "t1"), (400, "top_k20_top_p0.95"), (400, "greedy")]
)
def test_the_sharded_draw_is_the_one_device_draw_bit_for_bit(mesh, v, name):
  sp = SETTINGS[name]
  logits, keys = _inputs(v, seed=v + len(name))
  one, sharded = _draw_both(mesh, logits, keys, sp)
  for field in ("tokens", "logp", "entropy", "kept_logp_threshold"):
    a, b = getattr(one, field), getattr(sharded, field)
    assert (a is None) == (b is None) == (field == "kept_logp_threshold" and not sp.truncates), field
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)
  tokens, logp, entropy = _before(logits, keys, sp)
  np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(tokens))
  np.testing.assert_allclose(np.asarray(one.logp), np.asarray(logp), rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(one.entropy), np.asarray(entropy), rtol=0, atol=2e-6)
  assert len(set(np.asarray(one.tokens).tolist())) > 1 or sp.greedy  # the rows drew different tokens


def test_top_p_past_the_candidates_bisects_on_shards(mesh):
  """Top-p 0.999 on a nearly flat distribution over 6000 tokens: every nucleus holds more than the 1024 candidates,
    so the draw takes the `lax.cond` branch that bisects for the nucleus's threshold; still the one-device draw's and
  the tokens of the full sort of before."""
  sp = SamplingParams(temperature=1.0, top_p=0.999)
  logits, keys = _inputs(6000, seed=5, scale=0.1)
  one, sharded = _draw_both(mesh, logits, keys, sp)
  assert np.all(np.sum(np.isfinite(np.asarray(truncation_logits(logits, None, 0.999))), axis=-1) > 1024)
  for field in ("tokens", "logp", "entropy", "kept_logp_threshold"):
    np.testing.assert_array_equal(np.asarray(getattr(one, field)), np.asarray(getattr(sharded, field)), err_msg=field)
  np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(_before(logits, keys, sp)[0]))


@pytest.mark.parametrize("scale,top_p", [(0.1, 0.999), (0.05, 0.9)])
def test_top_p_past_the_candidates_with_ties_across_shards(mesh, scale, top_p):
  """bf16 logits of a flat distribution: hundreds of tokens share each value, so the nucleus's last value is shared by
  tokens on several shards and the bisection's tie count decides i_tau; still bit for bit the one-device draw."""
  sp = SamplingParams(temperature=1.0, top_p=top_p)
  logits, keys = _inputs(6000, seed=11, scale=scale)
  logits = (logits + 4.0).astype(jnp.bfloat16).astype(jnp.float32)  # a step of 2^-6 near 4
  assert len(np.unique(np.asarray(logits[0]))) < 100  # > 60 tokens a value
  one, sharded = _draw_both(mesh, logits, keys, sp)
  for field in ("tokens", "logp", "entropy", "kept_logp_threshold"):
    np.testing.assert_array_equal(np.asarray(getattr(one, field)), np.asarray(getattr(sharded, field)), err_msg=field)
  np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(_before(logits, keys, sp)[0]))


@pytest.mark.parametrize(
    "scale,top_p,bf16", [(0.1, 0.999, False), (0.05, 0.9, True), (1.0, 0.99, True), (3.0, 0.5, False)]
)
def test_the_nucleus_search_keeps_the_sorted_prefix(scale, top_p, bf16):
  """`_nucleus_search` (one device) keeps exactly the tokens of the full sort and cumsum (`truncation_logits`), ties
  included, on rows whose nucleus is small or large."""
  logits = jax.random.normal(jax.random.key(3), (ROWS, 3000)) * scale
  logits = (logits + 4.0).astype(jnp.bfloat16).astype(jnp.float32) if bf16 else logits
  m = jnp.max(logits, axis=-1)
  e = jnp.exp(logits - m[:, None])
  mass_above = lambda tau: jnp.sum(jnp.where(logits > tau[:, None], e, 0.0), axis=-1)  # noqa: E731
  tau, i_tau = jax.jit(
      lambda x: vocab_draw._nucleus_search(x, vocab_draw._Shard((), 1), top_p, mass_above, jnp.sum(e, axis=-1), m)
  )(logits)
  ids = jnp.arange(3000)[None, :]
  got = (logits > tau[:, None]) | ((logits == tau[:, None]) & (ids <= i_tau[:, None]))
  want = jnp.isfinite(truncation_logits(logits, None, top_p))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.sum(np.asarray(want)) > ROWS  # not just the top token


def test_block_layout_and_tree_sum():
  """Shards own the blocks that start in their range; the tree sum is the pairwise sum (hand-computed)."""
  assert block_layout(4000, 4, 256) == ([0, 4, 8, 12], [4, 4, 4, 4], 4)
  assert block_layout(400, 4, 256) == ([0, 1, 1, 2], [1, 0, 1, 0], 1)
  assert block_layout(512, 1, 256) == ([0], [2], 2)
  x = jnp.asarray([[1e8, 1.0, -1e8, 1.0, 3.0]], jnp.float32)
  # ((1e8 + 3) + -1e8) + ((1 + -0) + (1 + -0)) = 2 in fp32, where 1e8 + 3 rounds to 1e8 (a left-to-right sum: 4)
  assert float(tree_sum(x)[0]) == 2.0
  assert float(tree_sum(jnp.asarray([[2.5]]))[0]) == 2.5
