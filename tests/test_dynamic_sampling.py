"""DAPO's sampling rules: dynamic sampling (`sampling.drop_equal_reward_groups`, `minpro_jax.rl.dynamic_sampling`)
and overlong filtering (`reward.mask_truncated`)."""

import dataclasses
import logging

import numpy as np
import pytest
from train_helpers import coin_grade, make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.rl.dynamic_sampling import Round, choose_groups, fill_informative, take_groups, unequal_groups
from minpro_jax.run import resume_check, run_config
from minpro_jax.sampling.batch import GenerationBatch


def test_unequal_groups_and_choice_by_hand():
  assert unequal_groups(np.array([1, 1, 0, 1, 0, 0, 0.5, 0.5]), 2).tolist() == [False, True, False, False]
  assert unequal_groups(np.array([1, 0, 1, 1, 1, 1]), 3).tolist() == [True, False]
  with pytest.raises(ValueError, match="do not split into groups of group_size=4"):
    unequal_groups(np.zeros(6), 4)
  masks = [np.array([False, True, False]), np.array([True, False, True])]
  assert choose_groups(masks, 3) == ([(0, 1), (1, 0), (1, 2)], 0)
  assert choose_groups(masks, 2) == ([(0, 1), (1, 0)], 0)  # the surplus informative group is dropped
  assert choose_groups([np.array([False, True, False])], 3) == ([(0, 1), (0, 0), (0, 2)], 2)  # two fillers


def _gen(prompt_width: int, response_width: int, groups: int, group_size: int, tag: int, routes: bool = False):
  n = groups * group_size
  rows = np.arange(n)[:, None]
  return GenerationBatch(
      prompt_tokens=np.full((n, prompt_width), tag, np.int32) + rows,
      prompt_mask=np.ones((n, prompt_width), bool),
      response_tokens=np.full((n, response_width), 10 * tag, np.int32) + rows,
      response_mask=np.ones((n, response_width), bool),
      behavior_logp=np.full((n, response_width), -0.5, np.float32),
      entropy=np.ones((n, response_width), np.float32),
      lengths=np.full(n, response_width, np.int32),
      finish_reason=np.array(["stop"] * n),
      group_ids=np.repeat(np.arange(groups) + 100 * tag, group_size),
      sample_index=np.tile(np.arange(group_size), groups).astype(np.int32),
      policy_version=7,
      routes=np.zeros((n, response_width, 1, 2), np.int16) if routes else None,
      kept_logp_threshold=np.full((n, response_width), -2.0, np.float32) + rows if routes else None,
  )


def test_take_groups_pads_rounds_of_other_widths():
  a, b = _gen(2, 3, 2, 2, tag=1, routes=True), _gen(3, 4, 2, 2, tag=2, routes=True)
  out = take_groups([a, b], [(1, 1), (0, 0)], group_size=2, pad_id=0)
  assert out.prompt_tokens.shape == (4, 3) and out.response_tokens.shape == (4, 4)
  # round 1's group 1 (rows 2, 3), then round 0's group 0 (rows 0, 1), left-padded prompt, right-padded response
  np.testing.assert_array_equal(out.prompt_tokens, [[4, 4, 4], [5, 5, 5], [0, 1, 1], [0, 2, 2]])
  np.testing.assert_array_equal(out.prompt_mask[2:], [[False, True, True]] * 2)
  np.testing.assert_array_equal(out.response_tokens[2:], [[10, 10, 10, 0], [11, 11, 11, 0]])
  np.testing.assert_array_equal(out.response_mask[2:, 3], [False, False])
  assert out.behavior_logp[2, 3] == 0.0 and out.entropy[2, 3] == 0.0 and out.routes[2, 3, 0, 0] == -1
  np.testing.assert_array_equal(out.kept_logp_threshold[:, 0], [0.0, 1.0, -2.0, -1.0])  # the chosen rows' own
  assert out.kept_logp_threshold[2, 3] == -np.inf
  assert out.group_ids.tolist() == [201, 201, 100, 100] and out.policy_version == 7
  with pytest.raises(ValueError, match="share one policy version"):
    take_groups([a, dataclasses.replace(b, policy_version=8)], [(0, 0)], 2, 0)


