"""The SFT warm start by value: the rows and masks of a hand-written batch, the boxed fraction, and the loss against
a naive log-softmax over hand-listed response positions (prompt and padding add nothing); packed steps by hand and
against unpacked ones."""

import hashlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.rl.sft import PACK_ROWS_MULTIPLE, SFTConfig, build_examples, pack_step, run_sft, sft_loss

EOS = 1
CHARS = {" ": 10, "\\": 11, "b": 12, "o": 13, "x": 14, "e": 15, "d": 16, "{": 17, "}": 18}
CHARS.update({str(d): 20 + d for d in range(10)})
BOXED = [10, 11, 12, 13, 14, 15, 16, 17]  # " \boxed{"


class _Tokenizer:
  """One token per character, ids from `CHARS`."""

  eos_id = EOS

  def encode(self, text, add_bos=False):
    return [CHARS[ch] for ch in text]


def test_rows_masks_and_segments_by_hand():
  # seed 0 draws [0.637, 0.270] for the two examples: at boxed_fraction 0.5 the first is bare, the second boxed
  tokens, seg, mask = build_examples([[3, 4, 5], [6]], ["7", "12"], _Tokenizer(), 16, boxed_fraction=0.5, seed=0)
  assert tokens.dtype == np.int32 and tokens.shape == seg.shape == mask.shape == (2, 16)
  assert tokens[0].tolist() == [3, 4, 5, 10, 27, EOS] + [0] * 10  # prompt, " 7", eos, padding
  assert tokens[1].tolist() == [6, *BOXED, 21, 22, 18, EOS] + [0] * 3  # prompt, " \boxed{12}", eos, padding
  assert mask[0].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 10  # the prompt and the padding are not learned
  assert mask[1].tolist() == [0] + [1] * 12 + [0] * 3
  assert seg[0].tolist() == [1] * 6 + [0] * 10 and seg[1].tolist() == [1] * 13 + [0] * 3


def test_a_row_longer_than_max_len_is_dropped_and_none_fitting_is_refused():
  tokens, _, mask = build_examples([[3], [6, 7, 8, 9]], ["7", "7"], _Tokenizer(), 12)
  assert tokens.tolist() == [[3, *BOXED, 27, 18, EOS]]  # 12 tokens fit; the second row needs 15
  assert mask.sum() == 11
  with pytest.raises(ValueError, match="no example fits max_len=8; the shortest takes 12 tokens"):
    build_examples([[3], [6, 7, 8, 9]], ["7", "7"], _Tokenizer(), 8)
  with pytest.raises(ValueError, match="no example fits max_len=12; the shortest takes 15 tokens"):  # worked steps
    build_examples([[3], [6, 7, 8, 9]], ["7", "7"], _Tokenizer(), 12, steps=["77", "77"])


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_the_boxed_fraction_is_honoured(fraction):
  n = 1000
  tokens, _, _ = build_examples([[3]] * n, ["7"] * n, _Tokenizer(), 16, boxed_fraction=fraction, seed=3)
  boxed = np.all(tokens[:, :12] == [3, *BOXED, 27, 18, EOS], axis=1)  # prompt, " \boxed{7}", eos
  bare = np.all(tokens[:, :4] == [3, 10, 27, EOS], axis=1)  # prompt, " 7", eos
  assert np.all(boxed ^ bare)  # every row is one of the two targets
  want = np.random.default_rng(3).random(n) < fraction  # the documented draw: 253 of 1000 at 0.25
  np.testing.assert_array_equal(boxed, want)
  assert boxed.sum() == {0.0: 0, 0.25: 253, 1.0: n}[fraction]
  with pytest.raises(ValueError, match="boxed_fraction must lie in"):
    build_examples([[3]], ["7"], _Tokenizer(), 16, boxed_fraction=1.5)


def _model():
  kw = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  return init_model(get_preset("tiny", **kw), seed=0)


