"""The gradient-only entry point (`minpro_jax.lab.policy_gradient`): each objective's gradient from one VJP equals
the gradient the learner's own update steps on, and bad configs are refused."""

import jax
import numpy as np
import pytest
from flax import nnx
from test_learner import _batch, _model, _sgd_delta

from minpro_jax.lab.policy_gradient import flatten, policy_gradients
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig

CONFIGS = (
    LossConfig("minpro"),
    LossConfig("minpro", (("prefix_statistic", "prod"),)),
    LossConfig("grpo"),
    LossConfig("gspo"),
    LossConfig("m2po"),
    LossConfig("cispo", kl_coef=0.1),
    LossConfig("cispo", (("rollout_is", "sequence"), ("tis_cap", 1e8))),
)


@pytest.fixture(scope="module")
def setup():
  model = _model()
  batch = _batch(model)
  learner = Learner(model, CONFIGS[0], OptimizerConfig(), micro_batch_size=8)
  params = nnx.split(model)[1]
  return model, batch, policy_gradients(learner, params, batch, CONFIGS)


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_each_gradient_is_the_learners_update_gradient(setup, i):
  model, batch, out = setup
  delta, _, _ = _sgd_delta(model, CONFIGS[i], batch, mb=4)  # -grad, accumulated over 2 micro-batches
  got = jax.tree.map(lambda g: np.asarray(g[i], np.float64), out.grads)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(delta))
  assert scale > 0
  err = max(float(np.max(np.abs(a + b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(delta)))
  assert err <= 1e-5 * scale + 1e-7, (CONFIGS[i], err, scale)


def test_outputs_shapes_and_weights(setup):
  _, batch, out = setup
  m, (n, length) = len(CONFIGS), batch.tokens.shape
  assert out.token_weights.shape == (m, n, length) and out.logp.shape == (n, length)
  flat = flatten(out.grads)
  assert flat.shape[0] == m and flat.shape[1] == sum(x[0].size for x in jax.tree.leaves(out.grads))
  # on the response tokens cispo's weight is the clipped ratio: > 0
  mask = batch.response_mask
  assert np.all(np.asarray(out.token_weights[5])[mask] > 0)
  np.testing.assert_allclose(np.asarray(out.logp)[mask], batch.learner_logp[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "cfgs, match",
    [
        ((), "empty"),
        ((LossConfig("grpo"), LossConfig("cispo", temperature=0.7)), r"loss_cfgs\[1\].temperature"),
        ((LossConfig("grpo", entropy_coef=0.01),), r"loss_cfgs\[0\].entropy_coef"),
        ((LossConfig("grpo", (("prefix_statistic", "min"),)),), "prefix_statistic"),
    ],
)
def test_bad_configs_are_refused(cfgs, match):
  model = _model()
  learner = Learner(model, LossConfig("grpo"), OptimizerConfig(), micro_batch_size=8)
  with pytest.raises(ValueError, match=match):
    policy_gradients(learner, nnx.split(model)[1], _batch(model), cfgs)
