"""LR decay on a response-length surge (arXiv 2602.01826): the trigger step and the decayed rates on scripted
length series (hand-computed), the update the learner applies at the decayed rate, the trigger state across a
checkpoint (JSON and a trainer run stopped and resumed), and the config checks."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_learner import _batch, _model
from train_helpers import make_config, tiny_overrides

from minpro_jax.rl import lr_decay
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.run import run_config

CFG = lr_decay.LrDecayConfig(baseline_steps=3, surge_ratio=3.0, period_factor=1.8, factor=0.5, min_ratio=0.1)


def _drive(lengths, cfg=CFG):
  """(multiplier used by each step's updates, the state after each step), feeding `lengths` one step at a time."""
  state, scales, states = lr_decay.SurgeState(), [], []
  for x in lengths:
    scales.append(lr_decay.multiplier(state, cfg))
    state = lr_decay.update(state, x, cfg)
    states.append(state)
  return scales, states


def test_trigger_fires_at_the_first_step_above_ratio_times_baseline():
  # baseline = mean(10, 12, 8) = 10, threshold 30: 20 and 29 pass, 30 is not above it, step 7 (31) fires
  head = [10.0, 12.0, 8.0, 20.0, 29.0, 30.0, 31.0]
  tail = [5.0, 100.0] + [40.0] * 51  # after the surge nothing re-fires, a drop does not undo it
  scales, states = _drive(head + tail)
  assert [s.surge_step for s in states[:6]] == [0] * 6
  assert all(s.surge_step == 7 for s in states[6:])
  assert states[2].baseline(CFG) == 10.0 and states[1].baseline(CFG) is None
  assert lr_decay.decay_period(states[-1], CFG) == 12  # int(1.8 * 7)
  # steps 1..7 at the full rate; P = 12 steps after the surge (8..19) still full, then halved every 12 steps
  # (20..31: 1/2, 32..43: 1/4, 44..55: 1/8), then the floor 0.1 (steps 56..60)
  want = [1.0] * 19 + [0.5] * 12 + [0.25] * 12 + [0.125] * 12 + [0.1] * 5
  assert scales == want


def test_no_trigger_on_a_flat_series_or_inside_the_baseline_window():
  rng = np.random.default_rng(0)
  scales, states = _drive(list(40.0 + rng.uniform(-20, 40, 500)))  # at most 80 < 3 x ~40
  assert scales == [1.0] * 500 and states[-1].surge_step == 0
  # a spike inside the baseline window only raises the baseline (mean 40): it is never tested against it
  scales, states = _drive([10.0, 10.0, 100.0, 110.0, 119.0])
  assert states[-1].surge_step == 0 and states[-1].baseline(CFG) == 40.0 and scales == [1.0] * 5
  # window of 1, ratio 1.5: 100 -> 150 does not fire, 151 does
  one = lr_decay.LrDecayConfig(baseline_steps=1, surge_ratio=1.5, period_factor=1.0)
  assert [s.surge_step for s in _drive([100.0, 150.0, 151.0], one)[1]] == [0, 0, 3]
  with pytest.raises(ValueError, match="finite"):
    lr_decay.update(lr_decay.SurgeState(), math.nan, CFG)


def _fired(scale_steps: int) -> lr_decay.SurgeState:
  """A state whose next step's multiplier is 0.5 ** scale_steps (surge at step 10, period int(1.8 * 10) = 18)."""
  return lr_decay.SurgeState(seen=10 + 18 * scale_steps, length_sum=30.0, surge_step=10)


def _deltas(learner, batch, params, scales):
  state = learner.init_state(jax.tree.map(jnp.array, params))
  before = jax.tree.map(np.asarray, params)
  metrics = []
  for s in scales:
    state, m = learner.update(state, batch, s)
    metrics.append(m)
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, state.params, before), metrics


def test_learner_update_uses_the_decayed_learning_rate():
  scale = lr_decay.multiplier(_fired(2), CFG)
  assert scale == 0.25
  model = _model()
  batch = _batch(model, n=8)
  _, params = nnx.split(model)
  lr = 1e-2
  opt = OptimizerConfig(learning_rate=lr, max_grad_norm=0.0)
  learner = Learner(model, LossConfig(method="grpo"), opt, micro_batch_size=4)
  full, m_full = _deltas(learner, batch, params, [1.0])
  decayed, m_dec = _deltas(learner, batch, params, [scale])
  # Adam's first step moves each parameter by lr * |g| / (|g| + eps): about lr where the gradient is not ~0
  biggest = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(decayed))
  assert biggest == pytest.approx(lr * scale, rel=1e-3)
  for a, b in zip(jax.tree.leaves(decayed), jax.tree.leaves(full)):
    np.testing.assert_allclose(a, scale * b, rtol=1e-4, atol=1e-9)
  assert float(m_dec[0]["lr"]) == pytest.approx(lr * scale) and float(m_full[0]["lr"]) == pytest.approx(lr)
  # with weight decay and non-zero moments (two updates): the same as an optimizer built at lr * scale
  wd = dict(max_grad_norm=0.0, weight_decay=0.1)
  scaled, _ = _deltas(
      Learner(model, LossConfig(), OptimizerConfig(learning_rate=lr, **wd), micro_batch_size=4),
      batch,
      params,
      [scale] * 2,
  )
  low = Learner(model, LossConfig(), OptimizerConfig(learning_rate=lr * scale, **wd), micro_batch_size=4)
  ref, _ = _deltas(low, batch, params, [1.0] * 2)
  for a, b in zip(jax.tree.leaves(scaled), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9)


