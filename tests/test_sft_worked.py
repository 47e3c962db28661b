"""Worked-step SFT targets (config.sft.target=worked): the target by hand, the cache keys, the refusals."""

import dataclasses
import hashlib
import os

import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax.data.records import MathProblem
from minpro_jax.data.rewards import math_reward
from minpro_jax.data.sources import reasoning_gym_problems
from minpro_jax.data.worked import chain_sum_steps, check_sft_target, worked_steps
from minpro_jax.errors import ConfigError
from minpro_jax.rl.sft import SFTConfig, build_examples, cache_key, run_key, sft_target
from minpro_jax.run import run_setup
from minpro_jax.run.run_config import validate_config

EIGHT_TERMS = {"min_terms": 8, "max_terms": 8, "min_digits": 1, "max_digits": 2}


def test_chain_sum_steps_by_hand():
  assert chain_sum_steps({"expression": "2 - 3 + 2 - 5 + 9"}) == ("2-3=-1 -1+2=1 1-5=-4 -4+9=5", 5)
  assert chain_sum_steps({"expression": "4 - -3 + -10"}) == ("4-(-3)=7 7+(-10)=-3", -3)  # allow_negation terms
  assert chain_sum_steps({"expression": "17"}) == ("", 17)
  for bad in ({}, {"expression": "2 * 3"}, {"expression": "2 +"}, {"expression": "2 + x"}):
    with pytest.raises(ValueError, match="chain_sum"):
      chain_sum_steps(bad)


def test_the_worked_target_of_a_known_generated_problem():
  p = reasoning_gym_problems("chain_sum", 2, 0, **EIGHT_TERMS)[1]
  assert p.metadata["expression"] == "4 - 1 + 7 - 7 - 7 + 6 - 3 - 1" and p.answer == "-2"
  steps = worked_steps(p)
  assert steps == "4-1=3 3+7=10 10-7=3 3-7=-4 -4+6=2 2-3=-1 -1-1=-2"
  assert sft_target(p.answer, True, steps) == " 4-1=3 3+7=10 10-7=3 3-7=-4 -4+6=2 2-3=-1 -1-1=-2 \\boxed{-2}"
  assert sft_target(p.answer, False, steps) == " " + steps
  assert sft_target(p.answer) == " \\boxed{-2}" and sft_target(p.answer, False) == " -2"  # answer: unchanged


def test_the_grader_reads_the_boxed_answer_of_a_worked_target_and_not_the_bare_one():
  steps = "2-3=-1 -1+2=1 1-5=-4 -4+9=5"
  assert math_reward(sft_target("5", True, steps), "5", mode="integer") == 1.0
  assert math_reward(sft_target("5", True, steps), "-4", mode="integer") == 0.0  # an intermediate result is no answer
  assert math_reward(sft_target("5", False, steps), "5", mode="integer") == 0.0  # bare: not credited, as " 5" is not


def test_worked_steps_refuse_an_untraced_problem_and_a_trace_that_misses_the_answer():
  meta = {"expression": "2 + 3"}
  with pytest.raises(ValueError, match="has no trace"):
    worked_steps(MathProblem("a", "2 + 3 =", "5", "reasoning_gym/basic_arithmetic", meta))
  with pytest.raises(ValueError, match="has no trace"):
    worked_steps(MathProblem("b", "2 + 3 =", "5", "gsm8k", meta))
  with pytest.raises(ValueError, match="reaches 5, its answer is '6'"):
    worked_steps(MathProblem("c", "2 + 3 =", "6", "reasoning_gym/chain_sum", meta))


class _CharTokenizer:
  eos_id = 1

  def encode(self, text, add_bos=False):
    return [2 + ord(ch) % 50 for ch in text]


