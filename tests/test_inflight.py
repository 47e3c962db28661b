"""In-flight weight updates (`config.staleness.mode = "inflight"`): the streaming sampler
(`minpro_jax.sampling.streaming`), the per-token version and staleness metrics (`minpro_jax.rl.token_staleness`), and
the streaming trainer mode (`minpro_jax.run.inflight_runner`) against delay mode."""

import signal
import subprocess
import time

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import checkpoint_steps, cli_args, cli_env, make_config, metrics_records, tiny_overrides

from minpro_jax.aot.schedule import continuous_schedule
from minpro_jax.aot.stream_schedule import steady_schedule, streaming_schedule
from minpro_jax.errors import ConfigError
from minpro_jax.models import get_preset, init_model
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.rl.token_staleness import (
    VersionCounts,
    staleness_from_counts,
    token_staleness_metrics,
    version_counts,
)
from minpro_jax.run.inflight_runner import rebuild_exactness
from minpro_jax.run.run_config import validate_config, validate_shapes_config
from minpro_jax.run.trainer import Trainer
from minpro_jax.sampling import Sampler, SamplingParams, engines
from minpro_jax.sampling.streaming import StreamPool

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3]]
G = 2  # 4 prompts x 2 samples = 8 requests a batch
STOPS = tuple(range(3, CFG.vocab_size, 29))  # about 1 id in 29 stops a row: ragged lengths up to R
R = 16
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=R, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def versions():
  """Parameters of versions 0, 1, 2: the initial model and two perturbations of it (a learner's updates)."""
  state = nnx.split(init_model(CFG, seed=3))[1]
  out = [state]
  for v in (1, 2):
    key = jax.random.key(v)
    leaves, treedef = jax.tree.flatten(out[-1])
    keys = jax.random.split(key, len(leaves))
    moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    out.append(jax.tree.unflatten(treedef, moved))
  return out


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CFG, prompt_buckets=(16,), engine=engines.Continuous(decode_rows=4, refill_rows=2))


def _stream(sampler, versions, every, kv, swaps, restore_at=None):
  """Two batches through a `StreamPool` of `every` decode steps a segment; after segment i (0-based) in `swaps` the
  parameters move to the next version. At swap `restore_at` the pool is first written without its KV cache and read
  back into a new pool (a resume from `staleness.inflight_checkpoint_kv="rebuild"`). Returns the two collected
  batches."""
  make = lambda: StreamPool(  # noqa: E731
      sampler, SAMPLING, batch_rows=len(PROMPTS) * G, capacity=2 * len(PROMPTS) * G, every=every, kv=kv
  )
  pool = make()
  ids = [pool.admit(PROMPTS, seed=b, group_size=G, group_ids=np.arange(4) + 4 * b) for b in range(2)]
  v, i = 0, 0
  prepared = sampler.prepare_params(versions[0]).state
  while not pool.finished(list(ids[0]) + list(ids[1])):
    pool.segment(prepared, v)
    if i in swaps:
      v += 1
      prepared = sampler.prepare_params(versions[v]).state
      if i == restore_at:
        assert pool.live > 0  # rows mid-response whose cache must be rebuilt
        written = jax.tree.map(np.asarray, pool.state_dict(with_kv=False))
        pool = make()
        pool.load_state_dict(written, with_kv=False)
      pool.swap(prepared)
    i += 1
  return [pool.collect(list(x), SAMPLING.temperature) for x in ids]


def _assert_same(got, want):
  for g, w in zip(got, want):
    for field in ("response_tokens", "response_mask", "behavior_logp", "token_version"):
      np.testing.assert_array_equal(getattr(g, field), getattr(w, field), err_msg=field)


def test_stream_without_swaps_is_the_continuous_engine_bit_for_bit(sampler, versions):
  got = _stream(sampler, versions, every=3, kv="keep", swaps=())
  for b in range(2):
    want = sampler.generate(versions[0], PROMPTS, SAMPLING, seed=b, group_size=G, group_ids=np.arange(4) + 4 * b)
    np.testing.assert_array_equal(got[b].response_tokens, want.response_tokens)
    np.testing.assert_array_equal(got[b].response_mask, want.response_mask)
    np.testing.assert_array_equal(got[b].behavior_logp, want.behavior_logp)
    assert (got[b].token_version[got[b].response_mask] == 0).all()


