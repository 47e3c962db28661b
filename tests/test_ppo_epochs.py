"""PPO epochs, the proximal score pass, ESS metrics, VCPO's step and the gradient cosine in the learner's loop
(`minpro_jax.rl.process_inputs.updates`): num_epochs = 2 is two explicit passes over the same mini-batches; the score
pass runs only where the objective reads pi_prox; the metrics match numpy on the update's own log-probs; and one
short trainer run wires them into metrics.jsonl and the plots."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_learner import _batch, _model
from train_helpers import make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.rl import process_inputs
from minpro_jax.rl.epochs import epoch_rows
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.learner_inputs import UpdateInputs
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.run import run_config


def _sgd_learner(model, method="grpo", hparams=(), **kw):
  """A learner whose optimizer is SGD at rate 1 without clipping: an update moves the parameters by -gradient."""
  learner = Learner(model, LossConfig(method=method, hparams=hparams), OptimizerConfig(max_grad_norm=0.0),
                    micro_batch_size=2, **kw)  # fmt: skip
  learner.optimizer = optax.sgd(1.0)
  return learner


def _params(model):
  return jax.tree.map(jnp.array, nnx.split(model)[1])


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def model_and_batch():
  model = _model()
  batch = _batch(model, n=8, seed=3)  # 4 groups of 2 (group_ids = row // 2)
  return model, batch.replace(advantages=batch.advantages * 10)  # steps large enough to move the ratios


def test_two_epochs_equal_two_explicit_passes(model_and_batch):
  """process_inputs.updates(num_epochs=2) against `Learner.update` on pass 0's mini-batches then pass 1's
  (`epoch_rows`): the same parameters after the step, staleness 0..3 (one more per update), twice the tokens, and
  each update's gradient cosine the cosine of the consecutive SGD steps (NaN for the first)."""
  model, batch = model_and_batch
  learner = _sgd_learner(model)
  order = epoch_rows(8, 2, 1, seed=5, version=0)
  assert not np.array_equal(order, np.arange(8))  # pass 1 really reorders the groups
  state, ups, stale, tokens = process_inputs.updates(
      learner, learner.init_state(_params(model)), batch, 2, num_epochs=2, group_size=2, seed=5
  )
  explicit = learner.init_state(_params(model))
  steps = [_flat(explicit.params)]
  for rows in (np.arange(8), order):
    for mini in batch.select(rows).split(2):
      explicit, _ = learner.update(explicit, mini)
      steps.append(_flat(explicit.params))
  np.testing.assert_array_equal(_flat(state.params), steps[-1])
  assert int(state.step) == 4 and stale.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  assert tokens == 2 * int(batch.segment_ids.sum())
  deltas = np.diff(np.stack(steps), axis=0)  # -gradient of each update
  assert np.isnan(ups[0]["grad_cosine"])
  for k in range(1, 4):
    want = deltas[k] @ deltas[k - 1] / np.linalg.norm(deltas[k]) / np.linalg.norm(deltas[k - 1])
    np.testing.assert_allclose(ups[k]["grad_cosine"], want, rtol=1e-4, atol=1e-6)