def test_fill_informative_samples_rounds_until_full_then_fills():
  g = 2
  rewards = {0: [1, 1, 0, 1, 0, 0], 1: [1, 0, 0, 0, 1, 1], 2: [0, 0, 0, 0, 0, 0]}

  def round_(k):
    gen = _gen(2, 3, 3, g, tag=k + 1)
    r = np.asarray(rewards.get(k, [0] * 6), np.float32)
    return Round(gen, [f"r{k}s{i}" for i in range(6)], r, {"no_answer": k})

  calls = []
  sample = lambda k: calls.append(k) or round_(k)  # noqa: E731
  filled, metrics = fill_informative(round_(0), sample, group_size=g, max_rounds=2, pad_id=0)
  assert calls == [1]  # round 0 has 1 informative group of 3, round 1 one more: the cap of 2 rounds is reached
  assert metrics == {
      "dynamic/rounds": 2,
      "dynamic/equal_frac": 4 / 6,
      "dynamic/filler_groups": 1,
      "dynamic/out_of_data": 0,
  }
  assert filled.texts == ["r0s2", "r0s3", "r1s0", "r1s1", "r0s0", "r0s1"]  # informative first, then the filler
  assert filled.rewards.tolist() == [0, 1, 1, 0, 1, 1]
  assert filled.gen.group_ids.tolist() == [100, 100, 101, 101, 102, 102]  # the step's own group ids
  assert filled.stats == {"no_answer": 1}
  calls.clear()
  filled, metrics = fill_informative(round_(0), sample, group_size=g, max_rounds=5, pad_id=0)
  assert calls == [1, 2, 3, 4] and metrics["dynamic/filler_groups"] == 1  # rounds 2.. give nothing informative
  assert metrics["dynamic/out_of_data"] == 0
  filled, metrics = fill_informative(round_(0), lambda k: None, group_size=g, max_rounds=5, pad_id=0)
  assert metrics["dynamic/rounds"] == 1 and metrics["dynamic/out_of_data"] == 1
  assert metrics["dynamic/filler_groups"] == 2 and filled.texts == ["r0s2", "r0s3", "r0s0", "r0s1", "r0s4", "r0s5"]


def test_a_step_with_no_informative_group_warns_once(caplog):
  """Every round's groups have equal rewards: the batch is all filler (no gradient) and the log says so, once."""
  g = 2

  def flat(k, rewards=(1, 1, 0, 0, 1, 1)):
    return Round(_gen(2, 3, 3, g, tag=k + 1), [f"r{k}s{i}" for i in range(6)], np.asarray(rewards, np.float32), {})

  with caplog.at_level(logging.WARNING, logger="minpro_jax"):
    _, metrics = fill_informative(flat(0), flat, group_size=g, max_rounds=4, pad_id=0)
  assert metrics["dynamic/rounds"] == 4 and metrics["dynamic/filler_groups"] == 3
  warned = [r for r in caplog.records if "drop_equal_reward_groups" in r.getMessage()]
  assert (
      len(warned) == 1 and "none of the 12 groups sampled in 4 round(s) has unequal rewards" in warned[0].getMessage()
  )
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="minpro_jax"):  # one informative group: no warning
    fill_informative(flat(0, (1, 0, 0, 0, 1, 1)), lambda k: None, group_size=g, max_rounds=5, pad_id=0)
  assert "drop_equal_reward_groups" not in caplog.text


