"""Sampler: exact behavior log-probs, cache/position correctness, stop and top-k/top-p edge cases (B09, B11,
B12, B13), versions, bad input, no recompilation, group ids, precision mismatch, HF greedy parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model, token_logprobs
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.sampling import Sampler, SamplingParams, get_next_tokens, truncation_logits
from minpro_jax.sampling.loop import decode_loop, init_loop_state, sample_step

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400]]  # ragged -> left padding in bucket 16
# Each distinct SamplingParams / bucket pair is one compile, so tests share these.
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=9)
TOPK = SamplingParams(temperature=0.7, top_k=40, max_new_tokens=9)
TOPP = SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=9)


@pytest.fixture(scope="module")
def model():
  return init_model(CFG, seed=3)


@pytest.fixture(scope="module")
def state(model):
  return nnx.split(model)[1]


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CFG, prompt_buckets=(8, 16))


def _learner_logp(model, batch):
  n = len(batch)
  la = RolloutBatch.from_generation(batch, rewards=np.zeros(n), advantages=np.zeros(n))
  lp = token_logprobs(
      model,
      jnp.asarray(la.tokens),
      jnp.asarray(la.segment_ids),
      jnp.asarray(la.positions),
      temperature=batch.temperature,
      return_entropy=True,
      kept_logp_threshold_bt=None if la.kept_logp_threshold is None else jnp.asarray(la.kept_logp_threshold),
  )
  return la, np.asarray(lp.logp), np.asarray(lp.entropy)


@pytest.mark.parametrize("sampling", [GREEDY, TOPK, TOPP], ids=["greedy", "t0.7-topk", "t1.3-topp"])
def test_behavior_logp_equals_teacher_forced(model, state, sampler, sampling):
  batch = sampler.generate(state, PROMPTS, sampling, seed=1, group_size=2)
  la, logp, ent = _learner_logp(model, batch)
  m = la.response_mask
  assert m.sum() == 2 * 3 * 9  # no stop ids: every row runs to max_new_tokens
  np.testing.assert_allclose(la.behavior_logp[m], logp[m], atol=1e-5, rtol=0)
  assert np.all(la.behavior_logp[~m] == 0)
  resp_ent = np.concatenate([np.zeros_like(batch.prompt_tokens, np.float32), batch.entropy], 1)
  np.testing.assert_allclose(resp_ent[m], ent[m], atol=1e-4, rtol=0)
  assert np.all(batch.finish_reason == "length") and np.all(batch.lengths == 9)
  assert (batch.kept_logp_threshold is None) == (not sampling.truncates)  # recorded only when truncating
  if not sampling.greedy:  # samples of one prompt differ (independent keys)
    assert not np.array_equal(batch.response_tokens[0], batch.response_tokens[1])


def test_batched_greedy_equals_each_row_alone(state, sampler):
  together = sampler.generate(state, PROMPTS, GREEDY, group_size=2)
  for i, p in enumerate(PROMPTS):
    alone = sampler.generate(state, [p], GREEDY)
    np.testing.assert_array_equal(alone.response_tokens[0], together.response_tokens[2 * i])
    np.testing.assert_allclose(alone.behavior_logp[0], together.behavior_logp[2 * i], atol=1e-5)


def test_stop_handling_scripted_b09():
  """Case B09: scripted rows [5,7,106,9,9,9] and [4,4,4,1,9,9], stop ids {1, 106}, max_new 6."""
  script = jnp.array([[5, 7, 106, 9, 9, 9], [4, 4, 4, 1, 9, 9], [2, 3, 4, 5, 6, 8]])
  v = 128
  sp = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(1, 106))
  onehot = lambda step: 10.0 * jax.nn.one_hot(script[:, step], v)

  def step_fn(carry, tokens_b, step):
    return onehot(step), carry + 1  # carry counts model calls

  keys = jax.random.split(jax.random.key(0), 3)
  st = init_loop_state(keys, jnp.ones(3, bool), 6, jnp.zeros((), jnp.int32), pad_id=0)
  st = decode_loop(step_fn, sample_step(st, onehot(0), sp), sp)
  tokens, mask, logp = np.asarray(st.tokens), np.asarray(st.mask), np.asarray(st.logp)
  np.testing.assert_array_equal(tokens, [[5, 7, 106, 0, 0, 0], [4, 4, 4, 1, 0, 0], [2, 3, 4, 5, 6, 8]])
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1] * 6])
  assert np.all(logp[~mask] == 0) and np.all(logp[mask] < 0) and np.all(np.isfinite(logp))
  np.testing.assert_array_equal(np.asarray(st.stopped), [True, True, False])  # row 2: finish "length"
  assert int(st.model_carry) == 5

  # Early exit: once every row stopped, no further model calls.
  script2 = jnp.array([[1, 9, 9, 9, 9, 9], [9, 106, 9, 9, 9, 9]])
  st = init_loop_state(keys[:2], jnp.ones(2, bool), 6, jnp.zeros((), jnp.int32))
  f = lambda step: 10.0 * jax.nn.one_hot(script2[:, step], v)
  st = decode_loop(lambda c, t, s: (f(s), c + 1), sample_step(st, f(0), sp), sp)
  assert int(st.model_carry) == 1 and int(st.step) == 2


def test_stop_and_finish_reason_in_sampler(model, state, sampler):
  """Rows that emit a stop id report "stop", pad after it, and are masked; others report "length"."""
  greedy = sampler.generate(state, PROMPTS, GREEDY, group_size=2)
  stop = int(greedy.response_tokens[0, 2])  # row 0 emits this at index 2 (maybe earlier)
  b = sampler.generate(
      state, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=(stop,)), group_size=2
  )
  first = int(np.argmax(greedy.response_tokens[0] == stop))
  assert b.finish_reason[0] == "stop" and b.lengths[0] == first + 1
  assert np.all(b.response_tokens[0, first + 1 :] == 0) and not b.response_mask[0, first + 1 :].any()
  for r in range(6):
    if stop not in greedy.response_tokens[r]:
      assert b.finish_reason[r] == "length" and b.lengths[r] == 9
      np.testing.assert_array_equal(b.response_tokens[r], greedy.response_tokens[r])


def _draw(logits, sp, n=1000, seed=0):
  logits = jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))
  return get_next_tokens(logits, jax.random.split(jax.random.key(seed), n), sp)


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(top_p=0.5), dict(top_k=1, top_p=0.8), dict(top_k=1)])
def test_b11_argmax_cases(kw):
  out = _draw([1.0, 3.0, 2.0], SamplingParams(temperature=1.0, **kw))
  assert np.all(np.asarray(out.tokens) == 1)
  np.testing.assert_allclose(np.asarray(out.logp), 0.0, atol=1e-6)  # the kept set is {1}: log(p1 / S) = 0
  assert np.all(np.isfinite(np.asarray(out.logp)))
  # the threshold lies between token 1 (kept, log .66524) and token 2 (dropped, log .24473)
  np.testing.assert_allclose(np.asarray(out.kept_logp_threshold), np.log(0.66524096 * 0.24472847) / 2, atol=1e-6)


def test_b11_top_p_keeps_crossing_token():
  cand = truncation_logits(jnp.array([[1.0, 3.0, 2.0]]), None, 0.7)  # vocabulary order, -inf outside
  np.testing.assert_array_equal(np.asarray(cand), [[-np.inf, 3.0, 2.0]])
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(cand))[0], [0.0, 0.7310586, 0.2689414], atol=1e-6)
  toks = np.asarray(_draw([1.0, 3.0, 2.0], SamplingParams(temperature=1.0, top_p=0.7), n=4000).tokens)
  assert set(toks.tolist()) == {1, 2}
  assert abs(np.mean(toks == 1) - 0.7310586) < 0.03  # 4 sigma at n=4000
  # top-k then top-p on the renormalised top-k distribution [.7311, .2689] (not the full one [.6652, .2447]):
  # top_p=0.72 keeps only token 1 (on the full distribution it would keep two), top_p=0.74 keeps both.
  for top_p, kept in ((0.72, 1), (0.74, 2)):
    cand = truncation_logits(jnp.array([[1.0, 3.0, 2.0]]), 2, top_p)
    assert np.isfinite(np.asarray(cand)).sum() == kept


def _nucleus_by_sorting(logits, top_k, top_p):
  """Reference candidate set in float64: a stable sort by (-logit, id), top-k, then top-p on the renormalised
  top-k. Also returns the tokens whose mass-before lies within 1e-5 of top_p (fp32 rounding may go either way)."""
  order = np.lexsort((np.arange(len(logits)), -logits))[: top_k or len(logits)]
  p = np.exp(logits[order].astype(np.float64) - logits[order].max())
  p /= p.sum()
  mass_before = np.cumsum(p) - p
  top_p = top_p if top_p is not None else 2.0
  keep = mass_before < top_p
  keep[0] = True
  return set(order[keep].tolist()), set(order[np.abs(mass_before - top_p) < 1e-5].tolist())


@pytest.mark.parametrize("top_k,top_p", [(None, 0.9), (None, 0.3), (7, None), (7, 0.8), (3000, 0.95), (None, 0.999)])
def test_truncation_set_equals_sorting_reference_with_ties(top_k, top_p):
  # 3000 tokens (past TOP_P_CANDIDATES=1024, so top_p=0.999 takes the full-sort fallback), bf16-like rounding
  # makes many exact ties: the kept set must still be the sorted prefix, lower ids first among equal logits
  rng = np.random.RandomState(0)
  logits = np.round(rng.standard_normal((4, 3000)) * 4, 1).astype(np.float32)
  logits[1, :5] = logits[1].max() + 1.0  # five tied maxima
  cand = np.asarray(truncation_logits(jnp.asarray(logits), top_k, top_p))
  for row in range(4):
    want, edge = _nucleus_by_sorting(logits[row], top_k, top_p)
    assert set(np.flatnonzero(np.isfinite(cand[row])).tolist()) ^ want <= edge
    np.testing.assert_array_equal(cand[row][np.isfinite(cand[row])], logits[row][np.isfinite(cand[row])])


def test_signed_zero_logits_are_one_tie():
  # lax.top_k orders +0.0 before -0.0; the kept set must still be k tokens, lower id first among equal logits
  cand = np.asarray(truncation_logits(jnp.asarray([[-0.0, 0.0, -5.0]]), 1, None))
  assert np.isfinite(cand).sum() == 1 and np.isfinite(cand[0, 0])
  toks = np.asarray(_draw([-0.0, 0.0, -5.0], SamplingParams(temperature=1.0, top_k=1), n=200).tokens)
  assert np.all(toks == 0)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
    ],
    ids=["full", "t0.7-topk5", "topp0.8"],
)
def test_sampled_frequencies_match_the_distribution(sp):
  # 600 tokens = 3 blocks of the two-level draw (the last one padded); token probabilities span 1e-4..0.2
  logits = np.full(600, -40.0, np.float32)  # ~e-40: never drawn
  hot = np.array([3, 255, 256, 257, 511, 512, 599])
  logits[hot] = [2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0]
  logits[100:110] = -5.0
  n = 40_000
  toks = np.asarray(_draw(logits, sp, n=n, seed=3).tokens)
  ref = np.asarray(
      jax.nn.softmax(truncation_logits(jnp.asarray(logits)[None] / sp.logprob_temperature, sp.top_k, sp.top_p))[0],
      np.float64,
  )
  counts = np.bincount(toks, minlength=600)
  assert counts[ref == 0].sum() == 0  # nothing outside the candidate set
  expected = n * ref
  big = expected >= 5
  chi2 = float(np.sum((counts[big] - expected[big]) ** 2 / expected[big]))
  dof = int(big.sum()) - 1
  assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)  # far out in the tail of chi2(dof)
  assert counts[~big].sum() <= expected[~big].sum() + 6 * np.sqrt(expected[~big].sum()) + 3


def test_rows_draw_independently_of_batch_composition():
  logits = jnp.asarray(np.random.RandomState(1).standard_normal((5, 700)).astype(np.float32))
  keys = jax.random.split(jax.random.key(9), 5)
  sp = SamplingParams(temperature=1.0)
  together = np.asarray(get_next_tokens(logits, keys, sp).tokens)
  alone = [int(get_next_tokens(logits[i : i + 1], keys[i : i + 1], sp).tokens[0]) for i in range(5)]
  np.testing.assert_array_equal(together, alone)


def test_b12_temperature_logp_and_greedy():
  out = _draw([2.0, 1.0, 0.0], SamplingParams(temperature=0.6), n=64)
  toks, logp = np.asarray(out.tokens), np.asarray(out.logp)
  assert np.sum(toks == 0) > 30 and out.kept_logp_threshold is None  # p0 = .8166; no truncation recorded
  np.testing.assert_allclose(logp[toks == 0], -0.20257, atol=1e-5)  # not raw -0.40761, not raw/T -0.67934
  for t in (0.0, 1e-7):
    g = _draw([2.0, 1.0, 0.0, -1e30], SamplingParams(temperature=t), n=4)
    assert np.all(np.asarray(g.tokens) == 0)
    np.testing.assert_allclose(np.asarray(g.logp), -0.40760596, atol=1e-6)  # greedy reports T=1 log-probs
    assert np.all(np.isfinite(np.asarray(g.logp))) and np.all(np.isfinite(np.asarray(g.entropy)))


def test_b13_truncation_records_the_sampled_distribution():
  # the learner side of B13 (ratio 1 once it renormalises over this set) is tests/test_truncation.py
  out = _draw([3.0, 2.0, 1.0, 0.0], SamplingParams(temperature=1.0, top_p=0.8), n=2000)
  toks, logp = np.asarray(out.tokens), np.asarray(out.logp)
  assert set(toks.tolist()) == {0, 1}
  np.testing.assert_allclose(logp[toks == 0], -0.313262, atol=1e-6)  # log(p0 / S), S = .880797 (full: -0.440190)
  np.testing.assert_allclose(logp[toks == 1], -1.313262, atol=1e-6)
  # kept {0, 1}: threshold midway between log p1 = -1.440190 and log p2 = -2.440190
  np.testing.assert_allclose(np.asarray(out.kept_logp_threshold), -1.940190, atol=1e-6)


def test_versions_are_stamped(state, sampler):
  b2 = sampler.generate(state, PROMPTS[:1], GREEDY, policy_version=2)
  assert b2.policy_version == 2
  unversioned = sampler.generate(state, PROMPTS[:1], GREEDY)
  assert unversioned.policy_version == -1
  np.testing.assert_array_equal(b2.response_tokens, unversioned.response_tokens)
  rb = RolloutBatch.from_generation(b2, rewards=np.zeros(1), advantages=np.zeros(1))
  np.testing.assert_array_equal(rb.policy_version, [2])
  assert rb.policy_version.dtype == np.int64


def test_bad_input(state, sampler):
  sp = SamplingParams(temperature=0.0, max_new_tokens=4)
  with pytest.raises(ValueError, match="prompts must be a non-empty"):
    sampler.generate(state, [], sp)
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty"):
    sampler.generate(state, [[1], []], sp)
  with pytest.raises(ValueError, match=r"prompts\[0\] has length 17 > the largest prompt bucket 16"):
    sampler.generate(state, [list(range(17))], sp)
  with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside"):
    sampler.generate(state, [[CFG.vocab_size]], sp)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingParams(max_new_tokens=0)
  with pytest.raises(ValueError, match="stop_token_ids"):
    SamplingParams(stop_token_ids=("<eos>",))
  with pytest.raises(ValueError, match="stop_token_ids"):
    SamplingParams(stop_token_ids=(1.5,))
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-0.1)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=1.5)
  with pytest.raises(ValueError, match="group_size"):
    sampler.generate(state, [[1]], sp, group_size=0)
  with pytest.raises(ValueError, match="group_ids"):
    sampler.generate(state, [[1], [2]], sp, group_ids=[3])
  with pytest.raises(ValueError, match="precision"):
    Sampler(CFG, precision="int4")
  with pytest.raises(
      ValueError,
      match=r"params do not match model_config: parameter \['embed'\] has shape "
      r"\(512, 64\), the config's model expects \(512, 32\)",
  ):
    Sampler(get_preset("tiny", hidden_size=32), prompt_buckets=(8,)).generate(state, [[1]], sp)
  with pytest.raises(ValueError, match="13 parameter arrays, the config's model has 14"):
    Sampler(get_preset("tiny", tie_embeddings=False), prompt_buckets=(8,)).generate(state, [[1]], sp)


def test_new_param_values_do_not_recompile(state, sampler):
  a = sampler.generate(state, PROMPTS, TOPK, seed=0, group_size=2)
  traces, cache_size = sampler.trace_count, sampler.engine.program._cache_size()
  new_state = jax.tree.map(lambda x: x * 1.5, state)
  b = sampler.generate(new_state, [[3, 2], list(range(1, 13)), [7, 7, 7]], TOPK, seed=0, group_size=2, policy_version=7)
  assert sampler.trace_count == traces and sampler.engine.program._cache_size() == cache_size
  assert b.policy_version == 7 and not np.array_equal(a.behavior_logp, b.behavior_logp)


def test_prepared_params_reused_and_equal_to_raw(state, sampler):
  prepared = sampler.prepare_params(state)
  assert sampler.prepare_params(prepared) is prepared
  raw = sampler.generate(state, PROMPTS, TOPK, seed=4, group_size=2)
  for _ in range(2):  # reusable: generate does not donate or alter the prepared buffers
    again = sampler.generate(prepared, PROMPTS, TOPK, seed=4, group_size=2)
    np.testing.assert_array_equal(again.response_tokens, raw.response_tokens)
    np.testing.assert_array_equal(again.behavior_logp, raw.behavior_logp)
  with pytest.raises(ValueError, match=r"another precision \('fp32', this Sampler: 'bf16'\)"):
    Sampler(CFG, precision="bf16", prompt_buckets=(16,)).generate(prepared, PROMPTS, TOPK)
  with pytest.raises(ValueError, match=r"another ModelConfig \(rope_theta=.*, this Sampler: 500.0\)"):
    Sampler(CFG.replace(rope_theta=500.0), prompt_buckets=(16,)).generate(prepared, PROMPTS, TOPK)
  with pytest.raises(ValueError, match=r"another fuse_qkv \(True, this Sampler: False\)"):
    Sampler(CFG, prompt_buckets=(16,), fuse_qkv=False).generate(prepared, PROMPTS, TOPK)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_fused_qkv_samples_what_unfused_samples(state, precision):
  """The default fused q/k/v layout draws the same tokens with the same behavior log-probs as the learner's
  separate projections; under fp8 q, k and v keep their own scales (quantized, then fused), so the two stay
  equal there too."""
  got = {
      fuse: Sampler(CFG, precision=precision, prompt_buckets=(16,), fuse_qkv=fuse).generate(
          state, PROMPTS, TOPK, seed=4, group_size=2
      )
      for fuse in (False, True)
  }
  np.testing.assert_array_equal(got[True].response_tokens, got[False].response_tokens)
  np.testing.assert_allclose(got[True].behavior_logp, got[False].behavior_logp, atol=1e-5, rtol=0)


def test_group_ids_travel_and_rows_are_batch_independent(state, sampler):
  sp = TOPK
  b = sampler.generate(state, PROMPTS[:2], sp, seed=5, group_size=3, group_ids=[7, 42])
  np.testing.assert_array_equal(b.group_ids, [7, 7, 7, 42, 42, 42])
  np.testing.assert_array_equal(b.sample_index, [0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(b.prompt_tokens[3, -len(PROMPTS[1]) :], PROMPTS[1])
  alone = sampler.generate(state, PROMPTS[1:2], sp, seed=5, group_size=2, group_ids=[42])
  np.testing.assert_array_equal(alone.response_tokens, b.response_tokens[3:5])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_precision_modes_give_small_nonzero_mismatch(model, state, precision):
  s = Sampler(CFG, precision=precision, prompt_buckets=(16,))
  b = s.generate(state, PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16), seed=0, group_size=2)
  la, logp, _ = _learner_logp(model, b)
  m = la.response_mask
  delta = logp[m] - la.behavior_logp[m]  # log pi (fp32 learner) - log mu (sampler)
  k3 = float(np.mean(np.exp(delta) - 1 - delta))
  mean_abs = float(np.mean(np.abs(delta)))
  assert np.all(np.isfinite(delta))
  assert 1e-6 < mean_abs < 0.05 and 0 < k3 < 1e-2, (mean_abs, k3)


@pytest.mark.slow
def test_greedy_matches_transformers_generate(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from minpro_jax.models.hf_io import load_hf_checkpoint

  cfg = transformers.Qwen3Config(
      vocab_size=97,
      hidden_size=48,
      intermediate_size=80,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      rope_theta=5000.0,
      rms_norm_eps=1e-6,
      max_position_embeddings=256,
      tie_word_embeddings=True,
  )
  torch.manual_seed(0)
  hf = transformers.Qwen3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.copy_(
          1.0 + 0.2 * torch.randn_like(p)
          if name.endswith("norm.weight")
          else torch.randn_like(p) / np.sqrt(p.shape[-1])
      )
  hf.save_pretrained(str(tmp_path))
  model, config = load_hf_checkpoint(str(tmp_path))
  prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]
  new = 12
  ours = Sampler(config, prompt_buckets=(8,)).generate(
      model, prompts, SamplingParams(temperature=0.0, max_new_tokens=new)
  )
  for i, p in enumerate(prompts):  # one row at a time: HF generate without padding
    with torch.no_grad():
      out = hf.generate(
          torch.tensor([p]),
          max_new_tokens=new,
          min_new_tokens=new,
          do_sample=False,
          use_cache=True,
          eos_token_id=None,
          pad_token_id=0,
      )
    np.testing.assert_array_equal(ours.response_tokens[i], out[0, len(p) :].numpy())


@pytest.mark.parametrize("layout", [{"data": 2, "tensor": 4}, {"fsdp": 8}], ids=["data2-tensor4", "fsdp8"])
def test_sharded_sampler_equals_single_device(model, state, sampler, layout):
  """On an 8-device mesh (parameters created sharded), the per-layer sampler gives the single-device tokens
  and behavior log-probs: the unstacking and per-layer KV caches keep working under GSPMD."""
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh(layout)
  sharded_state = nnx.split(init_model(CFG, seed=3, mesh=mesh))[1]
  assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(sharded_state))
  want = sampler.generate(state, PROMPTS, TOPK, seed=4, group_size=2)
  got = Sampler(CFG, prompt_buckets=(8, 16), mesh=mesh).generate(sharded_state, PROMPTS, TOPK, seed=4, group_size=2)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)


def _decode_hlo(sampler, state, sp):
  """Optimized HLO text of the sampler's decode loop for PROMPTS (bucket 16)."""
  prepared = sampler.prepare_params(state).state
  b = 4
  args = (
      np.ones((b, 16), np.int32),
      np.ones((b, 16), np.int32),
      jax.random.split(jax.random.key(0), b),
      np.ones(b, bool),
  )
  with sampler.mesh_context():
    st = sampler.engine.prefill(prepared, *args, sampling=sp)
    return prepared, sampler.engine.decode.lower(prepared, st, sampling=sp, cache_offset=16).compile().as_text()