def test_update_ess_metrics_and_vcpo_step(model_and_batch):
  """The first update's ESS fractions against numpy on the model's own log-probs (GRPO's token weights are the
  ratios rho_t; the sequence ratio is exp(sum_t l_t)); with `ess_step` the SGD step is sqrt(ESS / B) of it."""
  model, batch = model_and_batch
  mini = batch.select(slice(0, 4))
  logp = np.asarray(token_logprobs(model, jnp.asarray(mini.tokens), jnp.asarray(mini.segment_ids),
                                   jnp.asarray(mini.positions)).logp, np.float64)  # fmt: skip
  lr = np.where(mini.response_mask, logp - mini.behavior_logp, 0.0)
  rho = np.exp(lr[mini.response_mask])
  seq = np.exp(lr.sum(1) - lr.sum(1).max())
  seq_mean = np.asarray([np.exp(lr[i][mini.response_mask[i]]).mean() for i in range(4)])
  kish = lambda w: w.sum() ** 2 / (len(w) * (w * w).sum())  # noqa: E731
  before = _flat(_params(model))
  moved = {}
  for ess_step in (False, True):
    learner = _sgd_learner(model, ess_step=ess_step)
    state, m = learner.update(learner.init_state(_params(model)), mini)
    moved[ess_step] = _flat(state.params) - before
    np.testing.assert_allclose(m["ess/token_frac"], kish(rho), rtol=1e-4)
    np.testing.assert_allclose(m["ess/seq_frac"], kish(seq_mean), rtol=1e-4)
    np.testing.assert_allclose(m["ess/seq_is_frac"], kish(seq), rtol=1e-4)
    np.testing.assert_allclose(m["ess_step_scale"], np.sqrt(kish(seq)) if ess_step else 1.0, rtol=1e-4)
  assert kish(seq) < 0.95  # the step really shrinks (by 4 %, far above the tolerance)
  # parameters - initial in float32: ~1e-7 of round-off at parameters of ~1; the 4 % scale moves them by ~1e-4
  np.testing.assert_allclose(moved[True], np.sqrt(kish(seq)) * moved[False], rtol=1e-4, atol=1e-6)


def test_decoupled_ppo_scores_pi_prox_before_the_first_update(model_and_batch):
  """proximal='score': the first update of a step has pi_prox = pi_theta (scored at the same parameters), so r = 1
  is never clipped and its gradient is the behaviour-weighted min(pi / mu, 2) A grad log pi: CISPO's with the cap
  1 + eps_high = 2, the same SGD step. (That the later updates keep the step's first pi_prox is checked with a fake
  learner below.)"""
  model, batch = model_and_batch
  first = batch.select(slice(0, 4))
  at_first = first.response_mask & (np.cumsum(first.response_mask, axis=1) == 1)  # each response's first token
  first = first.replace(behavior_logp=np.where(at_first, first.behavior_logp - 1.5, first.behavior_logp))  # rho x e^1.5
  learner = _sgd_learner(model, "decoupled_ppo")
  state, ups, _, _ = process_inputs.updates(learner, learner.init_state(_params(model)), first, 1)
  cispo = _sgd_learner(model, "cispo", (("eps_high", 1.0),))
  want, m = cispo.update(cispo.init_state(_params(model)), first)
  np.testing.assert_allclose(_flat(state.params), _flat(want.params), rtol=1e-4, atol=1e-6)
  assert float(ups[0]["policy/clip_frac_high"]) == float(ups[0]["policy/clip_frac_low"]) == 0.0
  assert float(ups[0]["policy/behavior_weight_clip_frac"]) > 0 and float(m["policy/clip_frac_high"]) > 0  # cap binds


class _FakeLearner:
  """What `process_inputs.updates` uses of a learner, recording the score calls and each update's arrays."""

  def __init__(self, method, hparams=()):
    self.loss_cfg = LossConfig(method=method, hparams=hparams)
    self.scored, self.updated = [], []

  def micro_batch(self, rows):
    return rows

  def score(self, params, batch, chunk_rows=None):
    self.scored.append((params, chunk_rows))
    return np.full(batch.tokens.shape, -0.5, np.float32)

  def update_inputs(self, batch, mb):
    return UpdateInputs.of(batch), 0.0

  def update_arrays(self, state, arrays, lr_scale=1.0, *, pad_fraction=None, previous_grads=None):
    self.updated.append((arrays, previous_grads))
    return types.SimpleNamespace(params=state.params, step=state.step + 1), {"loss": 0.0}, f"g{len(self.updated)}"