def _naive_loss(model, tokens, seg, positions):
  """Mean of -log softmax(logits[b, t - 1])[tokens[b, t]] over the hand-listed (b, t), from the full logits."""
  logits = np.asarray(model(jnp.asarray(tokens), None, jnp.asarray(seg)).out, np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return -np.mean([logits[b, t - 1, tokens[b, t]] - logz[b, t - 1] for b, t in positions])


def test_the_loss_is_the_nll_of_the_response_tokens_only():
  model = _model()
  tokens, seg, mask = build_examples([[3, 4, 5], [6]], ["7", "12"], _Tokenizer(), 16, boxed_fraction=0.5, seed=0)
  response = [(0, 3), (0, 4), (0, 5)] + [(1, t) for t in range(1, 13)]  # from the rows written out above
  loss = float(sft_loss(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(mask)))
  assert loss == pytest.approx(_naive_loss(model, tokens, seg, response), rel=1e-5)
  everything = [(b, t) for b in range(2) for t in range(1, 16) if seg[b, t]]  # prompt tokens learned too: differs
  assert abs(loss - _naive_loss(model, tokens, seg, everything)) > 1e-3
  other_pad = np.where(seg == 0, 9, tokens)  # what sits in the padding does not matter
  assert float(sft_loss(model, jnp.asarray(other_pad), jnp.asarray(seg), jnp.asarray(mask))) == pytest.approx(loss)
  assert float(sft_loss(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.zeros_like(mask))) == 0.0


def test_sft_reports_the_loss_of_its_last_batch_and_lowers_it():
  model = _model()
  tokens, seg, mask = build_examples([[3, 4, 5], [6]], ["7", "12"], _Tokenizer(), 16, boxed_fraction=0.5, seed=0)
  start = float(sft_loss(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(mask)))
  # two steps on the whole batch; the warm-up starts at lr 0, so the second step still sees the starting parameters
  cfg = SFTConfig(steps=2, batch_size=2, learning_rate=1e-2, max_len=16)
  params, info = run_sft(model, tokens, seg, mask, cfg, log_every=1)
  assert info["final_loss"] == pytest.approx(start, rel=1e-6) and info["cached"] is False
  after = float(sft_loss(nnx.merge(nnx.graphdef(model), params), jnp.asarray(tokens), jnp.asarray(seg), mask))
  assert after < start


def test_packed_rows_by_hand():
  # lengths 6 and 13 (the rows written out above) and 12: first-fit decreasing into rows of 20 tokens puts 13 in
  # row 0, 12 in row 1, then 6 after the 13; 2 used rows round up to PACK_ROWS_MULTIPLE
  tokens, seg, mask = build_examples([[3, 4, 5], [6], [3]], ["7", "12", "7"], _Tokenizer(), 16, boxed_fraction=0.5)
  assert seg.sum(1).tolist() == [6, 13, 12]
  ptok, pseg, pmask = pack_step(tokens, seg, mask, 20)
  assert ptok.shape == pseg.shape == pmask.shape == (PACK_ROWS_MULTIPLE, 20)
  assert pseg[0].tolist() == [1] * 13 + [2] * 6 + [0] and pseg[1].tolist() == [1] * 12 + [0] * 8
  assert not pseg[2:].any() and not pmask[2:].any() and not ptok[2:].any()
  assert ptok[0, :13].tolist() == tokens[1, :13].tolist() and ptok[0, 13:19].tolist() == tokens[0, :6].tolist()
  assert pmask[0].tolist() == mask[1, :13].tolist() + mask[0, :6].tolist() + [False]


def test_packed_sft_equals_unpacked():
  """Two steps of packed SFT give the unpacked loss and parameters up to float rounding; the cache key of an
  unpacked run is the one from before `row_tokens` existed, and packing changes it."""
  import dataclasses

  from minpro_jax.rl.sft import cache_key, run_key

  model = _model()
  prompts, answers = [[3, 4, 5], [6], [3], [6, 3]] * 2, ["7", "12", "7", "127"] * 2
  tokens, seg, mask = build_examples(prompts, answers, _Tokenizer(), 16, boxed_fraction=0.5, seed=1)
  got = {}
  for w in (0, 40):
    cfg = SFTConfig(steps=3, batch_size=4, learning_rate=1e-2, max_len=16, row_tokens=w)
    got[w] = run_sft(model, tokens, seg, mask, cfg, log_every=1)
  (p0, i0), (p1, i1) = got[0], got[40]
  assert i1["final_loss"] == pytest.approx(i0["final_loss"], rel=1e-5)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
  unpacked = SFTConfig(max_len=16)
  old = {k: v for k, v in dataclasses.asdict(unpacked).items() if k != "row_tokens"}
  sha = hashlib.sha256(tokens.tobytes()).hexdigest()
  assert run_key(unpacked, tokens) == cache_key({"cfg": old, "n": 8, "tokens_sha": sha})
  assert run_key(dataclasses.replace(unpacked, row_tokens=40), tokens) != run_key(unpacked, tokens)


def test_targets_longer_than_the_response_budget_are_named():
  from minpro_jax.rl.sft import long_target_warning

  _, _, mask = build_examples([[3, 4, 5], [6]], ["7", "12"], _Tokenizer(), 16, boxed_fraction=0.5, seed=0)
  assert mask.sum(1).tolist() == [3, 12]  # " 7" + eos, " \boxed{12}" + eos
  assert long_target_warning(mask, 12) is None
  assert long_target_warning(mask, 11) == (
      "1 of 2 warm-start targets (with their eos) are longer than sampling.max_new_tokens=11 (longest 12 tokens): "
      "the sampler cuts such responses before their answer; raise sampling.max_new_tokens to at least 12"
  )


def test_sft_is_off_by_default_for_a_pretrained_source(caplog):
  """A run from an export (model.source=hf) or a GGUF starts RL from the loaded policy: no SFT unless asked for."""
  from train_helpers import load_default_config

  from minpro_jax.run.run_config import sft_enabled
  from minpro_jax.run.run_setup import warm_start

  c = load_default_config()
  assert c.sft.enabled is None and sft_enabled(c)  # scratch: on
  for source in ("hf", "gguf"):
    c.model.source = source
    assert not sft_enabled(c)
    with caplog.at_level(logging.INFO, logger="minpro_jax"):
      assert warm_start(c, None, None, []) == {"enabled": False}  # nothing is built or trained
    assert f"sft: off for model.source={source} (a pretrained model starts RL as it is)" in caplog.text
    caplog.clear()
  c.sft.enabled = True
  assert sft_enabled(c)  # asked for: on
  c.model.source, c.sft.enabled = "scratch", False
  assert not sft_enabled(c)
  with caplog.at_level(logging.INFO, logger="minpro_jax"):
    assert warm_start(c, None, None, []) == {"enabled": False}
  assert "sft: off" not in caplog.text  # turned off by hand: nothing to explain


@pytest.mark.slow
def test_the_sft_warm_start_raises_held_out_accuracy(tmp_path):
  """The default task (chain_sum, single-digit terms to keep it small): the scratch model answers no held-out problem
  (greedy), the SFT warm start of the run's setup makes it answer about half (0.0 -> 0.49 on AMD EPYC, 2026-12-07),
  not only a falling loss."""
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.run.trainer import Trainer

  scores = {}
  for sft in (False, True):
    ov = tiny_overrides(
        tmp_path,
        workdir=str(tmp_path / f"run_{sft}"),
        **{"sft.enabled": sft, "sft.steps": 600, "sft.batch_size": 32, "sft.learning_rate": 1e-2},
        **{"sft.num_examples": 1000, "sft.boxed_fraction": 1.0, "data.size": 2000, "sampling.max_new_tokens": 10},
        **{"eval.num_problems": 48, "eval.n": 2, "eval.temperature": 0.0},
        **{"data.task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
    )
    trainer = Trainer.from_config(make_config(ov))
    try:
      assert trainer.sft_info["enabled"] is sft
      scores[sft] = trainer.evaluate(nnx.split(trainer.model)[1], 0, "start")["macro"]["pass@1"]
    finally:
      trainer.close()
  assert scores[False] < 0.05 and scores[True] >= 0.25 and scores[True] >= scores[False] + 0.2, scores
