"""Truncation-aware ratios (issue 39 item 4; case B13 of tests/CASES.md; huggingface/trl#6789, trl#7269).

With top-k / top-p the sampler records the log-prob of the truncated, renormalised distribution it drew from and
each position's kept-set threshold; the learner renormalises over the same sets, so on-policy ratios are 1. A
learner scoring over the full vocabulary reproduces the published bias (every ratio off by the kept mass S)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.logprobs import logprobs_from_hidden
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.sampling import PagedKV, Sampler, SamplingParams, engines, get_next_tokens

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3]]
TOPP = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=12)


def test_b13_learner_renormalises_over_the_recorded_kept_set():
  # logits [3, 2, 1, 0], T = 1, top_p 0.8: nucleus {0, 1}, S = .880797
  logits = jnp.array([[3.0, 2.0, 1.0, 0.0]])
  keys = jax.random.split(jax.random.key(0), 64)
  out = get_next_tokens(jnp.tile(logits, (64, 1)), keys, SamplingParams(temperature=1.0, top_p=0.8))
  toks = np.asarray(out.tokens)
  assert set(toks.tolist()) == {0, 1}
  # one position per draw: hidden 1, head = the logits, so the learner sees the sampler's logits
  hidden, head = jnp.ones((1, 64, 1)), logits
  kept = out.kept_logp_threshold[None]
  lp, _ = logprobs_from_hidden(hidden, head, jnp.asarray(toks)[None], kept_logp_threshold_bt=kept)
  np.testing.assert_allclose(np.asarray(lp[0]), np.asarray(out.logp), atol=1e-6)  # ratio 1 +- 1e-6
  np.testing.assert_allclose(np.asarray(lp[0])[toks == 0], -0.313262, atol=1e-6)
  full, _ = logprobs_from_hidden(hidden, head, jnp.asarray(toks)[None])
  np.testing.assert_allclose(np.asarray(full[0])[toks == 0], -0.440190, atol=1e-6)  # the bug: ratio S = .8808
  np.testing.assert_allclose(np.exp(np.asarray(full[0]) - np.asarray(out.logp)), 0.880797, atol=1e-6)


@pytest.mark.parametrize("chunk_size,vocab_tile", [(12, 8192), (5, 8), (4, 6)], ids=["dense", "chunked", "tiled"])
def test_kept_set_logprobs_and_gradients_equal_a_naive_masked_softmax(chunk_size, vocab_tile):
  rng = np.random.RandomState(0)
  b, t, d, v, temp = 2, 12, 8, 24, 1.3
  h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
  y = jnp.asarray(rng.randint(0, v, (b, t)), jnp.int32)
  full = np.asarray(jax.nn.log_softmax((h @ w) / temp))
  thr = np.sort(full, -1)[..., -5] - 1e-3  # the top 5 of each position (plus the target, wherever it ranks)
  thr[0, :3] = -np.inf  # keep everything at a few positions
  thr = jnp.asarray(thr, jnp.float32)

  def naive(h, w):
    z = (h @ w) / temp
    keep = (jax.nn.log_softmax(z) > thr[..., None]) | (jnp.arange(v) == y[..., None])
    return jnp.take_along_axis(z, y[..., None], -1)[..., 0] - jax.nn.logsumexp(jnp.where(keep, z, -jnp.inf), -1)

  def ours(h, w):
    kw = dict(temperature=temp, chunk_size=chunk_size, vocab_tile=vocab_tile, return_entropy=True)
    return logprobs_from_hidden(h, w, y, kept_logp_threshold_bt=thr, **kw)

  def entropy(h, w):
    p = jax.nn.softmax((h @ w) / temp)
    return -jnp.sum(p * jnp.log(p), -1)  # the entropy stays the full distribution's

  lp, ent = ours(h, w)
  np.testing.assert_allclose(lp, naive(h, w), atol=1e-5)
  np.testing.assert_allclose(ent, entropy(h, w), atol=1e-5)
  weights = jnp.asarray(rng.standard_normal((b, t)), jnp.float32)
  loss = lambda f: lambda h, w: jnp.sum(f(h, w)[0] * weights) + 0.3 * jnp.sum(f(h, w)[1])  # noqa: E731
  got = jax.grad(loss(ours), argnums=(0, 1))(h, w)
  want = jax.grad(loss(lambda h, w: (naive(h, w), entropy(h, w))), argnums=(0, 1))(h, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-4)
  # an entropy only read as a metric (a symbolic-zero cotangent): the log-prob's gradient alone
  got = jax.grad(lambda h, w: jnp.sum(ours(h, w)[0] * weights), argnums=(0, 1))(h, w)
  want = jax.grad(lambda h, w: jnp.sum(naive(h, w) * weights), argnums=(0, 1))(h, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-4)


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, seed=3)


@pytest.fixture(scope="module")
def rollout(model):
  gen = Sampler(CFG, prompt_buckets=(8, 16), engine="static").generate(
      nnx.split(model)[1], PROMPTS, TOPP, seed=5, group_size=2
  )
  n = len(gen)
  adv = np.tile([1.0, -1.0], n // 2).astype(np.float32)
  return gen, RolloutBatch.from_generation(gen, rewards=np.zeros(n), advantages=adv)


@pytest.fixture(scope="module")
def learner(model):
  return Learner(model, LossConfig(method="grpo"), OptimizerConfig(learning_rate=1e-3), micro_batch_size=4)


def test_on_policy_ratios_are_one_and_the_full_vocabulary_reproduces_the_bias(model, rollout, learner):
  _, batch = rollout
  m = batch.response_mask
  params = nnx.split(model)[1]
  ratio = np.exp(learner.score(params, batch) - batch.behavior_logp)
  # a vocabulary entry within rounding of a threshold may fall on either side in the learner (off by its
  # probability / S, docs/truncation.md): those positions are checked apart
  out = model(
      jnp.asarray(batch.tokens), jnp.asarray(batch.positions), jnp.asarray(batch.segment_ids), return_hidden=True
  )
  full = np.asarray(jax.nn.log_softmax(model.logits(out.out)[:, :-1]))
  near = np.any(np.abs(full - batch.kept_logp_threshold[:, 1:, None]) < 1e-5, axis=-1)
  near = np.pad(near, ((0, 0), (1, 0)))
  assert np.sum(m & ~near) > 0.9 * m.sum()
  np.testing.assert_allclose(ratio[m & ~near], 1.0, atol=1e-5, rtol=0)  # fp32 rounding
  np.testing.assert_allclose(ratio[m & near], 1.0, atol=1e-2, rtol=0)
  ratio = ratio[m]
  # the bug (trl#6789): full-vocabulary learner log-probs against the renormalised behavior log-probs
  biased = np.exp(learner.score(params, batch.replace(kept_logp_threshold=None)) - batch.behavior_logp)[m]
  assert np.all(biased < 1.0)  # = S, the kept mass of each position
  assert np.mean((biased < 0.9) | (biased > 1.1)) > 0.5  # published: 51.8 % outside [0.9, 1.1] at top_p 0.8
  # the update renormalises too: its on-policy log-ratios are 0 (and are log S without the thresholds)
  fresh = lambda: learner.init_state(jax.tree.map(jnp.copy, params))  # noqa: E731 (the update donates its state)
  _, metrics = learner.update(fresh(), batch)
  assert float(metrics["learner_behavior/abs_log_ratio_mean"]) < 1e-5
  _, metrics = learner.update(fresh(), batch.replace(kept_logp_threshold=None))
  np.testing.assert_allclose(float(metrics["learner_behavior/abs_log_ratio_mean"]), -np.mean(np.log(biased)), 1e-4)


def test_paged_sampler_records_the_static_thresholds(model, rollout):
  gen, _ = rollout
  paged = Sampler(
      CFG, prompt_buckets=(8, 16), engine=engines.Paged(decode_rows=4, refill_rows=2, kv=PagedKV(page_size=4))
  )
  got = paged.generate(nnx.split(model)[1], PROMPTS, TOPP, seed=5, group_size=2)
  np.testing.assert_array_equal(got.response_tokens, gen.response_tokens)
  np.testing.assert_allclose(got.behavior_logp, gen.behavior_logp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got.kept_logp_threshold, gen.kept_logp_threshold, atol=1e-5, rtol=0)


def test_thresholds_travel_with_the_batch_only_when_truncating(rollout):
  gen, batch = rollout
  m = batch.response_mask
  assert TOPP.truncates and not SamplingParams(temperature=1.0).truncates
  assert not SamplingParams(temperature=0.0, top_k=5).truncates  # greedy draws no set
  assert np.all(np.isfinite(batch.kept_logp_threshold[m])) and np.all(batch.kept_logp_threshold[~m] == -np.inf)
  back = RolloutBatch.from_dict(batch.to_dict())  # the delay buffer's checkpoint keeps them
  np.testing.assert_array_equal(back.kept_logp_threshold, batch.kept_logp_threshold)
  assert RolloutBatch.from_dict(batch.replace(kept_logp_threshold=None).to_dict()).kept_logp_threshold is None
  with pytest.raises(ValueError, match="kept_logp_threshold"):
    batch.replace(kept_logp_threshold=batch.kept_logp_threshold[:, 1:])
  with pytest.raises(ValueError, match="kept_logp_threshold_bt"):
    logprobs_from_hidden(
        jnp.ones((1, 3, 1)), jnp.ones((1, 4)), jnp.zeros((1, 3), jnp.int32), kept_logp_threshold_bt=jnp.zeros((1, 2))
    )