@pytest.mark.parametrize(
    "method,hparams,scores",
    [
        ("grpo", (), 0),
        ("minpro", (), 0),
        ("decoupled_ppo", (), 1),
        ("decoupled_ppo", (("proximal", "interpolate"),), 0),
    ],
)
def test_the_proximal_score_pass_runs_only_where_the_objective_reads_it(model_and_batch, method, hparams, scores):
  """Once per step (not per pass or update) at the parameters before the first update, for decoupled PPO with
  proximal='score'; never for the others. Interpolation gets each update A-3PO's alpha instead: the batch was
  sampled at version 2, the step starts at 10, so alpha = 8 / (10 + k - 2) for update k. Every update after the first
  gets the previous one's gradient."""
  _, batch = model_and_batch
  batch = batch.replace(policy_version=np.full(8, 2, np.int64))
  fake = _FakeLearner(method, hparams)
  state = types.SimpleNamespace(params="params@10", step=10)
  state, _, stale, _ = process_inputs.updates(fake, state, batch, 2, num_epochs=2, group_size=2, seed=0)
  assert fake.scored == [("params@10", 4)] * scores
  assert stale.tolist() == [8] * 4 + [9] * 4 + [10] * 4 + [11] * 4
  assert [g for _, g in fake.updated] == [None, "g1", "g2", "g3"]
  for k, (arrays, _) in enumerate(fake.updated):
    assert (arrays.proximal_logp is not None) == bool(scores)
    if hparams:
      assert float(arrays.proximal_alpha) == pytest.approx(8 / (10 + k - 2))
    else:
      assert arrays.proximal_alpha is None


def test_a_trainer_run_logs_epochs_ess_and_cosine(tmp_path):
  """2 passes x 2 updates a step at delay 1, decoupled PPO (A-3PO interpolation) with VCPO's step: 4 updates a
  learning step, staleness d E n + e n + j = 4..7 once the buffer is full, the ESS fractions, the step scale and the
  gradient cosine in metrics.jsonl, and the ESS plot."""
  from minpro_jax.run.trainer import Trainer

  c = make_config(
      tiny_overrides(
          tmp_path,
          total_steps=3,
          num_epochs=2,
          **{
              "loss.method": "decoupled_ppo",
              "loss.proximal": "interpolate",
              "learner.ess_step": True,
              "loss.entropy_coef": 0.05,
              "log.plots": True,
          },  # fmt: skip (entropy: a gradient even at equal rewards)
      )
  )
  summary = Trainer.from_config(c).run()
  assert summary["policy_version"] == 2 * 2 * 2
  recs = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
  assert (recs[1]["staleness/min"], recs[1]["staleness/max"]) == (0, 3)  # sampled by version 0
  assert (recs[2]["staleness/min"], recs[2]["staleness/max"]) == (4, 7)
  for s in (1, 2):
    r = recs[s]
    assert r["learn/updates"] == 4 and len(r["learn/grad_cosine_by_update"]) == 4
    assert r["learn/grad_cosine_by_update"][0] is None and -1 <= r["learn/grad_cosine"] <= 1
    for k in ("learn/ess/token_frac", "learn/ess/seq_frac", "learn/ess/seq_is_frac"):
      assert 0 < r[k] <= 1
    np.testing.assert_allclose(r["learn/ess_step_scale"], np.mean(np.sqrt(r["learn/ess/seq_is_frac_by_update"])),
                               rtol=1e-5)  # fmt: skip
    assert "learn/policy/proximal_log_ratio_mean" in r
  assert (tmp_path / "run" / "ess.png").exists()


def test_the_loss_config_of_decoupled_ppo(tmp_path):
  """Which pi_prox the learner provides follows loss.proximal; decoupled PPO refuses TIS on top of its own
  behaviour weight, naming the field."""
  lc = run_config.loss_config(make_config(tiny_overrides(tmp_path, **{"loss.method": "decoupled_ppo"})))
  assert (lc.proximal, lc.reads_proximal_logp) == ("score", True)
  lc = run_config.loss_config(
      make_config(tiny_overrides(tmp_path, **{"loss.method": "decoupled_ppo", "loss.proximal": "interpolate"}))
  )
  assert (lc.proximal, lc.reads_proximal_logp) == ("interpolate", False)
  assert LossConfig(method="grpo").proximal is None
  c = make_config(tiny_overrides(tmp_path, **{"loss.method": "decoupled_ppo", "loss.rollout_is": "token"}))
  with pytest.raises(ConfigError, match=r"config\.loss\.rollout_is: decoupled_ppo weights each token"):
    run_config.loss_config(c)