def test_trainer_drops_equal_groups_and_masks_truncated(tmp_path, monkeypatch):
  import jax
  from flax import nnx

  from minpro_jax.run.trainer import Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  ov = tiny_overrides(tmp_path, **{"sft.enabled": False, "sampling.drop_equal_reward_groups": True})
  trainer = Trainer.from_config(make_config(ov))
  state = trainer.learner.init_state(jax.tree.map(lambda x: x, nnx.split(trainer.model)[1]))
  loader_state = trainer.loader.get_state()
  p, g = trainer.c.prompts_per_step, trainer.c.group_size
  batch, m = trainer.sample_step(state, 0)
  rounds, fillers = m["dynamic/rounds"], m["dynamic/filler_groups"]
  assert 1 <= rounds <= 4 and m["dynamic/equal_frac"] > 0
  informative = unequal_groups(batch.rewards, g)
  assert informative.sum() == p - fillers and not informative[p - fillers :].any()  # fillers come last
  assert m["advantage/zero_frac"] == fillers / p  # 0/1 rewards in groups of 2: only fillers have zero advantage
  assert batch.group_ids.tolist() == np.repeat(np.arange(p), g).tolist()
  # the loader moved on by one batch of prompts per round; the first round is the plain step's
  trainer.loader.set_state(loader_state)
  for _ in range(rounds):
    next(trainer.loader)
  assert trainer.loader.get_state() != loader_state
  # with no batch to spare (the remaining global steps need every one left) a step samples one round and fills
  trainer.loader.set_state(loader_state)
  total = trainer.c.total_steps
  trainer.c.total_steps = trainer.loader.remaining
  _, m1 = trainer.sample_step(state, 0)
  assert m1["dynamic/rounds"] == 1 and m1["dynamic/out_of_data"] == int(m1["dynamic/filler_groups"] > 0)
  assert trainer.loader.remaining == trainer.c.total_steps - 1
  trainer.c.total_steps = total
  trainer.loader.set_state(loader_state)
  trainer.c.sampling.drop_equal_reward_groups = False
  trainer.c.reward.mask_truncated = True
  plain, m2 = trainer.sample_step(state, 0)
  assert "dynamic/rounds" not in m2
  # the dynamic batch starts with the plain step's informative groups (its first round), in order
  ours = np.flatnonzero(unequal_groups(plain.rewards, g))[:p]
  rows = np.concatenate([np.arange(i * g, (i + 1) * g) for i in ours])
  np.testing.assert_array_equal(batch.rewards[: rows.size], plain.rewards[rows])
  np.testing.assert_array_equal(batch.response_lengths[: rows.size], plain.response_lengths[rows])
  # overlong filtering: rows that ran out of tokens get an empty response mask, after their advantages were computed
  trainer.loader.set_state(loader_state)
  problems = next(trainer.loader)
  gen = trainer.generate(state.params, problems, trainer.sampling, 0, g, group_ids=np.arange(p), policy_version=0)
  finish = np.array(["length", "stop"] * (p * g // 2))  # the untrained model never stops: mark half the rows
  gen = dataclasses.replace(gen, finish_reason=finish)
  rewards = np.tile([1.0, 0.0], p * g // 2).astype(np.float32)
  graded = ([""] * (p * g), rewards, {"no_answer": 0, "timeout": 0})
  masked, _, _ = trainer.rollout(state, gen, problems, g, score=False, graded=graded)
  trainer.c.reward.mask_truncated = False
  kept, _, _ = trainer.rollout(state, gen, problems, g, score=False, graded=graded)
  assert masked.truncated.tolist() == [True, False] * (p * g // 2)
  assert not masked.response_mask[masked.truncated].any()
  np.testing.assert_array_equal(masked.response_mask[~masked.truncated], kept.response_mask[~kept.truncated])
  np.testing.assert_array_equal(masked.advantages, kept.advantages)  # the truncated rows' rewards still count
  assert np.abs(kept.advantages).min() > 0
  trainer.close()


def test_config_and_resume_fields():
  c = make_config({"sampling.drop_equal_reward_groups": True, "group_size": 1})
  with pytest.raises(ConfigError, match="sampling.drop_equal_reward_groups: a group of group_size=1"):
    run_config.validate_config(c)
  c = make_config({"sampling.max_sampling_rounds": 0})
  with pytest.raises(ConfigError, match="sampling.max_sampling_rounds"):
    run_config.validate_config(c)
  # a checkpoint from before these fields resumes under their defaults, and only under them
  c = make_config({})
  stored = resume_check.resume_fingerprint(c)
  del stored["sampling.drop_equal_reward_groups"], stored["sampling.max_sampling_rounds"]
  del stored["reward"]["mask_truncated"]
  resume_check.check_resume(c, stored, "w")
  c.reward.mask_truncated = True
  with pytest.raises(ConfigError, match=r"different reward\.mask_truncated"):
    resume_check.check_resume(c, stored, "w")