def test_trigger_state_round_trips_through_the_checkpoint_json():
  from minpro_jax.run.trainer import RunProgress

  lengths = [10.0, 12.0, 8.0, 20.0, 29.0, 30.0, 31.0] + [40.0] * 40
  want, _ = _drive(lengths)
  state = lr_decay.SurgeState()
  for x in lengths[:25]:  # "killed" after step 25, 6 steps into the first halving period... resumed below
    state = lr_decay.update(state, x, CFG)
  saved = json.dumps(RunProgress(lr_decay=state.to_json()).to_json())  # what `Trainer._save` writes
  restored = lr_decay.SurgeState.from_json(RunProgress.from_json(json.loads(saved)).lr_decay)
  assert restored == state
  got = []
  for x in lengths[25:]:
    got.append(lr_decay.multiplier(restored, CFG))
    restored = lr_decay.update(restored, x, CFG)
  assert got == want[25:] and 0.5 in got and 0.25 in got
  # a checkpoint written before this field existed restores to the empty trigger state
  old = RunProgress().to_json()
  del old["lr_decay"]
  assert lr_decay.SurgeState.from_json(RunProgress.from_json(old).lr_decay) == lr_decay.SurgeState()


SCRIPTED = [
    2.0,
    2.0,
    7.0,
    1.0,
    1.0,
]  # baseline 2 over steps 1-2, step 3 above 3 x 2 fires (T = 3, P = int(0.5 * 3) = 1)
DECAY_FIELDS = {
    "optimizer.lr_decay_on_length_surge": True,
    "optimizer.lr_decay_baseline_steps": 2,
    "optimizer.lr_decay_period_factor": 0.5,
}


def _trainer_run(tmp_path, monkeypatch, name, total_steps):
  from minpro_jax.run.trainer import Trainer

  sample_step = Trainer.sample_step

  def scripted(self, state, step):  # the real step, with its logged mean length replaced by the script
    batch, metrics = sample_step(self, state, step)
    return batch, {**metrics, "response/length_mean": SCRIPTED[step]}

  monkeypatch.setattr(Trainer, "sample_step", scripted)
  ov = tiny_overrides(tmp_path, workdir=str(tmp_path / name), total_steps=total_steps, **DECAY_FIELDS)
  Trainer.from_config(make_config(ov)).run()
  recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in recs if 0 <= r["step"] < total_steps}


@pytest.mark.slow
def test_trainer_logs_the_decay_and_a_resumed_run_decays_at_the_same_step(tmp_path, monkeypatch):
  whole = _trainer_run(tmp_path, monkeypatch, "whole", 5)
  assert [whole[s]["lr_decay/multiplier"] for s in range(5)] == [1.0, 1.0, 1.0, 1.0, 0.5]
  assert [whole[s]["lr_decay/triggered"] for s in range(5)] == [0, 0, 1, 0, 0]
  assert whole[4]["lr_decay/surge_step"] == 3 and whole[4]["lr_decay/baseline_length"] == 2.0
  lr = make_config(tiny_overrides(tmp_path)).optimizer.learning_rate
  assert [whole[s]["learn/lr"] for s in (1, 2, 3, 4)] == pytest.approx([lr, lr, lr, lr / 2])
  # stopped after step 2 (the surge step), resumed to 5: without the saved state step 4 would run at the full rate
  _trainer_run(tmp_path, monkeypatch, "split", 3)
  resumed = _trainer_run(tmp_path, monkeypatch, "split", 5)
  for s in (3, 4):
    for k in ("lr_decay/multiplier", "lr_decay/surge_step", "learn/lr", "learn/loss", "reward/mean"):
      assert resumed[s][k] == whole[s][k], (s, k)


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("lr_decay_surge_ratio", 1.0, "must be > 1"),
        ("lr_decay_surge_ratio", math.inf, "must be a finite number"),
        ("lr_decay_baseline_steps", 0, "must be an int >= 1"),
        ("lr_decay_period_factor", 0.0, "must be > 0"),
        ("lr_decay_factor", 1.0, r"must lie in \(0, 1\)"),
        ("lr_decay_min_ratio", 0.0, r"must lie in \(0, 1\]"),
    ],
)
def test_bad_lr_decay_config_is_refused(tmp_path, field, value, msg):
  c = make_config(tiny_overrides(tmp_path, **{"optimizer.lr_decay_on_length_surge": True, f"optimizer.{field}": value}))
  with pytest.raises(run_config.ConfigError, match=rf"config\.optimizer\.{field}: .*{msg}"):
    run_config.validate_config(c)


def test_default_config_is_off_and_valid(tmp_path):
  c = make_config(tiny_overrides(tmp_path))
  assert run_config.lr_decay_config(c) is None
  c.optimizer.lr_decay_on_length_surge = True
  assert run_config.lr_decay_config(c) == lr_decay.LrDecayConfig()  # the paper's defaults
