"""RolloutBuffer release timing and checkpoint round trip; the checkpointer's disk-space check; RolloutBatch shape
checks, split and select, its learner layout built from a GenerationBatch, and its pytree behaviour."""

import jax
import numpy as np
import pytest

from minpro_jax.rl.rollout import RolloutBatch, RolloutBuffer, mask_truncated
from minpro_jax.run.checkpoint import RunCheckpointer, buffer_state_from_restored
from minpro_jax.sampling import GenerationBatch


def make_batch(n=4, length=5, tag=0):
  """A batch whose every field encodes (tag, row) so selections and round trips are checkable."""
  rows = np.arange(n)
  tokens = (tag * 100 + rows[:, None] * 10 + np.arange(length)[None]).astype(np.int32)
  mask = np.zeros((n, length), bool)
  mask[:, 2:] = True
  return RolloutBatch(
      tokens=tokens,
      segment_ids=np.ones((n, length), np.int32),
      positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
      response_mask=mask,
      behavior_logp=np.where(mask, -0.5 - tag - rows[:, None] * 0.01, 0).astype(np.float32),
      learner_logp=np.where(mask, -0.6 - tag, 0).astype(np.float32),
      advantages=(rows - 1.5).astype(np.float32),
      rewards=(rows % 2).astype(np.float32),
      group_ids=(tag * n + rows // 2).astype(np.int64),
      policy_version=np.full(n, tag, np.int64),
      response_lengths=np.full(n, length - 2, np.int32),
      truncated=rows == 0,
  )


def test_mask_truncated_clears_truncated_rows_and_warns_when_nothing_is_left(caplog):
  """`reward.mask_truncated`: truncated rows lose their response mask, the others keep theirs; a batch whose every
  row was truncated has no token with a loss, and the log says so naming the field."""
  b = make_batch()  # row 0 truncated
  with caplog.at_level("WARNING", logger="minpro_jax.rl.rollout"):
    masked = mask_truncated(b)
  assert masked.response_mask.sum(axis=1).tolist() == [0, 3, 3, 3] and not caplog.records
  np.testing.assert_array_equal(masked.advantages, b.advantages)
  everything = b.replace(truncated=np.ones(4, bool))
  with caplog.at_level("WARNING", logger="minpro_jax.rl.rollout"):
    assert not mask_truncated(everything).response_mask.any()
  (rec,) = caplog.records
  assert rec.getMessage().startswith("reward.mask_truncated: all 4 responses of this batch were truncated")
  caplog.clear()
  with caplog.at_level("WARNING", logger="minpro_jax.rl.rollout"):  # a batch with no response tokens at all: quiet
    mask_truncated(everything.replace(response_mask=np.zeros_like(b.response_mask)))
  assert not caplog.records


def assert_batches_equal(a: RolloutBatch, b: RolloutBatch):
  for k, v in a.to_dict().items():
    np.testing.assert_array_equal(v, b.to_dict()[k], err_msg=k)
    assert v.dtype == b.to_dict()[k].dtype, k


@pytest.mark.parametrize("delay", [0, 1, 2, 5])
def test_release_exactly_delay_steps_later(delay):
  buf = RolloutBuffer(delay)
  released = []
  for s in range(12):
    buf.push(s, make_batch(tag=s))
    out = buf.pop(s)
    if s < delay:
      assert out is None and len(buf) == s + 1
    else:
      assert out is not None and int(out.policy_version[0]) == s - delay  # the batch pushed at s - delay
      assert len(buf) == delay
      released.append(s)
  assert released == list(range(delay, 12))


def test_delay_zero_returns_the_batch_just_pushed():
  buf = RolloutBuffer(0)
  b = make_batch(tag=7)
  buf.push(3, b)
  assert buf.pop(3) is b and len(buf) == 0 and buf.pop(4) is None


def test_errors():
  with pytest.raises(ValueError, match="delay"):
    RolloutBuffer(-1)
  buf = RolloutBuffer(2)
  buf.push(5, make_batch())
  for bad in (5, 4):
    with pytest.raises(ValueError, match="not after"):
      buf.push(bad, make_batch())


def test_state_dict_round_trip_in_memory_and_through_orbax(tmp_path):
  buf = RolloutBuffer(2)
  for s in range(3):
    buf.push(s, make_batch(tag=s))
    buf.pop(s)
  assert len(buf) == 2
  snapshot = buf.state_dict()
  fresh = RolloutBuffer(2)
  fresh.load_state_dict(snapshot)
  ckpt = RunCheckpointer(str(tmp_path), keep=1)
  import jax.numpy as jnp

  ckpt.save(2, {"x": jnp.zeros(())}, snapshot, {"global_step": 2})
  _, restored, _ = ckpt.restore(2, {"x": jnp.zeros(())})
  disk = RolloutBuffer(2)
  disk.load_state_dict(buffer_state_from_restored(restored))
  for other in (fresh, disk):
    ref = RolloutBuffer(2)
    ref.load_state_dict(snapshot)
    for s in (3, 4):
      ref.push(s, make_batch(tag=s))
      other.push(s, make_batch(tag=s))
      a, b = ref.pop(s), other.pop(s)
      assert int(a.policy_version[0]) == s - 2
      assert_batches_equal(a, b)
  # empty buffer round-trips too (orbax refuses empty containers; the checkpointer stores a sentinel)
  empty = RolloutBuffer(0)
  ckpt.save(3, {"x": jnp.zeros(())}, empty.state_dict(), {"global_step": 3})
  _, restored, _ = ckpt.restore(3, {"x": jnp.zeros(())})
  e2 = RolloutBuffer(0)
  e2.load_state_dict(buffer_state_from_restored(restored))
  assert len(e2) == 0
  ckpt.close()


def test_disk_space_check_counts_the_checkpoints_still_to_write(tmp_path, monkeypatch):
  import collections
  import shutil

  ckpt = RunCheckpointer(str(tmp_path), keep=1)
  state = {"x": np.zeros((1000,), np.float32), "n": np.zeros((), np.int64)}  # 4008 bytes
  params = {"y": np.zeros((250,), np.float32)}  # 1000 bytes
  usage = collections.namedtuple("usage", "total used free")

  def check(free):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 0, free))
    ckpt.check_disk_space(state, params)

  # nothing on disk yet: keep + 1 = 2 run checkpoints (the new one is written before the old is deleted), 2 best
  check(2 * 4008 + 2 * 1000)
  with pytest.raises(OSError, match=r"config\.workdir: .* GB free.* 2 run checkpoint\(s\) and 2 best"):
    check(2 * 4008 + 2 * 1000 - 1)
  monkeypatch.undo()
  ckpt.save(0, state, RolloutBuffer(0).state_dict(), {"global_step": 0})
  ckpt.save_best(0, params, {"score": 0.0})
  ckpt.save_best(0, params, {"score": 0.0})  # the same step again is kept, not an error
  check(4008 + 1000)  # one of each is already on disk
  with pytest.raises(OSError, match=r"1 run checkpoint\(s\) and 1 best"):
    check(4008 + 1000 - 1)
  ckpt.close()