def _teacher_forced(sampler, versions, gen):
  """[len(versions), N, R] teacher-forced log-probs of `gen`'s responses under each version (the learner's
  `token_logprobs`, fp32)."""
  batch = RolloutBatch.from_generation(gen, rewards=np.zeros(len(gen)), advantages=np.zeros(len(gen)))
  p = gen.prompt_tokens.shape[1]
  out = []
  for state in versions:
    model = nnx.merge(nnx.graphdef(init_model(CFG, seed=3)), state)
    lp = token_logprobs(model, batch.tokens, batch.segment_ids, batch.positions, temperature=gen.temperature).logp
    out.append(np.asarray(lp)[:, p:])
  return np.stack(out)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_swap_mid_response_logp_per_token_version(sampler, versions, kv):
  gens = _stream(sampler, versions, every=4, kv=kv, swaps=(0, 2))
  diffs = []
  for gen in gens:
    tv, mask = gen.token_version, gen.response_mask
    assert (tv[mask] >= 0).all() and (tv[~mask] == -1).all()
    tf = _teacher_forced(sampler, versions, gen)
    mine = np.take_along_axis(tf, np.clip(tv, 0, 2)[None], axis=0)[0]
    diffs.append(np.abs(mine - gen.behavior_logp)[mask])
  spread = [
      (np.where(g.response_mask, g.token_version, -9).max(1) - np.where(g.response_mask, g.token_version, 9).min(1))
      for g in gens
  ]
  assert max(s.max() for s in spread) >= 1  # some response continued under a newer version
  diff = np.concatenate(diffs)
  print(
      f"inflight_kv={kv}: |behavior_logp - teacher-forced at the token's version| max {diff.max():.3g} mean {diff.mean():.3g}"
  )
  if kv == "recompute":
    assert diff.max() < 1e-4
  else:
    assert diff.max() > 1e-3  # the stale-KV effect: measured, reported above


def test_restore_without_kv_cache_rebuilds_the_live_rows(sampler, versions):
  """A checkpoint without the KV cache: bit for bit the uninterrupted pool with kv="recompute" (it recomputes the
  live rows at that swap too); with kv="keep", restored at its only swap, bit for bit the recompute pool (the
  rebuild is that one recompute). The checkpoint is smaller by exactly the keys and values."""
  _assert_same(
      _stream(sampler, versions, every=4, kv="recompute", swaps=(0, 2), restore_at=2),
      _stream(sampler, versions, every=4, kv="recompute", swaps=(0, 2)),
  )
  _assert_same(
      _stream(sampler, versions, every=4, kv="keep", swaps=(0,), restore_at=0),
      _stream(sampler, versions, every=4, kv="recompute", swaps=(0,)),
  )
  pool = StreamPool(sampler, SAMPLING, batch_rows=8, capacity=16, every=4)
  nbytes = lambda d: sum(np.asarray(a).nbytes for a in jax.tree.leaves(d))  # noqa: E731
  kv = sum(a.nbytes for a in pool.pool.cache.k + pool.pool.cache.v)
  assert kv > 0 and nbytes(pool.state_dict()) - nbytes(pool.state_dict(with_kv=False)) == kv


# ------------------------------------------------------------------------------------------------ staleness metrics
def _batch(token_version, mask, row_version):
  n, length = mask.shape
  z = np.zeros((n, length))
  return RolloutBatch(
      tokens=z.astype(np.int32),
      segment_ids=np.ones((n, length), np.int32),
      positions=z.astype(np.int32),
      response_mask=mask,
      behavior_logp=z.astype(np.float32),
      learner_logp=z.astype(np.float32),
      advantages=np.zeros(n, np.float32),
      rewards=np.zeros(n, np.float32),
      group_ids=np.arange(n),
      policy_version=np.asarray(row_version, np.int64),
      response_lengths=mask.sum(1).astype(np.int32),
      truncated=np.zeros(n, bool),
      token_version=None if token_version is None else np.asarray(token_version, np.int32),
  )


