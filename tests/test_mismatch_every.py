"""`log.mismatch_every`: the learner's score pass runs only where a step logs the sampler-learner mismatch or the loss
reads `learner_logp` (TIS/MIS), and skipping it changes nothing else, bit for bit."""

import types

import jax
import numpy as np
import pytest
from train_helpers import TIMING_PREFIXES, coin_grade, global_steps, make_config, tiny_overrides

from minpro_jax.rl.learner import LossConfig
from minpro_jax.run import run_config


def _steps(trainer, params, loader_state, every: int, num_steps: int = 3):
  """The trainer's global steps 0..num_steps-1 (sample, buffer, learn: `Trainer._run`'s loop without evaluation and
  checkpoints) from `params` with `log.mismatch_every=every`; returns (the final state, each step's metrics, the
  rows each score pass scored)."""
  trainer.c.log.mismatch_every = every
  scored = []
  score = trainer.learner.score
  trainer.learner.score = lambda p, batch, **kw: scored.append(batch.size) or score(p, batch, **kw)
  steps, state = global_steps(trainer, params, loader_state, num_steps)
  records = [{k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)} for _, m in steps]
  trainer.learner.score = score
  return state, records, scored


def test_skipping_the_score_pass_changes_nothing_but_the_mismatch_metrics(tmp_path, monkeypatch):
  """Two runs of one trainer (its programs compiled once): every step scored, and every other step."""
  from flax import nnx

  from minpro_jax.run.trainer import Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  trainer = Trainer.from_config(make_config(tiny_overrides(tmp_path, delay=1, **{"sft.enabled": False})))
  params, loader_state = nnx.split(trainer.model)[1], trainer.loader.get_state()
  every, base, base_scored = _steps(trainer, params, loader_state, every=1)
  skip, skipped, skip_scored = _steps(trainer, params, loader_state, every=2)
  trainer.close()
  assert base_scored == [8] * 3 and skip_scored == [8] * 2  # steps 0, 1, 2 against steps 0 and 2 (8 rows a step)
  assert base[1]["learn/loss"] != 0 and base[2]["learn/loss"] != 0  # what is compared below are real updates
  for step, (b, s) in enumerate(zip(base, skipped)):
    dropped = step == 1  # the one step that skips the pass: no sampler_learner/* metrics
    assert s == {k: v for k, v in b.items() if not (dropped and k.startswith("sampler_"))}, step
    assert ("sampler_learner/mismatch_k3" in s) == (step != 1), step
  for a, b in zip(jax.tree.leaves(every), jax.tree.leaves(skip)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _scoring(overrides, tmp_path, step):
  from minpro_jax.run.trainer import Trainer

  c = make_config(tiny_overrides(tmp_path, **overrides))
  trainer = types.SimpleNamespace(c=c, learner=types.SimpleNamespace(loss_cfg=run_config.loss_config(c)))
  return Trainer.scoring(trainer, step)


@pytest.mark.parametrize(
    "overrides,scores",
    [
        ({}, [True] * 7),  # the default: every step
        ({"log.mismatch_every": 3}, [True, False, False, True, False, False, True]),
        ({"log.mismatch_every": 3, "loss.method": "grpo", "mipu.rollback": True}, [True, False, False, True]),
        ({"log.mismatch_every": 3, "loss.rollout_is": "token"}, [True] * 7),  # TIS reads learner_logp
        ({"log.mismatch_every": 3, "loss.rollout_mis": "sequence"}, [True] * 7),  # MIS too
    ],
)
def test_the_score_pass_runs_when_the_loss_or_the_step_needs_it(tmp_path, overrides, scores):
  """A function of the step alone (a resumed run skips the same steps); the metrics every N steps either way."""
  every = overrides.get("log.mismatch_every", 1)
  for step, score in enumerate(scores):
    assert _scoring(overrides, tmp_path, step) == (score, step % every == 0), step


def test_only_rollout_correction_reads_learner_logp():
  assert not LossConfig().reads_learner_logp
  for method in ("minpro", "grpo", "gspo", "cispo", "m2po"):
    assert not LossConfig(method=method).reads_learner_logp
  assert LossConfig(method="grpo", hparams=(("rollout_is", "token"), ("tis_cap", 2.0))).reads_learner_logp
  assert LossConfig(method="minpro", hparams=(("rollout_mis", "geometric"),)).reads_learner_logp


def test_the_field_is_checked(tmp_path):
  c = make_config(tiny_overrides(tmp_path, **{"log.mismatch_every": 0}))
  with pytest.raises(run_config.ConfigError, match=r"^config\.log\.mismatch_every: .*>= 1"):
    run_config.validate_config(c, num_devices=1)