def test_split_and_select():
  b = make_batch(n=8, tag=3)
  parts = b.split(4)
  assert [p.size for p in parts] == [2, 2, 2, 2]
  for i, p in enumerate(parts):
    assert_batches_equal(p, b.select(slice(2 * i, 2 * i + 2)))
    np.testing.assert_array_equal(p.tokens[:, 0], [300 + 10 * (2 * i), 300 + 10 * (2 * i + 1)])
  sel = b.select(np.array([5, 1]))
  np.testing.assert_array_equal(sel.advantages, b.advantages[[5, 1]])
  np.testing.assert_array_equal(sel.behavior_logp, b.behavior_logp[[5, 1]])
  for bad in (3, 0, -2):
    with pytest.raises(ValueError, match="mini-batches"):
      b.split(bad)


def _generation():
  """Two rows: a 2-token prompt left-padded to P=3 with a 2-token response that stopped, and a full-length row."""
  return GenerationBatch(
      prompt_tokens=np.array([[0, 5, 6], [7, 8, 9]], np.int32),
      prompt_mask=np.array([[0, 1, 1], [1, 1, 1]], bool),
      response_tokens=np.array([[10, 11, 0], [12, 13, 14]], np.int32),
      response_mask=np.array([[1, 1, 0], [1, 1, 1]], bool),
      behavior_logp=np.array([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], np.float32),
      entropy=None,
      lengths=np.array([2, 3], np.int32),
      finish_reason=np.array(["stop", "length"]),
      group_ids=np.array([4, 4], np.int32),
      sample_index=np.array([0, 1], np.int32),
      policy_version=7,
  )