def test_token_staleness_metrics_of_a_hand_built_schedule():
  # 3 responses learnt at version 5: one drawn by 2, 2, 3, 4 (swaps after its 2nd and 3rd token), one by 4, 4, one
  # by 5 alone; the 4th row has no response token (its -1 versions must not count)
  tv = [[-1, 2, 2, 3, 4], [-1, 4, 4, -1, -1], [-1, 5, -1, -1, -1], [-1, -1, -1, -1, -1]]
  mask = np.asarray(tv) >= 0
  m = token_staleness_metrics(_batch(tv, mask, [2, 4, 5, 0]), learn_version=5)
  # token staleness: 3, 3, 2, 1 | 1, 1 | 0
  assert m["staleness/token_histogram"] == [1, 3, 1, 2]
  assert m["staleness/token_mean"] == pytest.approx(11 / 7) and m["staleness/token_max"] == 3
  assert m["staleness/spread_mean"] == pytest.approx(2 / 3) and m["staleness/spread_max"] == 2
  assert m["staleness/mixed_frac"] == pytest.approx(1 / 3)
  # delay mode (no token versions): every token has its row's version
  m = token_staleness_metrics(_batch(None, mask, [2, 4, 5, 0]), learn_version=5)
  assert m["staleness/token_histogram"] == [1, 2, 0, 4] and m["staleness/spread_max"] == 0
  with pytest.raises(ValueError, match="newer than the learner's 4"):
    token_staleness_metrics(_batch(tv, mask, [2, 4, 5, 0]), learn_version=4)


def test_token_staleness_from_per_process_counts_equals_the_whole_batch():
  """What `gather_version_counts` makes of two processes' rows (the token counts summed, padded to the longer; the
  spreads in row order) gives the whole batch's metrics, exactly (rows 0-1 and 2-3 of the hand-built schedule)."""
  tv = np.asarray([[-1, 2, 2, 3, 4], [-1, 4, 4, -1, -1], [-1, 5, -1, -1, -1], [-1, -1, -1, -1, -1]])
  mask = tv >= 0
  whole = token_staleness_metrics(_batch(tv, mask, [2, 4, 5, 0]), learn_version=5)
  parts = [version_counts(_batch(tv[r], mask[r], [2, 4, 5, 0][r])) for r in (slice(0, 2), slice(2, 4))]
  assert [p.tokens.tolist() for p in parts] == [[0, 0, 0, 2, 1, 3], [0, 0, 0, 0, 0, 0, 1]]  # index = version + 1
  assert [p.spreads.tolist() for p in parts] == [[2, 0], [0, -1]]
  tokens = np.zeros(7, np.int64)
  for p in parts:
    tokens[: p.tokens.size] += p.tokens
  summed = VersionCounts(tokens, np.concatenate([p.spreads for p in parts]))
  assert staleness_from_counts(summed, 5) == whole


# ------------------------------------------------------------------------------------------------ the trainer mode
SAMPLE_PREFIXES = ("reward/", "response/", "advantage/", "sampler_learner/", "sample/")


def _train(tmp_path, name, **extra):
  """A tiny run (`train_helpers.tiny_overrides`, delay 1, 4 steps) in workdir `name`: (final params, metrics)."""
  ov = tiny_overrides(tmp_path / name, **{"sampling.kv_cache": "dense", **extra})  # the streaming pool's cache
  tr = Trainer.from_config(make_config(ov))
  tr.run()
  return tr.final_state.params, metrics_records(ov["workdir"])


@pytest.fixture(scope="module")
def delay_run(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("delay"), "run")