def test_fused_qkv_keeps_the_tensor_split():
  """On {data: 4, tensor: 2} the fused q/k/v matrix stays split over `tensor` like the unfused ones, and the
  decode loop gathers no weight; on {data: 2, tensor: 4} the tensor split (4) does not divide the 2 KV heads,
  so the sampler keeps the unfused layout instead of replicating a fused matrix."""
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh({"data": 4, "tensor": 2})
  sharded_state = nnx.split(init_model(CFG, seed=3, mesh=mesh))[1]
  sp = SamplingParams(temperature=0.0, max_new_tokens=4)
  hlo = {}
  for fuse in (False, True):
    s = Sampler(CFG, prompt_buckets=(16,), mesh=mesh, fuse_qkv=fuse, engine="static")
    assert s.config.fuse_qkv == fuse
    prepared, hlo[fuse] = _decode_hlo(s, sharded_state, sp)
  layer = prepared["layers"][0]
  assert "tensor" in str(layer["attn"]["qkv_proj"].sharding.spec), layer["attn"]["qkv_proj"].sharding
  assert hlo[False].count("all-gather(") == 0  # the reference: the unfused decode gathers nothing
  assert hlo[True].count("all-gather(") == 0
  assert not Sampler(CFG, prompt_buckets=(16,), mesh=make_mesh({"data": 2, "tensor": 4})).config.fuse_qkv


def test_a_policy_trained_with_remat_samples_like_one_without(model, state):
  """The sampler drops the learner's remat (a remat block cannot write the KV cache; inference keeps no activations
  for a backward): the paper configs' remat="block" once failed in decode. Found by compiling them ahead of time."""
  want = Sampler(CFG, prompt_buckets=(16,)).generate(state, PROMPTS, TOPK, seed=4)
  got = Sampler(CFG.replace(remat="block"), prompt_buckets=(16,)).generate(state, PROMPTS, TOPK, seed=4)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-6)
