"""`log.mismatch_every`: the learner's score pass runs only where a step logs the sampler-learner mismatch or the loss
reads `learner_logp` (TIS/MIS), and skipping it changes nothing else, bit for bit."""

import json
import types
import zlib

import jax
import numpy as np
import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax import run_config
from minpro_jax.rl.learner import LossConfig
from minpro_jax.study.runner import config_differences

SKIPPED = ("time/", "throughput/")  # wall-clock figures, different in every run


def _coin_grade(texts, golds, **kwargs):
  """Rewards 0/1 from a checksum of the text: mixed rewards inside groups even for the tiny model, so the
  advantages, the loss and the updates are not zero."""
  del golds, kwargs
  return [float(zlib.crc32(t.encode()) % 2) for t in texts], {"no_answer": 0, "timeout": 0}


def _run(tmp_path, name, **extra):
  from minpro_jax.trainer import Trainer

  ov = tiny_overrides(  # no warm start, the smallest evaluation: the steps are what is compared
      tmp_path,
      workdir=str(tmp_path / name),
      total_steps=3,
      delay=1,
      **{"sft.enabled": False, "eval.num_problems": 2, "eval.n": 1, "eval.ks": (1,), **extra},
  )
  tr = Trainer.from_config(make_config(ov))
  scored = []
  score = tr.learner.score
  tr.learner.score = lambda params, batch, **kw: scored.append(batch.size) or score(params, batch, **kw)
  tr.run()
  recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  return tr, scored, {r["step"]: r for r in recs}


def test_skipping_the_score_pass_changes_nothing_but_the_mismatch_metrics(tmp_path, monkeypatch):
  monkeypatch.setattr("minpro_jax.trainer.grade_split", _coin_grade)
  every, base_scored, base = _run(tmp_path, "every")
  skip, skip_scored, skipped = _run(tmp_path, "skip", **{"log.mismatch_every": 2})
  assert base_scored == [8] * 3 and skip_scored == [8] * 2  # steps 0, 1, 2 against steps 0 and 2 (8 rows a step)
  assert sorted(base) == sorted(skipped) == [-1, 0, 1, 2, 3]  # -1 and 3: the evaluations at the start and end
  assert base[1]["learn/loss"] != 0 and base[2]["learn/loss"] != 0  # what is compared below are real updates
  for step, b in base.items():
    s = skipped[step]
    dropped = step == 1  # the one step that skips the pass: no sampler_learner/* metrics
    want = {k: v for k, v in b.items() if not k.startswith(SKIPPED) and not (dropped and k.startswith("sampler_"))}
    assert {k: v for k, v in s.items() if not k.startswith(SKIPPED)} == want, step
    assert ("sampler_learner/mismatch_k3" in s) == (step in (0, 2)), step
  for a, b in zip(jax.tree.leaves(every.final_state), jax.tree.leaves(skip.final_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _scoring(overrides, tmp_path, step):
  from minpro_jax.trainer import Trainer

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


def test_the_field_is_checked_and_does_not_make_a_finished_study_run_stale(tmp_path):
  c = make_config(tiny_overrides(tmp_path, **{"log.mismatch_every": 0}))
  with pytest.raises(run_config.ConfigError, match=r"^config\.log\.mismatch_every: .*>= 1"):
    run_config.validate_config(c, num_devices=1)
  before = make_config(tiny_overrides(tmp_path)).to_dict()
  del before["log"]["mismatch_every"]  # a summary.json written before the field existed
  for every in (1, 10):
    assert (
        config_differences(
            before, make_config(tiny_overrides(tmp_path, **{"log.mismatch_every": every})).to_dict(), set()
        )
        == []
    )