@pytest.mark.slow  # two tiny runs, ~50 s on 2 shared cores
def test_inflight_with_draining_segments_equals_delay_mode_bit_for_bit(delay_run, tmp_path):
  # max_new_tokens 6 <= inflight_every and 8 decode rows hold a whole batch: every segment drains the pool, so no
  # response sees a swap and batch b is sampled whole by the version after step b - 1, as in delay mode
  params, got = _train(tmp_path, "inflight", **{"staleness.mode": "inflight", "staleness.inflight_every": 6})
  want_params, want = delay_run
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  d = 1
  for step, rec in want.items():
    if step < 0 or step >= 4:  # the evaluations
      continue
    learn = {k: v for k, v in rec.items() if k.startswith(("learn/", "staleness/", "policy_version"))}
    assert learn and {k: got[step][k] for k in learn} == learn, step
    if step + d < 4:  # batch `step`'s sample metrics: delay mode reports them at `step`, in-flight at `step + d`
      sample = {k: v for k, v in rec.items() if k.startswith(SAMPLE_PREFIXES)}
      assert sample and {k: got[step + d][k] for k in sample} == sample, step
  assert got[3]["staleness/spread_max"] == 0 and got[3]["inflight/occupancy"] > 0


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("loss.method", "gspo", r"config\.loss\.method: 'gspo' takes a sequence-level ratio"),
        ("loss.rollout_is", "sequence", r"config\.loss\.rollout_is: 'sequence' corrects with a sequence-level ratio"),
        ("loss.rollout_mis", "geometric", r"config\.loss\.rollout_mis: 'geometric'"),
        ("loss.rollout_is", "Token", r"config\.loss\.rollout_is: Unknown rollout_is 'Token'; valid choices"),
        ("mipu.rollback", True, r"config\.mipu\.rollback: is not supported with staleness\.mode='inflight'"),
        ("staleness.inflight_kv", "drop", r"config\.staleness\.inflight_kv: 'drop'; choose one of"),
        ("staleness.inflight_every", 0, r"config\.staleness\.inflight_every: must be an int in \[1, 2147483647\]"),
        ("staleness.inflight_every", 2**31, r"config\.staleness\.inflight_every: must be .* got 2147483648"),
        ("sampling.kv_cache", "paged", r"config\.sampling\.kv_cache: 'paged': .*set sampling\.kv_cache='dense'"),
        ("sampling.continuous", False, r"config\.sampling\.continuous: False: .*set sampling\.continuous=True"),
        ("sampling.engine", "static", r"config\.sampling\.engine: 'static': .*dense cache; unset it"),
    ],
)
def test_inflight_refuses_what_it_cannot_run_naming_the_field(tmp_path, field, value, match):
  c = make_config(tiny_overrides(tmp_path, **{"staleness.mode": "inflight", field: value}))
  for validate in (validate_config, validate_shapes_config):  # the trainer's check and the step budget's
    with pytest.raises(ConfigError, match=match):
      validate(c)


def test_staleness_mode_is_checked(tmp_path):
  with pytest.raises(ConfigError, match=r"config\.staleness\.mode: 'async'; choose one of \('delay', 'inflight'\)"):
    validate_config(make_config(tiny_overrides(tmp_path, **{"staleness.mode": "async"})))
  with pytest.raises(ConfigError, match=r"config\.staleness\.mode: 'Inflight'; choose one of"):  # not delay mode
    validate_shapes_config(make_config(tiny_overrides(tmp_path, **{"staleness.mode": "Inflight"})))
  with pytest.raises(ConfigError, match=r"config\.staleness\.inflight_checkpoint_kv: 'drop'; choose one of"):
    validate_config(make_config(tiny_overrides(tmp_path, **{"staleness.inflight_checkpoint_kv": "drop"})))


def test_the_rebuild_log_says_whether_the_resume_is_exact():
  assert rebuild_exactness("recompute", True).startswith("exact: ")  # a step that learnt: recomputed at its swap
  assert rebuild_exactness("recompute", False).startswith("equal up to fp32 summation order: ")  # no update since
  for moved in (False, True):
    assert rebuild_exactness("keep", moved).startswith("an approximation with staleness.inflight_kv='keep'")


# ------------------------------------------------------------------------------------------------ resume (slow)
def _resume_overrides(tmp_path, name, **extra):
  return tiny_overrides(
      tmp_path,
      workdir=str(tmp_path / name),
      total_steps=5,
      **{
          "staleness.mode": "inflight",
          "staleness.inflight_every": 2,  # swaps in the middle of responses
          "staleness.inflight_kv": "recompute",
          "checkpoint.every": 1,
          "checkpoint.keep": 2,
          "optimizer.learning_rate": 1e-2,
          **extra,
      },
  )


