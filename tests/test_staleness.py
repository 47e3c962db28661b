"""Exact staleness emulation (paper setting d=2, n=16 -> [32, 47]) and case B15 (behavior log-probs are the
sampler's, stored at generation time, never recomputed)."""

import copy
import json

import numpy as np
import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax.rl.learner import staleness
from minpro_jax.rl.rollout import RolloutBatch, RolloutBuffer


def simulate(delay: int, n: int, steps: int, epochs: int = 1):
  """Pure-python run of the trainer's loop: per global step, the staleness of every use of a sample (`epochs`
  passes of n updates each, PPO epochs)."""
  buf = RolloutBuffer(delay)
  version = 0
  out = {}
  for s in range(steps):
    pv = np.full(n, version, np.int64)  # n samples, one per update, all sampled by the newest parameters
    z = np.zeros((n, 1))
    buf.push(
        s,
        RolloutBatch(
            tokens=z.astype(np.int32),
            segment_ids=z.astype(np.int32),
            positions=z.astype(np.int32),
            response_mask=z.astype(bool),
            behavior_logp=z.astype(np.float32),
            learner_logp=z.astype(np.float32),
            advantages=np.zeros(n, np.float32),
            rewards=np.zeros(n, np.float32),
            group_ids=np.arange(n),
            policy_version=pv,
            response_lengths=np.zeros(n, np.int32),
            truncated=np.zeros(n, bool),
        ),
    )
    rel = buf.pop(s)
    if rel is None:
      continue
    st = []
    for _ in range(epochs):
      for mini in rel.split(n):
        st.append(staleness(version, mini.policy_version))
        version += 1
    out[s] = np.concatenate(st)
  return out


@pytest.mark.parametrize("delay", [0, 1, 2, 4])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_simulated_staleness(delay, n):
  out = simulate(delay, n, steps=3 * delay + 5)
  assert sorted(out) == list(range(delay, 3 * delay + 5))  # no update during the first `delay` steps
  j = np.arange(n)
  for s, st in out.items():
    k = s - delay  # index of the released batch
    if k < delay:  # warm-up: sampled at step k by version 0, consumed at version k*n + j
      np.testing.assert_array_equal(st, k * n + j)
    else:  # steady state: exactly delay*n + j
      np.testing.assert_array_equal(st, delay * n + j)
  steady = np.concatenate([st for s, st in out.items() if s >= 2 * delay])
  assert steady.min() == delay * n and steady.max() == delay * n + n - 1


@pytest.mark.parametrize("delay", [0, 2])
@pytest.mark.parametrize("epochs", [2, 3])
def test_simulated_staleness_with_epochs(delay, epochs):
  """E passes of n updates: update j of pass e uses its sample at d E n + e n + j once the buffer is full, and at
  k E n + e n + j for the k-th warm-up release (the README's formula with E)."""
  n = 4
  out = simulate(delay, n, steps=3 * delay + 4, epochs=epochs)
  use = np.arange(epochs * n)  # e n + j in order of the updates
  for s, st in out.items():
    k = s - delay
    np.testing.assert_array_equal(st, min(k, delay) * epochs * n + use)


def test_paper_setting_bounds_simulated():
  out = simulate(2, 16, steps=10)
  steady = np.concatenate([out[s] for s in range(4, 10)])
  assert steady.min() == 32 and steady.max() == 47


# ----------------------------------------------------------------------------------------- real trainer
@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
  """The real Trainer, d=2 and n=16 updates per step (16 prompts x 2 samples, 2 samples per update), 6 steps;
  sample_step / learn_step are wrapped to record what the sampler produced and what the learner consumed."""
  from minpro_jax.run.trainer import Trainer

  tmp = tmp_path_factory.mktemp("stale")
  c = make_config(
      tiny_overrides(
          tmp,
          total_steps=6,
          prompts_per_step=16,
          group_size=2,
          num_updates_per_step=16,
          micro_batch_size=2,
          delay=2,
          **{"loss.entropy_coef": 0.05, "optimizer.learning_rate": 1e-2},
      )
  )
  tr = Trainer.from_config(c)
  sampled, consumed = [], []
  orig_sample, orig_learn = tr.sample_step, tr.learn_step

  def sample_step(state, step):
    batch, m = orig_sample(state, step)
    sampled.append((step, copy.deepcopy(batch)))
    return batch, m

  def learn_step(state, batch, lr_scale=1.0):
    now = tr.learner.score(state.params, batch)
    consumed.append((int(state.step), batch, np.asarray(now)))
    return orig_learn(state, batch, lr_scale)

  tr.sample_step, tr.learn_step = sample_step, learn_step
  summary = tr.run()
  with open(tmp / "run" / "metrics.jsonl") as f:
    recs = {r["step"]: r for r in map(json.loads, f)}
  return summary, recs, sampled, consumed


def test_trainer_staleness_paper_setting(paper_run):
  summary, recs, _, _ = paper_run
  assert summary["policy_version"] == (6 - 2) * 16
  for s in (0, 1):
    assert "staleness/min" not in recs[s] and recs[s]["policy_version"] == 0  # buffer filling, no update
  # warm-up releases (batches sampled at steps 0, 1 by version 0): staleness k*16 + j
  assert (recs[2]["staleness/min"], recs[2]["staleness/max"]) == (0, 15)
  assert (recs[3]["staleness/min"], recs[3]["staleness/max"]) == (16, 31)
  for s in (4, 5):  # after warm-up: exactly [32, 47], both ends attained
    assert (recs[s]["staleness/min"], recs[s]["staleness/max"]) == (32, 47)
    assert recs[s]["staleness/mean"] == pytest.approx(39.5)
    hist = recs[s]["staleness/histogram"]  # each of the 16 updates' mini-batch at one staleness
    assert len(hist) == 48 and not any(hist[:32]) and len(set(hist[32:])) == 1 and hist[32] > 0
    assert recs[s]["policy_version"] == (s - 1) * 16
    assert recs[s]["sample/policy_version"] == (s - 2) * 16


def test_b15_behavior_logp_is_the_samplers_never_recomputed(paper_run):
  _, _, sampled, consumed = paper_run
  assert len(consumed) == 4
  by_step = dict(sampled)
  for i, (version, batch, logp_now) in enumerate(consumed):
    src = by_step[i]  # released at step i + 2 = the batch pushed at step i
    np.testing.assert_array_equal(batch.behavior_logp, src.behavior_logp)
    np.testing.assert_array_equal(batch.policy_version, src.policy_version)
    np.testing.assert_array_equal(batch.tokens, src.tokens)
    mask = batch.response_mask
    if version > int(src.policy_version[0]):  # parameters moved since sampling: recomputing would change them
      assert np.max(np.abs(logp_now[mask] - batch.behavior_logp[mask])) > 1e-4
  # at sampling time the sampler's log-probs match the learner's scoring of the same parameters (fp32 sampler)
  for _, b in sampled:
    m = b.response_mask
    assert np.max(np.abs(b.behavior_logp[m] - b.learner_logp[m])) < 1e-4