def test_from_generation_builds_the_learner_layout():
  b = RolloutBatch.from_generation(_generation(), rewards=[1, 0], advantages=np.array([0.5, -0.5], np.float64))
  np.testing.assert_array_equal(b.tokens, [[0, 5, 6, 10, 11, 0], [7, 8, 9, 12, 13, 14]])
  np.testing.assert_array_equal(b.segment_ids, [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(b.positions, [[0, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(b.response_mask, [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
  np.testing.assert_array_equal(
      b.behavior_logp, np.array([[0, 0, 0, -0.1, -0.2, 0], [0, 0, 0, -0.3, -0.4, -0.5]], np.float32)
  )
  np.testing.assert_array_equal(b.learner_logp, np.zeros((2, 6)))
  np.testing.assert_array_equal(b.advantages, [0.5, -0.5])
  np.testing.assert_array_equal(b.rewards, [1, 0])
  np.testing.assert_array_equal(b.group_ids, [4, 4])
  np.testing.assert_array_equal(b.policy_version, [7, 7])
  np.testing.assert_array_equal(b.response_lengths, [2, 3])
  np.testing.assert_array_equal(b.truncated, [False, True])
  dtypes = {k: v.dtype for k, v in b.to_dict().items()}
  assert dtypes == dict(
      tokens=np.int32,
      segment_ids=np.int32,
      positions=np.int32,
      response_mask=bool,
      behavior_logp=np.float32,
      learner_logp=np.float32,
      advantages=np.float32,
      rewards=np.float32,
      group_ids=np.int64,
      policy_version=np.int64,
      response_lengths=np.int32,
      truncated=bool,
  )
  lp = np.full((2, 6), -1.0)
  with_lp = RolloutBatch.from_generation(_generation(), rewards=[1, 0], advantages=[0, 0], learner_logp=lp)
  assert with_lp.learner_logp.dtype == np.float32 and np.all(with_lp.learner_logp == -1.0)
  with pytest.raises(ValueError, match="learner_logp"):
    RolloutBatch.from_generation(_generation(), rewards=[1, 0], advantages=[0, 0], learner_logp=lp[:, :5])
  with pytest.raises(ValueError, match="rewards"):
    RolloutBatch.from_generation(_generation(), rewards=[1], advantages=[0, 0])


def test_rollout_batch_is_a_pytree_with_replace():
  b = make_batch(n=4, tag=1)
  leaves = jax.tree.leaves(b)
  assert len(leaves) == 12 and all(isinstance(x, np.ndarray) for x in leaves)
  doubled = jax.tree.map(lambda x: x * 2, b)
  assert isinstance(doubled, RolloutBatch)
  np.testing.assert_array_equal(doubled.advantages, b.advantages * 2)
  assert jax.tree.structure(jax.tree.map(lambda x: None, b)) is not None  # placeholder leaves are not shape-checked
  new = b.replace(learner_logp=np.where(b.response_mask, b.behavior_logp, 0).astype(np.float32))
  np.testing.assert_array_equal(new.learner_logp, new.behavior_logp)
  np.testing.assert_array_equal(b.learner_logp[b.response_mask], np.float32(-1.6))  # the original is unchanged
  with pytest.raises(ValueError, match="learner_logp"):
    b.replace(learner_logp=b.learner_logp[:, :-1])


def test_shape_validation_names_the_field():
  d = make_batch().to_dict()
  bad = dict(d, behavior_logp=d["behavior_logp"][:, :-1])
  with pytest.raises(ValueError, match="behavior_logp"):
    RolloutBatch(**bad)
  bad = dict(d, advantages=d["advantages"][:-1])
  with pytest.raises(ValueError, match="advantages"):
    RolloutBatch(**bad)
  bad = dict(d, policy_version=d["policy_version"][:, None])
  with pytest.raises(ValueError, match="policy_version"):
    RolloutBatch(**bad)


def test_restore_latest_falls_back_past_a_damaged_checkpoint_and_sets_it_aside(tmp_path):
  import glob
  import os

  ckpt = RunCheckpointer(str(tmp_path), keep=3)
  template = {"x": np.zeros((64,), np.float32)}
  assert ckpt.restore_latest(template) is None

  def on_disk():
    return sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())

  for step in (1, 2, 3):
    ckpt.save(step, {"x": np.full((64,), step, np.float32)}, RolloutBuffer(0).state_dict(), {"global_step": step})
  seen = []
  step, state, _, meta = ckpt.restore_latest(template, check_meta=lambda m: seen.append(m["global_step"]))
  assert (step, meta["global_step"], float(state["x"][0]), seen) == (3, 3, 3.0, [3])
  # damage step 3's arrays: truncate every data file of its state item
  files = [
      f
      for f in glob.glob(str(tmp_path / "checkpoints" / "3" / "state" / "**"), recursive=True)
      if os.path.isfile(f) and "d/" in f.replace(os.sep, "/")
  ]
  assert files
  for f in files:
    open(f, "wb").close()
  seen.clear()
  step, state, _, meta = ckpt.restore_latest(template, check_meta=lambda m: seen.append(m["global_step"]))
  assert (step, float(state["x"][0]), seen) == (2, 2.0, [3, 2])
  assert on_disk() == [1, 2] and ckpt.latest_step() == 2
  assert os.listdir(tmp_path / "checkpoints_unreadable")[0].startswith("3_")
  # the run can write step 3 again
  ckpt.save(3, {"x": np.full((64,), 30, np.float32)}, RolloutBuffer(0).state_dict(), {"global_step": 3})
  assert float(ckpt.restore_latest(template)[1]["x"][0]) == 30.0
  # a config check that refuses stops at once and moves nothing
  with pytest.raises(ValueError, match="other run"):
    ckpt.restore_latest(template, check_meta=lambda m: (_ for _ in ()).throw(ValueError("other run")))
  assert on_disk() == [1, 2, 3]
  # when nothing reads back: an error naming the newest, and nothing moved
  for s in (1, 2, 3):
    os.remove(tmp_path / "checkpoints" / str(s) / "meta" / "metadata")
  with pytest.raises(
      RuntimeError,
      match=r"config\.workdir: no run checkpoint .* \[3, 2, 1\].* newest, 3.*original " r"config .* repair or delete",
  ):
    ckpt.restore_latest(template)
  assert on_disk() == [1, 2, 3]
  ckpt.close()


def test_a_full_disk_while_saving_names_the_workdir_and_removes_the_partial_write(tmp_path, monkeypatch):
  import errno
  import os

  ckpt = RunCheckpointer(str(tmp_path), keep=2)
  state = {"x": np.ones((8,), np.float32)}
  ckpt.save(0, state, RolloutBuffer(0).state_dict(), {"global_step": 0})

  def full(step, args, force):  # what tensorstore raises, after orbax made its temporary folder
    os.makedirs(tmp_path / "checkpoints" / f"{step}.orbax-checkpoint-tmp" / "state")
    raise ValueError("RESOURCE_EXHAUSTED: Failed to write 4 bytes: No space left on device [os_error_code='28']")

  monkeypatch.setattr(ckpt._mngr, "save", full)
  with pytest.raises(
      OSError,
      match=r"config\.workdir: the disk under .* filled up while writing the run checkpoint "
      r"of step 1 .* newest 0, are intact\)\..* re-run the same command to resume",
  ) as e:
    ckpt.save(1, state, RolloutBuffer(0).state_dict(), {"global_step": 1})
  assert e.value.errno == errno.ENOSPC and os.listdir(tmp_path / "checkpoints") == ["0"]
  monkeypatch.setattr(ckpt._mngr, "save", lambda step, args, force: (_ for _ in ()).throw(ValueError("other")))
  with pytest.raises(ValueError, match="^other$"):  # any other failure is left as it is
    ckpt.save(1, state, RolloutBuffer(0).state_dict(), {"global_step": 1})
  monkeypatch.undo()
  ckpt.close()