@pytest.mark.slow
def test_inflight_sigkill_then_resume_is_bitwise_equal(tmp_path):
  """The interrupted run checkpoints without the pool's KV cache (`inflight_checkpoint_kv="rebuild"`); with
  inflight_kv="recompute" its resume still equals the uninterrupted run (which keeps the cache) bit for bit. The
  checkpoints with the cache are tested in tests/test_inflight_multihost.py."""
  ref_ov = _resume_overrides(tmp_path, "A")
  r = subprocess.run(cli_args(ref_ov), capture_output=True, text=True, env=cli_env(), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  ref = metrics_records(ref_ov["workdir"])
  assert max(ref[s]["staleness/spread_max"] for s in range(1, 5)) >= 1  # responses drawn by several versions
  ov = _resume_overrides(tmp_path, "B", **{"staleness.inflight_checkpoint_kv": "rebuild"})
  p = subprocess.Popen(cli_args(ov), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env())
  t0 = time.time()
  try:
    while not any(s >= 2 for s in checkpoint_steps(ov["workdir"])):
      assert p.poll() is None, "run finished before it could be interrupted"
      assert time.time() - t0 < 600
      time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  restored = max(checkpoint_steps(ov["workdir"]))
  assert restored < 4
  r = subprocess.run(cli_args(ov), capture_output=True, text=True, env=cli_env(), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "restored without its KV cache" in r.stderr and "; exact: the uninterrupted run" in r.stderr
  got = metrics_records(ov["workdir"])
  assert sorted(got) == sorted(ref)
  for s in [s for s in ref if s > restored]:
    assert got[s] == ref[s], f"step {s} differs after resuming from {restored}"


# ------------------------------------------------------------------------------------------------ the schedule replay
def test_streaming_schedule_of_a_hand_built_draw():
  # 2 rows, refills of 1, segments of 3 decode steps, one batch ahead; batch 0 = lengths 3, 1; batch 1 = 2, 2
  s0, s1 = streaming_schedule([[3, 1], [2, 2]], rows=2, refill_rows=1, every=3, ahead=1)
  # step 0: row 0 takes the 3-token response (2 decode steps), row 1 the 1-token one (ends at its prefill)
  assert (s0.decode_steps, s0.segments, s0.mean_live_rows, s0.live_rows_at_swap, s0.refills) == (2, 1, 1.0, 0, 2)
  # step 1: both rows take batch 1's 2-token responses: 1 decode step of 2 live rows
  assert (s1.decode_steps, s1.segments, s1.mean_live_rows, s1.live_rows_at_swap, s1.refills) == (1, 1, 2.0, 0, 2)


def test_streaming_schedule_replays_the_pool(sampler, versions):
  """The replay on the lengths the pool drew gives the pool's own decode steps, segments, live rows and refills."""
  pool = StreamPool(sampler, SAMPLING, batch_rows=len(PROMPTS) * G, capacity=3 * len(PROMPTS) * G, every=3, kv="keep")
  prepared, ids, steps = sampler.prepare_params(versions[0]).state, [], []
  for s in range(3):
    ids.append(list(pool.admit(PROMPTS, seed=s, group_size=G, group_ids=np.arange(4) + 4 * s)))
    decode = segments = busy = refills = 0
    while True:
      st = pool.segment(prepared, 0)
      decode, segments, busy, refills = (
          decode + st.decode_steps,
          segments + 1,
          busy + st.busy_row_steps,
          refills + st.refills,
      )
      if s < 1 or pool.finished(ids[s - 1]):
        break
    steps.append((decode, segments, busy, pool.live, refills))
  while not pool.finished(ids[2]):
    pool.segment(prepared, 0)
  lengths = [pool.collect(x, 1.0).lengths for x in ids]
  replay = streaming_schedule(lengths, rows=pool.rows, refill_rows=pool.refill, every=3, ahead=1)
  got = [
      (r.decode_steps, r.segments, round(r.mean_live_rows * r.decode_steps), r.live_rows_at_swap, r.refills)
      for r in replay
  ]
  assert got == steps and sum(s[0] for s in steps) > 6  # several segments of real decoding


def test_streaming_schedule_without_overlap_is_the_continuous_schedule():
  """ahead 0 and segments longer than any batch: each step is one delay-mode call of its batch, iteration for
  iteration (decode steps, refills, live rows and the live-length buckets)."""
  rng = np.random.default_rng(0)
  batches = [rng.integers(1, 200, size=64) for _ in range(3)]
  buckets = (64, 128, 256, 264)
  steps = streaming_schedule(batches, rows=16, refill_rows=4, every=10**6, ahead=0, prompt_len=64, buckets=buckets)
  for b, st in zip(batches, steps):
    want = continuous_schedule(b, 16, 4, 64, buckets)
    assert (st.decode_steps, st.refills, st.bucket_steps) == (want.decode_steps, want.refills, want.bucket_steps)
    assert st.mean_live_rows == pytest.approx(want.mean_live_rows) and st.segments == 1
  mean = steady_schedule(steps, 1, buckets)
  assert mean.decode_steps == np.mean([s.decode_steps for s in steps[1:]])
