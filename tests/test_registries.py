"""Extending the trainer: a new policy objective and a new data source are one registration each."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax.data.records import MathProblem
from minpro_jax.data.sources import SOURCES, register_source
from minpro_jax.errors import ConfigError
from minpro_jax.rl.objectives import OBJECTIVES, register_objective
from minpro_jax.run.run_config import validate_config


@pytest.fixture
def toy_registrations():
  """A REINFORCE objective with one hyper-parameter, and a generator of two-digit sums."""

  @register_objective("toy_reinforce", defaults={"scale": 1.0})
  def toy_reinforce(inputs, hp):
    loss = -hp["scale"] * inputs.adv * inputs.logp
    weights = jnp.where(inputs.valid, 1.0, 0.0)
    return loss, weights, {"toy_scale": jnp.asarray(hp["scale"], jnp.float32)}

  @register_source("toy_sums", generator=True)
  def toy_sums(data_config, *, seed, size):
    del data_config
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, 50, size=(size, 2))
    return [
        MathProblem(id=f"toy/{seed}/{i}", prompt=f"What is {a} + {b}?", answer=str(a + b), source="toy")
        for i, (a, b) in enumerate(pairs)
    ]

  yield
  del OBJECTIVES["toy_reinforce"], SOURCES["toy_sums"]


def test_a_registered_objective_and_source_train_one_step(tmp_path, toy_registrations):
  from minpro_jax.run.trainer import Trainer

  ov = tiny_overrides(
      tmp_path,
      total_steps=1,
      delay=0,
      **{
          "data.source": "toy_sums",
          "loss.method": "toy_reinforce",
          "tokenizer.vocab_size": 300,
          "data.max_prompt_tokens": 64,
      },
  )
  c = make_config(ov)
  c.loss.scale = 0.5  # a config field named like the objective's hyper-parameter reaches it
  summary = Trainer.from_config(c).run()
  assert summary["policy_version"] == 2  # one global step, num_updates_per_step=2
  assert list(summary["eval_problems"]) == ["toy_sums_heldout"]  # a generator source gets a held-out draw
  recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step0 = next(r for r in recs if r["step"] == 0)
  assert step0["learn/policy/toy_scale"] == 0.5 and np.isfinite(step0["learn/loss"])


def test_a_field_the_method_does_not_take_is_refused(tmp_path, toy_registrations):
  c = make_config(tiny_overrides(tmp_path, **{"loss.method": "toy_reinforce", "loss.eps_high": 0.3}))
  with pytest.raises(ConfigError, match=r"config\.loss\.eps_high: method 'toy_reinforce' does not take it"):
    validate_config(c, num_devices=1)
  with pytest.raises(ConfigError, match=r"config\.data\.source: 'nope' is not a data source"):
    validate_config(make_config(tiny_overrides(tmp_path, **{"data.source": "nope"})), num_devices=1)
