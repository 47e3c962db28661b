"""The learner's inputs from per-process rows (`minpro_jax.rl.process_inputs`) in one process on 8 CPU devices: the
staged path (global arrays, mini-batches sliced on the devices, `Learner.update_arrays`) gives the host path's
updates, and a per-process buffer checkpoint reads back. tests/test_multihost.py runs them in two processes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from test_learner import _batch, _model

from minpro_jax.rl import process_inputs, process_packing
from minpro_jax.rl.epochs import epoch_rows
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.rl.rollout import RolloutBuffer
from minpro_jax.run.checkpoint import RunCheckpointer, buffer_state_from_restored
from minpro_jax.runtime import row_layout
from minpro_jax.runtime.sharding import make_mesh, use_mesh


def _max_abs_diff(a, b):
  return max(
      float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def test_one_process_keeps_every_row_and_the_host_path():
  batch = _batch(_model(), n=8)
  assert process_inputs.own_rows(batch, 4, 2) is batch
  assert process_inputs.gather_batch(batch, 8) is batch
  mesh = make_mesh({"data": 2, "fsdp": 4})
  learner = Learner(_model(mesh), LossConfig(), OptimizerConfig(), micro_batch_size=4, mesh=mesh)
  assert process_inputs.for_learner(batch, learner, 8, 2) is batch
  assert process_inputs.for_learner(None, learner, 8, 2) is None
  state = RolloutBuffer(1)
  state.push(0, batch)
  assert process_inputs.buffer_to_global(state.state_dict(), 8) is not None
  assert process_inputs.buffer_template({"global_step": 0}) is None  # a buffer written whole


def test_staging_sharding_splits_rows_over_processes_then_devices():
  mesh = make_mesh({"data": 2, "fsdp": 4})
  staging = row_layout.staging_sharding(mesh.devices, 16)
  assert dict(staging.mesh.shape) == {"process": 1, "local": 8}
  assert staging.spec == jax.sharding.PartitionSpec(("process", "local"))  # 16 rows: 2 on each device
  assert row_layout.process_blocks(staging, 16) == [(0, 16)]  # one process: every row
  x = row_layout.global_rows(np.arange(16.0), staging, 16)
  assert [s.data.shape for s in x.addressable_shards] == [(2,)] * 8
  by_process = row_layout.staging_sharding(mesh.devices, 12)  # 12 rows do not split over 8 devices
  assert by_process.spec == jax.sharding.PartitionSpec("process")
  assert row_layout.global_rows(np.arange(12.0), by_process, 12).is_fully_replicated  # one process: on each device
  assert row_layout.staging_sharding(jax.devices()).spec == jax.sharding.PartitionSpec("process")


def test_learner_sharding_splits_the_rows_over_the_batch_axes():
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert process_inputs.learner_sharding(mesh, 8).spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  assert process_inputs.learner_sharding(mesh, 6).spec == jax.sharding.PartitionSpec(None)  # 6 rows over 4: whole


def test_staged_updates_equal_the_host_updates():
  """Two passes of two updates (PPO epochs; the second pass's reordered groups gathered on the devices) from the
  staged global arrays against the host path's `RolloutBatch.select` / `split` + `Learner.update_inputs`, with
  decoupled PPO's proximal score pass (on the staged arrays, or `Learner.score` of the host rows): the same
  parameters (to float round-off), losses, staleness, tokens and padding share (counted on the devices)."""
  mesh = make_mesh({"data": 2, "fsdp": 4})
  model = _model(mesh)
  batch = _batch(_model(), n=16)
  batch = batch.replace(policy_version=np.repeat(np.asarray([3, 4], np.int64), 8))
  opt = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0)
  got, want = [], []
  for staged in (True, False):
    learner = Learner(model, LossConfig(method="decoupled_ppo"), opt, micro_batch_size=4, mesh=mesh)
    state = learner.init_state(jax.tree.map(lambda a: a.copy(), nnx.split(model)[1]))
    with use_mesh(mesh):
      if staged:
        src = process_inputs.stage(batch, mesh, 16)
        assert isinstance(src, process_inputs.StagedBatch) and src.size == 16
        assert src.real_tokens == int(batch.segment_ids.sum())
        np.testing.assert_array_equal(src.policy_version, batch.policy_version)
        minis = list(process_inputs.mini_batches(src, 2, mesh))
        assert minis[1].tokens.sharding == process_inputs.learner_sharding(mesh, 8)
        np.testing.assert_array_equal(np.asarray(minis[1].tokens), batch.tokens[8:])
        np.testing.assert_array_equal(np.asarray(minis[1].advantages), batch.advantages[8:])
        assert minis[1].routes is None and minis[1].kept_logp_threshold is None
      else:
        src = batch
      state, ups, stale, tokens = process_inputs.updates(learner, state, src, 2, 1.0, num_epochs=2, group_size=2)
    (got if staged else want).append((jax.tree.map(np.asarray, state.params), ups, stale, tokens))
  (p_got, u_got, s_got, t_got), (p_want, u_want, s_want, t_want) = got[0], want[0]
  # the staged inputs arrive batch-sharded, the host ones whole: XLA partitions the sums differently (fp32
  # round-off, ~1e-7 in the gradients), which Adam's division by sqrt(v) amplifies for parameters with tiny
  # gradients (as tests/test_learner.py's mesh against one device); a wrong row or mini-batch moves them by ~1e-2
  assert _max_abs_diff(p_got, p_want) <= 1e-4
  np.testing.assert_array_equal(s_got, s_want)
  # update j at version j: stale = j - policy_version; pass 1 (updates 2, 3) takes the rows in another order
  assert s_got[:16].tolist() == [0 - 3] * 8 + [1 - 4] * 8
  order = epoch_rows(16, 2, 1, seed=0, version=0)
  np.testing.assert_array_equal(s_got[16:], np.repeat([2, 3], 8) - batch.policy_version[order])
  assert t_got == t_want == 2 * int(batch.segment_ids.sum())
  for a, b in zip(u_got, u_want):
    assert a["pad_fraction"] == b["pad_fraction"] > 0  # counted on the devices == packing.pad_fraction on the host
    assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-6
    assert abs(float(a["grad_norm"]) - float(b["grad_norm"])) <= 1e-5


def test_packed_staged_updates_and_score_equal_the_host_path():
  """Packing from per-process rows (`process_packing`, here one process on 8 devices): the staged [num x R, W] packed
  rows give mini-batch j exactly as `Learner.update` packs it, two updates the host path's (to float round-off, the
  same padding share), and `process_packing.score` the chunked `Learner.score`."""
  mesh = make_mesh({"data": 2, "fsdp": 4})
  model = _model(mesh)
  batch = _batch(_model(), n=16)
  opt = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0)
  got, want = [], []
  for staged in (True, False):
    learner = Learner(model, LossConfig(method="minpro"), opt, micro_batch_size=2, mesh=mesh, row_tokens=16)
    state = learner.init_state(jax.tree.map(lambda a: a.copy(), nnx.split(model)[1]))
    with use_mesh(mesh):
      if staged:
        every = process_packing.lengths(batch, 16)
        arrays = process_packing.stage(batch, learner, 16, 2, every)
        src = process_inputs.StagedBatch(arrays, batch.policy_version, int(every.sum()))
        minis = list(process_inputs.mini_batches(src, 2, mesh))
        for mini, host in zip(minis, batch.split(2)):
          want_rows = learner.update_inputs(host, 2)[0]
          for f in ("tokens", "segment_ids", "positions", "advantages", "behavior_logp"):
            np.testing.assert_array_equal(np.asarray(getattr(mini, f)), np.asarray(getattr(want_rows, f)), f)
        logp = process_packing.score(
            learner, state.params, batch, 16, 8, lambda r: process_inputs.learner_sharding(mesh, r)
        )
        np.testing.assert_allclose(logp, learner.score(state.params, batch, chunk_rows=8), rtol=1e-5, atol=1e-6)
      else:
        src = batch
      state, ups, _, tokens = process_inputs.updates(learner, state, src, 2, 1.0)
    (got if staged else want).append((jax.tree.map(np.asarray, state.params), ups, tokens))
  (p_got, u_got, t_got), (p_want, u_want, t_want) = got[0], want[0]
  assert _max_abs_diff(p_got, p_want) <= 1e-4 and t_got == t_want
  for a, b in zip(u_got, u_want):
    assert a["pad_fraction"] == b["pad_fraction"] and abs(float(a["loss"]) - float(b["loss"])) <= 1e-6
  with pytest.raises(ValueError, match="mini-batches of 5 rows do not lie within"):
    process_packing.stage(batch, learner, 16, 3, every)
  with pytest.raises(ValueError, match="chunks of 3 rows do not lie within"):
    process_packing.score(learner, state.params, batch, 16, 3, None)


def test_staged_batch_errors_name_the_problem():
  mesh = make_mesh({"data": 2, "fsdp": 4})
  batch = _batch(_model(), n=8)
  with pytest.raises(ValueError, match="router_replay=True but the batch has no routes"):
    process_inputs.stage(batch, mesh, 8, replay=True)
  with pytest.raises(ValueError, match="passed 8 rows, its devices hold rows"):
    process_inputs.stage(batch, mesh, 16)
  staged = process_inputs.stage(batch, mesh, 8)
  learner = Learner(_model(mesh), LossConfig(), OptimizerConfig(), micro_batch_size=4, mesh=mesh)
  with pytest.raises(ValueError, match="cannot split a batch of 8 samples into 3 equal mini-batches"):
    process_inputs.updates(learner, None, staged, 3)


def test_a_buffer_written_per_process_reads_back(tmp_path):
  """The checkpoint path of a multi-process run in one process: the waiting batches as global arrays on the staging
  sharding, their layout in the meta, restored through `buffer_template` to this process's rows (all of them)."""
  batch = _batch(_model(), n=8)
  buffer = RolloutBuffer(2)
  buffer.push(3, batch)
  buffer.push(4, batch.replace(rewards=np.arange(8, dtype=np.float32)))
  state = buffer.state_dict()
  sharding = row_layout.staging_sharding(jax.devices(), 8)
  per_process = {
      "steps": state["steps"],
      "batches": {k: row_layout.global_rows(b, sharding, 8) for k, b in state["batches"].items()},
  }
  meta = {"global_step": 4, "buffer": process_inputs.buffer_layout(state, 8)}
  assert meta["buffer"]["rows"] == 8 and meta["buffer"]["batches"]["1"]["tokens"] == [[8, 12], "<i4"]
  ckpt = RunCheckpointer(str(tmp_path))
  params = {"w": jax.numpy.zeros((4,))}
  ckpt.save(4, params, per_process, meta)
  step, _, buf_state, got_meta = ckpt.restore_latest(params, buffer_template=process_inputs.buffer_template)
  assert step == 4 and got_meta["buffer"] == meta["buffer"]
  restored = RolloutBuffer(2)
  restored.load_state_dict(buffer_state_from_restored(buf_state))
  assert len(restored) == 2 and restored.pop(5) is not None
  last = restored.pop(6)
  np.testing.assert_array_equal(last.rewards, np.arange(8, dtype=np.float32))
  np.testing.assert_array_equal(last.tokens, batch.tokens)
  assert last.routes is None
  ckpt.close()
