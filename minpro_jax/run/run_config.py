"""A training config (`configs/default.py`) checked and turned into the typed configs of its parts.

`validate_config` runs before anything expensive; the checks of single parts are `minpro_jax/run/config_checks.py`
(their public names are importable from here as well). Each field is checked once, against the choices of the module
that owns it (imported, never copied), and a failure is a `ConfigError` whose message starts with
`config.<field>:` and says how to fix it. Where a part validates its own settings (`SamplingParams`, the
objectives' hyper-parameters, `ModelConfig`), the config is handed to it and its error is renamed to the config
field. `loss_config`, `optimizer_config` and `sampling_params` build the typed configs the learner and the
sampler take. The resume check (one workdir, one experiment) is `minpro_jax/run/resume_check.py`.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from minpro_jax.data.worked import check_sft_target
from minpro_jax.errors import ConfigError
from minpro_jax.rl import mipu
from minpro_jax.rl.advantages import ADVANTAGE_MODES
from minpro_jax.rl.learner import LossConfig
from minpro_jax.rl.lr_decay import LrDecayConfig
from minpro_jax.rl.objectives import OBJECTIVES, get_objective, policy_loss, resolve_hparams
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.rl.packing import check_row_tokens
from minpro_jax.run import config_checks, sampler_setup
from minpro_jax.run.config_checks import (  # the checks' public names stay importable from here
    MODEL_SOURCES,
    REWARD_MODES,
    check_eval,
    check_micro_batch_split,
    check_mipu_problem_count,
    check_overrides_match,
    check_routes_fit,
    eval_files,
    hf_model_config,
    learner_micro_batch,
    model_overrides,
    parse_mesh_shape,
    resolve_mesh_shape,
)
from minpro_jax.run.config_checks import need as _need
from minpro_jax.run.config_domains import check_domains, sft_enabled  # noqa: F401 (sft_enabled: the run's API)
from minpro_jax.runtime.rules import parse_rules

__all__ = [
    "ConfigError",
    "validate_config",
    "validate_shapes_config",
    "check_eval",
    "check_micro_batch_split",
    "check_mipu_problem_count",
    "check_overrides_match",
    "check_routes_fit",
    "eval_files",
    "hf_model_config",
    "learner_micro_batch",
    "model_overrides",
    "parse_mesh_shape",
    "resolve_mesh_shape",
    "loss_config",
    "optimizer_config",
    "lr_decay_config",
]

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "cosine", "linear")  # minpro_jax.rl.optimizer.make_schedule's schedules


def validate_config(c, num_devices: int | None = None) -> None:
  """Checks every field and cross-field constraint of a training config.

  Args:
    c: the `ml_collections.ConfigDict` of `configs/default.py` (or a config built on it).
    num_devices: devices the mesh must use (default `len(jax.devices())`).

  Raises:
    ConfigError: naming `config.<field>` and the fix.
  """
  config_checks.check_run(c)
  validate_shapes_config(c)
  config_checks.check_model(c)
  config_checks.check_data(c)
  _need(
      c.sampling.temperature > 0,
      "sampling.temperature",
      "must be > 0 for RL (the learner scores the sampled tokens under the temperature-scaled distribution)",
  )
  _need(c.advantage_mode in ADVANTAGE_MODES, "advantage_mode", f"{c.advantage_mode!r}; choose one of {ADVANTAGE_MODES}")
  _need(c.reward.mode in REWARD_MODES, "reward.mode", f"{c.reward.mode!r}; choose one of {REWARD_MODES}")
  r = c.reward
  _need(
      0 <= r.overlong_buffer <= c.sampling.max_new_tokens,
      "reward.overlong_buffer",
      f"must lie in [0, sampling.max_new_tokens={c.sampling.max_new_tokens}] (0 = off), got {r.overlong_buffer}",
  )
  _need(r.overlong_factor >= 0, "reward.overlong_factor", f"must be >= 0, got {r.overlong_factor}")
  check_eval(c)
  config_checks.check_mipu(c)
  if sft_enabled(c):
    ok = c.sft.steps > 0 and c.sft.batch_size > 0 and c.sft.learning_rate > 0
    _need(ok, "sft", "sft.steps, sft.batch_size and sft.learning_rate must be > 0 (or set sft.enabled=False)")
    w = c.sft.row_tokens
    _need(
        not w or w >= c.sft.max_len,
        "sft.row_tokens",
        f"{w} is below sft.max_len={c.sft.max_len}, the longest example; set it to >= {c.sft.max_len} (e.g. "
        f"{4 * c.sft.max_len}: several examples per row), or 0 to turn packing off",
    )
  check_domains(c)  # the fields no part checks itself, and settings under which nothing is learnt
  _need(
      num_epochs(c) == 1 or not c.learner.row_tokens or jax.process_count() == 1,
      "num_epochs",
      f"{num_epochs(c)} passes reorder the batch's groups after the first, but with learner.row_tokens each of the "
      f"{jax.process_count()} processes packs its own mini-batches, which a reordered pass cannot reuse; set "
      "num_epochs=1 or learner.row_tokens=0",
  )
  check_sft_target(c.sft.target, c.data)  # also shapes the tokenizer corpus, so checked without SFT
  config_checks.check_mesh(c, num_devices or len(jax.devices()))


def validate_shapes_config(c) -> None:
  """The checks of `validate_config` that a compile-only run needs: batch and micro-batch sizes, the loss, the
  optimizer, sampling and the fields every model source takes; no file, workdir or device is looked at.

  Raises:
    ConfigError: naming `config.<field>` and the fix.
  """
  config_checks.check_batch_split(c)
  config_checks.check_staleness(c)  # the mode decides the sampler the step budget costs
  _need(c.model.source in MODEL_SOURCES, "model.source", f"{c.model.source!r}; choose one of {MODEL_SOURCES}")
  _need(c.data.max_prompt_tokens > 0, "data.max_prompt_tokens", f"must be > 0, got {c.data.max_prompt_tokens}")
  learner_rules(c)
  sampler_setup.check_sampling(c)
  loss_config(c)
  _check_optimizer(c)
  check_row_tokens(c)
  ess_step(c)


def learner_rules(c):
  """The learner's logical-axis rules of `config.mesh.rules` (`runtime.rules.parse_rules`; "" = "default").

  Raises:
    ConfigError: naming config.mesh.rules (an unknown rule set, logical or mesh axis).
  """
  return parse_rules(c.mesh.rules, "default", "mesh.rules")


MAX_LEARNING_RATE = 1.0  # AdamW moves each parameter by about lr per update: above 1 nothing survives


def _check_optimizer(c) -> None:
  o = c.optimizer
  _need(o.schedule in SCHEDULES, "optimizer.schedule", f"{o.schedule!r}; choose one of {SCHEDULES}")
  optimizer_config(c)
  lr_decay_config(c)
  updates = max(c.total_steps - c.delay, 1) * c.num_updates_per_step * num_epochs(c)
  _need(
      o.schedule == "constant" or o.decay_steps >= 1,
      "optimizer.decay_steps",
      f"schedule={o.schedule!r} decays the rate to final_lr_ratio={o.final_lr_ratio} x it over decay_steps optimizer "
      f"updates, and 0 would do it at the first update (nothing learnt after it); set decay_steps, e.g. to this "
      f"run's {updates} updates ((total_steps - delay) x num_updates_per_step x num_epochs), or schedule=constant",
  )
  _need(
      o.learning_rate <= MAX_LEARNING_RATE,
      "optimizer.learning_rate",
      f"{o.learning_rate} is above {MAX_LEARNING_RATE}: AdamW moves every parameter by about the learning rate per "
      "update, which destroys the policy; RL fine-tuning uses 1e-7 .. 1e-3",
  )


def num_epochs(c) -> int:
  """`config.num_epochs`, the passes over each released batch (`minpro_jax.rl.epochs`)."""
  return int(c.num_epochs)


def ess_step(c) -> bool:
  """`config.learner.ess_step` (VCPO's step scaled by sqrt(ESS / B), `minpro_jax.rl.learner.Learner`).

  Raises:
    ConfigError: not a bool.
  """
  value = c.learner.ess_step
  _need(isinstance(value, bool), "learner.ess_step", f"must be True or False, got {value!r}")
  return value


def random_rollback_rate(c) -> float:
  """mipu.mode=random's rollback probability: `mipu.random_rate`, or the measured rate of the finished run
  `mipu.match_rate_of`. A relative `match_rate_of` is looked up from the current directory, then next to this run's
  workdir (a sibling run of a study: `variant-mipu_seed-1`).

  Raises:
    ConfigError: naming mipu.match_rate_of: no summary.json there, or that run made no MIPU check.
  """
  m = c.mipu
  if m.random_rate is not None:
    return float(m.random_rate)
  path = m.match_rate_of
  sibling = os.path.join(os.path.dirname(os.path.abspath(c.workdir)), path)
  if not os.path.isabs(path) and not os.path.exists(path) and os.path.exists(sibling):
    path = sibling
  try:
    return mipu.reference_rollback_rate(path)
  except ValueError as e:
    raise ConfigError(str(e)) from e


# ---------------------------------------------------------------------------------------------- typed configs
# config.loss fields that are not objective hyper-parameters
_LOSS_TERMS = ("method", "entropy_coef", "kl_coef", "router_aux_coef", "logprob_chunk_size", "router_replay")
_COMMON_HPARAMS = ("loss_agg_mode", "rollout_is", "tis_cap", "rollout_mis", "rollout_mis_bounds", "negative_veto")


def loss_config(c) -> LossConfig:
  """The learner's `LossConfig` of `config.loss`, its hyper-parameters checked by the objectives themselves.

  Every `config.loss` field named like a hyper-parameter of some registered objective is passed to the configured
  method when set (None = the method's default, `minpro_jax.rl.objectives`); `tis_cap` only with `rollout_is`,
  `rollout_mis_bounds` only with `rollout_mis`.

  Raises:
    ConfigError: `config.loss.method` is not registered; a field is set that the method does not take; a value the
      objective refuses (checked with an abstract call of `policy_loss`, nothing is computed).
  """
  l = c.loss
  try:
    objective = get_objective(l.method)
  except ValueError as e:
    raise ConfigError(f"config.loss.method: {e}") from e
  method_fields = sorted({k for o in OBJECTIVES.values() for k in o.defaults} & set(l.keys()))
  hp: dict[str, Any] = {}
  _need(
      l.rollout_mis_bounds is None or l.rollout_mis is not None,
      "loss.rollout_mis_bounds",
      "is set but loss.rollout_mis is not; set loss.rollout_mis=token|sequence|geometric or unset the bounds",
  )
  for name in (*_COMMON_HPARAMS, *method_fields):
    value = l.get(name)  # a config from before a common field lacks it
    if value is None or (name == "tis_cap" and l.rollout_is is None):
      continue
    if name == "rollout_mis_bounds":
      value = _mis_bounds(value)
    if name not in _COMMON_HPARAMS and name not in objective.defaults:
      takes = sorted(o.name for o in OBJECTIVES.values() if name in o.defaults)
      raise ConfigError(
          f"config.loss.{name}: method {l.method!r} does not take it (methods that do: {takes}); unset it"
      )
    hp[name] = value
    if name == "loss_agg_mode" and value == "seq-mean-token-sum-norm":
      hp["max_response_length"] = int(c.sampling.max_new_tokens)
    try:  # the objective validates its own hyper-parameters; a failure is the field just added
      _probe_policy_loss(l.method, hp)
    except ValueError as e:
      raise ConfigError(f"config.loss.{name}: {e}") from e
  _need(l.logprob_chunk_size > 0, "loss.logprob_chunk_size", f"must be > 0, got {l.logprob_chunk_size}")
  return LossConfig(
      method=l.method,
      hparams=tuple(sorted(hp.items())),
      temperature=float(c.sampling.temperature),
      entropy_coef=float(l.entropy_coef),
      kl_coef=float(l.kl_coef),
      router_aux_coef=float(l.router_aux_coef),
      logprob_chunk_size=int(l.logprob_chunk_size),
      router_replay=bool(l.router_replay),
  )


def _mis_bounds(value) -> tuple[float, float]:
  ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
  _need(ok, "loss.rollout_mis_bounds", f"must be two numbers (low, high), e.g. (0.5, 2.0); got {value!r}")
  return float(value[0]), float(value[1])


def _probe_policy_loss(method: str, hparams: dict[str, Any]) -> None:
  x = jax.ShapeDtypeStruct((1, 2), jnp.float32)
  extra = {"rollout_logp": x} if hparams.get("rollout_is") or hparams.get("rollout_mis") else {}
  proximal = resolve_hparams(method, hparams).get("proximal")  # decoupled PPO: the inputs the learner gives it
  if proximal == "score":
    extra["proximal_logp"] = x
  elif proximal == "interpolate":
    extra["proximal_alpha"] = jax.ShapeDtypeStruct((), jnp.float32)
  adv = jax.ShapeDtypeStruct((1,), jnp.float32)
  mask = jax.ShapeDtypeStruct((1, 2), jnp.bool_)
  jax.eval_shape(lambda lp, b, a, m, **kw: policy_loss(method, lp, b, a, m, **hparams, **kw), x, x, adv, mask, **extra)


def optimizer_config(c) -> OptimizerConfig:
  """The learner's `OptimizerConfig` of `config.optimizer`.

  Raises:
    ConfigError: naming the `config.optimizer` field `OptimizerConfig` refuses (not finite, out of range).
  """
  o = c.optimizer
  try:
    return OptimizerConfig(
        learning_rate=float(o.learning_rate),
        warmup_steps=int(o.warmup_steps),
        schedule=o.schedule,
        decay_steps=int(o.decay_steps),
        final_lr_ratio=float(o.final_lr_ratio),
        weight_decay=float(o.weight_decay),
        max_grad_norm=float(o.max_grad_norm),
        b2=float(o.b2),
    )
  except ValueError as e:
    hit = re.search(r"OptimizerConfig\.(\w+)", str(e))
    raise ConfigError(f"config.optimizer.{hit.group(1) if hit else ''}: {e}") from e


LR_DECAY_FIELDS = {  # config.optimizer.<key> -> LrDecayConfig.<value>
    "lr_decay_baseline_steps": "baseline_steps",
    "lr_decay_surge_ratio": "surge_ratio",
    "lr_decay_period_factor": "period_factor",
    "lr_decay_factor": "factor",
    "lr_decay_min_ratio": "min_ratio",
}


def lr_decay_config(c) -> LrDecayConfig | None:
  """The `LrDecayConfig` of `config.optimizer.lr_decay_*`, None when `lr_decay_on_length_surge` is off (the fields
  are checked either way).

  Raises:
    ConfigError: naming the `config.optimizer.lr_decay_*` field `LrDecayConfig` refuses, and its range.
  """
  o = c.optimizer
  try:
    cfg = LrDecayConfig(**{attr: o[key] for key, attr in LR_DECAY_FIELDS.items()})
  except ValueError as e:
    hit = re.search(r"LrDecayConfig\.(\w+)", str(e))
    key = next((k for k, a in LR_DECAY_FIELDS.items() if hit and a == hit.group(1)), "lr_decay_*")
    raise ConfigError(f"config.optimizer.{key}: {e}") from e
  return cfg if o.lr_decay_on_length_surge else None
