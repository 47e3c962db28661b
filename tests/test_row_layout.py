"""Per-process batches (`minpro_jax.runtime.row_layout`) and the step metrics from per-process rows
(`minpro_jax.rl.rollout_metrics`) in one process; tests/test_multihost.py runs them in two."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from minpro_jax.errors import ConfigError
from minpro_jax.rl import aggregation, rollout_metrics
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime import row_layout
from minpro_jax.runtime.sharding import make_mesh
from minpro_jax.sampling.batch import GenerationBatch


def test_each_process_owns_whole_groups_in_order_by_hand():
  # 6 prompts x 4 samples over 3 processes: 2 prompts, 8 rows each
  assert [row_layout.process_prompts(6, i, 3) for i in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
  assert [row_layout.process_group_rows(6, 4, i, 3) for i in range(3)] == [slice(0, 8), slice(8, 16), slice(16, 24)]
  group_of_row = np.arange(6).repeat(4)  # prompt-major rows
  for i in range(3):
    owned = group_of_row[row_layout.process_group_rows(6, 4, i, 3)]
    assert set(owned) == set(range(6)[row_layout.process_prompts(6, i, 3)])  # whole groups, nobody else's
  assert row_layout.process_group_rows(5, 3, 0, 1) == slice(0, 15)  # one process owns everything
  assert row_layout.process_group_rows(5, 3) == slice(0, 15)  # this (single) process


def test_prompts_that_do_not_split_over_the_processes_name_both():
  with pytest.raises(ConfigError, match=r"config.prompts_per_step: 6 prompts .* over the run's 4 processes") as e:
    row_layout.process_group_rows(6, 2, 1, 4)
  assert "use a multiple of 4, e.g. 4 or 8" in str(e.value)
  with pytest.raises(ValueError, match="process index 2 not in"):
    row_layout.process_prompts(4, 2, 2)


def test_global_rows_places_the_rows_sharded_over_the_batch_axes():
  mesh = make_mesh({"data": 2, "fsdp": 4})
  sharding = row_layout.batch_sharding(mesh, ("data", "fsdp"))
  assert row_layout.process_blocks(sharding, 16) == [(0, 16)]
  row_layout.check_layout(sharding, 4, 4)
  tokens = np.arange(48, dtype=np.int32).reshape(16, 3)
  placed = row_layout.global_rows({"tokens": tokens, "rewards": tokens[:, 0] / 2.0}, sharding, 16)
  assert placed["tokens"].sharding == sharding and len(placed["tokens"].addressable_shards) == 8
  assert [s.data.shape for s in placed["tokens"].addressable_shards] == [(2, 3)] * 8
  np.testing.assert_array_equal(np.asarray(placed["tokens"]), tokens)
  np.testing.assert_array_equal(np.asarray(placed["rewards"]), tokens[:, 0] / 2.0)
  np.testing.assert_array_equal(row_layout.local_rows(placed["tokens"]), tokens)  # one process: every row
  replicated = jax.device_put(tokens, row_layout.batch_sharding(mesh, ("data",)))  # each row on 4 devices
  np.testing.assert_array_equal(row_layout.local_rows(replicated), tokens)
  by_column = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
  with pytest.raises(ValueError, match="splits the array along an axis other than its rows"):
    row_layout.local_rows(jax.device_put(np.zeros((16, 4)), by_column))
  with pytest.raises(ValueError, match="passed 15 rows, its devices hold rows"):
    row_layout.global_rows(tokens[:15], sharding, 16)


def test_batch_stats_are_the_global_statistics():
  rewards = np.asarray([1.0, 0.0, 0.5, 0.25], np.float32)
  got = row_layout.batch_stats({"reward": rewards, "none": np.zeros(0)})
  assert got["reward"] == {"sum": 1.75, "count": 4, "min": 0.0, "max": 1.0, "mean": 0.4375}
  assert got["none"]["count"] == 0 and all(math.isnan(got["none"][k]) for k in ("min", "max", "mean"))
  assert jax.process_count() == 1  # no collective was needed


def _step_batch(seed=0, n=8, p=3, r=5):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, r + 1, n).astype(np.int32)
  mask = np.arange(r)[None] < lengths[:, None]
  gen = GenerationBatch(
      prompt_tokens=rng.integers(1, 50, (n, p)).astype(np.int32),
      prompt_mask=np.ones((n, p), bool),
      response_tokens=np.where(mask, rng.integers(1, 50, (n, r)), 0).astype(np.int32),
      response_mask=mask,
      behavior_logp=np.where(mask, -rng.exponential(1.0, (n, r)), 0.0).astype(np.float32),
      entropy=np.where(mask, rng.uniform(0.0, 3.0, (n, r)), 0.0).astype(np.float32),
      lengths=lengths,
      finish_reason=np.where(lengths == r, "length", "stop"),
      group_ids=np.arange(n) // 2,
      sample_index=np.arange(n) % 2,
      policy_version=0,
  )
  rewards = rng.choice([0.0, 0.5, 1.0], n).astype(np.float32)
  batch = RolloutBatch.from_generation(gen, rewards=rewards, advantages=(rewards - 0.5).astype(np.float32))
  noise = rng.normal(0.0, 0.1, batch.behavior_logp.shape).astype(np.float32)
  return gen, batch.replace(learner_logp=np.where(batch.response_mask, batch.behavior_logp + noise, 0.0))


def test_sample_metrics_equal_the_whole_batch_formulas():
  gen, batch = _step_batch()
  got = rollout_metrics.sample_metrics(gen, batch, slice(0, 8), 8)
  n_tok = max(int(gen.response_mask.sum()), 1)
  exact = {  # the trainer's former formulas over the global batch: equal bit for bit
      "reward/mean": float(batch.rewards.mean()),
      "reward/accuracy": float((batch.rewards >= 1.0).mean()),
      "response/length_mean": float(gen.lengths.mean()),
      "response/length_max": int(gen.lengths.max()),
      "response/length_quantiles": np.quantile(gen.lengths, np.linspace(0, 1, 11)).round(1).tolist(),
      "response/truncated_frac": float(gen.truncated.mean()),
      "advantage/zero_frac": float((batch.advantages == 0).mean()),
      "tokens": n_tok,
  }
  assert {k: got[k] for k in exact} == exact and 0 < exact["advantage/zero_frac"] < 1
  assert got["response/entropy"] == pytest.approx(float((gen.entropy * gen.response_mask).sum() / n_tok), rel=1e-6)


def test_mismatch_metrics_equal_the_whole_batch_ones():
  _, batch = _step_batch(1)
  got = rollout_metrics.mismatch_metrics(batch, slice(0, 8), 8)
  want = jax.device_get(aggregation.mismatch_metrics(batch.learner_logp, batch.behavior_logp, batch.response_mask))
  assert sorted(got) == sorted(want) and got["mismatch_k3"] > 0
  for k, v in want.items():
    assert got[k] == pytest.approx(float(v), rel=1e-5), k


def test_rows_to_host_in_one_process_is_every_row_without_the_padding():
  mesh = make_mesh({"data": 2, "fsdp": 4})
  sharded = jax.device_put(
      np.arange(24.0).reshape(12, 2), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  tree = (sharded, None, np.arange(12))
  for own in (False, True):  # one process owns every row: the same arrays either way
    (x, none, y), rows = row_layout.rows_to_host(tree, 10, mesh.devices, own)
    assert rows == slice(0, 10) and none is None
    assert isinstance(x, np.ndarray) and x.tolist() == np.arange(20.0).reshape(10, 2).tolist()
    assert y.tolist() == list(range(10))


def test_generation_batch_select_keeps_the_rows_of_every_per_row_field():
  gen = GenerationBatch(
      prompt_tokens=np.arange(8).reshape(4, 2),
      prompt_mask=np.ones((4, 2), bool),
      response_tokens=np.arange(12).reshape(4, 3),
      response_mask=np.ones((4, 3), bool),
      behavior_logp=np.zeros((4, 3), np.float32),
      entropy=None,
      lengths=np.asarray([3, 2, 1, 3], np.int32),
      finish_reason=np.asarray(["stop", "length", "stop", "stop"]),
      group_ids=np.asarray([5, 5, 6, 6]),
      sample_index=np.asarray([0, 1, 0, 1], np.int32),
      policy_version=4,
  )
  part = gen.select(slice(2, 4))
  assert len(part) == 2 and part.response_tokens.tolist() == [[6, 7, 8], [9, 10, 11]]
  assert part.group_ids.tolist() == [6, 6] and part.lengths.tolist() == [1, 3] and part.entropy is None
  assert part.truncated.tolist() == [False, False] and part.policy_version == 4 and gen.group_ids.shape == (4,)