def test_build_examples_with_steps_and_the_cache_key():
  answers, steps = ["5", "-3"], ["2-3=-1 -1+2=1 1-5=-4 -4+9=5", "4-(-3)=7 7+(-10)=-3"]
  tok = _CharTokenizer()
  plain = build_examples([[7, 8], [9]], answers, tok, 64)
  worked = build_examples([[7, 8], [9]], answers, tok, 64, steps=steps)
  mask = worked[2]
  assert mask[0].sum() == len(sft_target("5", True, steps[0])) + 1  # response tokens + eos, nothing else
  assert list(worked[0][0, 2 : 2 + mask[0].sum()]) == tok.encode(sft_target("5", True, steps[0])) + [1]
  resp = tok.encode(" \\boxed{-3}") + [1]
  assert list(plain[0][1, : 1 + len(resp)]) == [9, *resp] and plain[2][1].sum() == len(resp)
  with pytest.raises(ValueError, match="steps has 1 entries for 2 answers"):
    build_examples([[7, 8], [9]], answers, tok, 64, steps=steps[:1])
  # The key of the answer target: its parts are what they always were (pinned), so the default config's cached
  # warm start and committed results still match; worked examples give another key, and so does the target part.
  cfg = SFTConfig()
  parts = {"model": "m", "source": "scratch", "path": ""}
  before = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "row_tokens"}  # the fields before packing
  want = cache_key({"cfg": before, **parts, "n": 2, "tokens_sha": hashlib.sha256(plain[0].tobytes()).hexdigest()})
  assert run_key(cfg, plain[0], parts) == want == "813ede125557ffc8"
  assert run_key(cfg, worked[0], parts) != want
  assert run_key(cfg, worked[0], {**parts, "target": "worked"}) != run_key(cfg, worked[0], parts)


def test_sft_key_parts_add_the_target_only_for_worked(tmp_path):
  class _Model:
    config = "cfg"

  answer = run_setup.sft_key_parts(make_config(tiny_overrides(tmp_path)), _Model())
  assert answer == {"model": "'cfg'", "source": "scratch", "path": ""}  # the parts the default always hashed
  worked = run_setup.sft_key_parts(make_config(tiny_overrides(tmp_path, **{"sft.target": "worked"})), _Model())
  assert worked == {**answer, "target": "worked"}


def test_tokenizer_corpus_and_sft_examples_follow_the_target(tmp_path):
  ov = tiny_overrides(tmp_path, **{f"data.task_config.{k}": v for k, v in EIGHT_TERMS.items()})
  ov["data.size"] = 300
  answer, worked = make_config(ov), make_config({**ov, "sft.target": "worked"})
  problems, _ = run_setup.train_and_eval_problems(worked)
  tok_a = run_setup.build_tokenizer(answer, problems)
  tok_w = run_setup.build_tokenizer(worked, problems)
  assert len([f for f in os.listdir(tmp_path / "cache") if f.startswith("spm-")]) == 2  # two corpora, two models
  steps = run_setup.sft_steps(worked, problems[:3])
  assert steps == [worked_steps(p) for p in problems[:3]] and run_setup.sft_steps(answer, problems[:3]) == [""] * 3
  text = sft_target(problems[0].answer, True, steps[0])
  assert tok_w.decode(tok_w.encode(text)) == text
  assert tok_w.encode(text) != tok_a.encode(text)  # another corpus, another model


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"data.task": "basic_arithmetic"}, r"data\.task='basic_arithmetic' has none"),
        ({"data.source": "champ"}, r"data\.source='champ' has none"),
    ],
)
def test_worked_target_without_a_trace_is_refused_before_any_work(tmp_path, overrides, match):
  c = make_config(tiny_overrides(tmp_path, **{"sft.target": "worked", **overrides}))
  with pytest.raises(ConfigError, match=rf"^config\.sft\.target: 'worked' needs .*{match}.*set sft\.target=answer"):
    validate_config(c, num_devices=1)
  with pytest.raises(ConfigError, match=r"config\.sft\.target"):
    run_setup.setup_run(c)  # validated first: no tokenizer, no model
  assert not (tmp_path / "cache").exists()


def test_unknown_target_and_the_resume_check():
  from minpro_jax.run.resume_check import check_resume, resume_fingerprint

  with pytest.raises(ConfigError, match=r"config\.sft\.target: 'steps'; choose one of \('answer', 'worked'\)"):
    check_sft_target("steps", make_config({}).data)
  c = make_config({})
  stored = resume_fingerprint(c)
  assert stored["sft.target"] == "answer"
  check_resume(c, {k: v for k, v in stored.items() if k != "sft.target"}, "runs/x")  # a checkpoint from before
  with pytest.raises(ConfigError, match=r"sft\.target"):
    check_resume(make_config({"sft.target": "worked"}), stored, "runs/x")
