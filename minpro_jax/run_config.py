"""From a config to the run's parts: validation, tokenizer, problems, model, loss and optimizer configs.

`validate_config` runs before anything expensive and fails with a message naming the config field and the fix.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import jax

from minpro_jax.data.records import MathProblem
from minpro_jax.rl.learner import LossConfig, OptimizerConfig
from minpro_jax.rl.objectives import METHODS

logger = logging.getLogger(__name__)

MODEL_SOURCES = ("scratch", "hf", "gguf")
TOKENIZER_KINDS = ("train_spm", "path", "model")
DATA_SOURCES = ("reasoning_gym", "file", "champ")


class ConfigError(ValueError):
  """A config field is invalid; the message names `config.<field>` and how to fix it."""


def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def parse_mesh_shape(spec: str) -> dict[str, int] | None:
  """ "data=2,fsdp=4" -> {"data": 2, "fsdp": 4}; "" -> None."""
  if not spec:
    return None
  out = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    _need(
        bool(name.strip()) and size.strip().lstrip("-").isdigit(),
        "mesh.shape",
        f"cannot parse {part!r}; write e.g. 'data=2,fsdp=4'",
    )
    out[name.strip()] = int(size)
  return out


def validate_config(c, num_devices: int | None = None) -> None:
  """Checks every cross-field constraint of a training config.

  Raises:
    ConfigError: naming the field, e.g. batch not divisible by the number of updates or micro-batch,
      negative delay, unknown method, mesh not dividing the device count, missing checkpoint path.
  """
  num_devices = num_devices or len(jax.devices())
  _need(
      bool(c.workdir),
      "workdir",
      "must not be empty (the run writes checkpoints, metrics and plots there); " "e.g. --config.workdir=runs/my_run",
  )
  _need(
      not os.path.exists(c.workdir) or os.path.isdir(c.workdir),
      "workdir",
      f"{c.workdir!r} exists and is not a directory; choose another path",
  )
  _need(c.total_steps > 0, "total_steps", f"must be > 0, got {c.total_steps}")
  _need(c.prompts_per_step > 0, "prompts_per_step", f"must be > 0, got {c.prompts_per_step}")
  _need(c.group_size >= 1, "group_size", f"must be >= 1, got {c.group_size}")
  _need(c.delay >= 0, "delay", f"must be >= 0 (0 = on-policy), got {c.delay}")
  _need(c.num_updates_per_step >= 1, "num_updates_per_step", f"must be >= 1, got {c.num_updates_per_step}")
  n = c.prompts_per_step * c.group_size
  _need(
      n % c.num_updates_per_step == 0,
      "num_updates_per_step",
      f"prompts_per_step * group_size = {n} samples must split into {c.num_updates_per_step} equal mini-batches",
  )
  mini = n // c.num_updates_per_step
  _need(
      c.group_size == 1 or mini % c.group_size == 0,
      "num_updates_per_step",
      f"each mini-batch of {mini} samples must hold whole groups of group_size={c.group_size}",
  )
  _need(
      c.micro_batch_size >= 1 and mini % c.micro_batch_size == 0 or c.micro_batch_size > mini,
      "micro_batch_size",
      f"mini-batch of {mini} samples is not divisible by micro_batch_size={c.micro_batch_size}",
  )
  _need(c.loss.method in METHODS, "loss.method", f"unknown method {c.loss.method!r}; choose one of {METHODS}")
  _need(c.model.source in MODEL_SOURCES, "model.source", f"{c.model.source!r}; choose one of {MODEL_SOURCES}")
  if c.model.source == "hf":
    _need(
        bool(c.model.path) and os.path.isdir(c.model.path),
        "model.path",
        f"HF checkpoint folder {c.model.path!r} does not exist; point it at a folder with config.json + safetensors",
    )
  if c.model.source == "gguf" and c.model.path:
    _need(os.path.isfile(c.model.path), "model.path", f"GGUF file {c.model.path!r} does not exist")
  _need(c.tokenizer.kind in TOKENIZER_KINDS, "tokenizer.kind", f"{c.tokenizer.kind!r}; choose one of {TOKENIZER_KINDS}")
  if c.tokenizer.kind == "path":
    _need(
        bool(c.tokenizer.path) and os.path.exists(c.tokenizer.path),
        "tokenizer.path",
        f"{c.tokenizer.path!r} does not exist",
    )
  _need(c.data.source in DATA_SOURCES, "data.source", f"{c.data.source!r}; choose one of {DATA_SOURCES}")
  if c.data.source == "file":
    _need(
        bool(c.data.path) and not os.path.isdir(c.data.path),
        "data.path",
        f"{c.data.path!r} is a directory; point it at one .jsonl / .json / .parquet file",
    )
    _need(os.path.isfile(c.data.path), "data.path", f"data file {c.data.path!r} does not exist")
  _need(c.sampling.max_new_tokens > 0, "sampling.max_new_tokens", f"must be > 0, got {c.sampling.max_new_tokens}")
  _need(
      c.sampling.temperature > 0,
      "sampling.temperature",
      "must be > 0 for RL (the learner scores the sampled tokens under the temperature-scaled distribution)",
  )
  _need(
      c.sampling.precision in ("fp32", "bf16", "fp8"),
      "sampling.precision",
      f"{c.sampling.precision!r}; choose fp32, bf16 or fp8",
  )
  _need(c.checkpoint.every >= 0, "checkpoint.every", f"must be >= 0, got {c.checkpoint.every}")
  _need(c.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.checkpoint.keep}")
  _need(c.eval.n >= 1, "eval.n", f"must be >= 1, got {c.eval.n}")
  _need(c.eval.num_problems >= 1, "eval.num_problems", f"must be >= 1, got {c.eval.num_problems}")
  _need(all(1 <= k <= c.eval.n for k in c.eval.ks), "eval.ks", f"every k must lie in [1, eval.n={c.eval.n}]")
  _validate_choices_and_ranges(c)
  shape = parse_mesh_shape(c.mesh.shape)
  if shape:
    from minpro_jax.runtime.sharding import MESH_AXES

    unknown = set(shape) - set(MESH_AXES)
    _need(not unknown, "mesh.shape", f"unknown axes {sorted(unknown)}; mesh axes are {MESH_AXES}")
    fill = [a for a, v in shape.items() if v == -1]
    _need(
        len(fill) <= 1 and all(v > 0 or v == -1 for v in shape.values()),
        "mesh.shape",
        f"{c.mesh.shape!r}: sizes must be positive, with at most one -1 (= the remaining devices)",
    )
    prod = 1
    for v in shape.values():
      prod *= v if v > 0 else 1
    _need(
        num_devices % prod == 0 if fill else prod == num_devices,
        "mesh.shape",
        f"{c.mesh.shape!r} does not divide the {num_devices} available devices",
    )


def check_mipu_problem_count(c, num_problems: int) -> None:
  """With `mipu.rollback`, the validation draw needs `mipu.val_prompts` distinct training problems.

  Raises:
    ConfigError: naming `mipu.val_prompts`, before the expensive setup.
  """
  if c.mipu.rollback:
    _need(
        c.mipu.val_prompts <= num_problems,
        "mipu.val_prompts",
        f"{c.mipu.val_prompts} validation prompts are drawn from the training problems, but only {num_problems} "
        "are available; lower mipu.val_prompts or raise data.size",
    )


def _validate_choices_and_ranges(c) -> None:
  """Every enumerated or bounded field, so a typo fails at start and not after the warm start."""
  from minpro_jax.data.prompts import TEMPLATES
  from minpro_jax.data.sources import FORMATS
  from minpro_jax.models.config import PRESETS
  from minpro_jax.rl.advantages import ADVANTAGE_MODES
  from minpro_jax.rl.aggregation import LOSS_AGG_MODES
  from minpro_jax.rl.prefix import PREFIX_STATISTICS

  _need(c.data.format in FORMATS, "data.format", f"{c.data.format!r}; choose one of {FORMATS}")
  l = c.loss
  _need(
      l.prefix_statistic in PREFIX_STATISTICS,
      "loss.prefix_statistic",
      f"{l.prefix_statistic!r}; choose one of {PREFIX_STATISTICS}",
  )
  _need(
      not l.loss_agg_mode or l.loss_agg_mode in LOSS_AGG_MODES,
      "loss.loss_agg_mode",
      f"{l.loss_agg_mode!r}; choose one of {LOSS_AGG_MODES} (or '' for the method's default)",
  )
  _need(l.rollout_is in ("", "token", "sequence"), "loss.rollout_is", f"{l.rollout_is!r}; choose '', token or sequence")
  _need(
      l.rollout_mis in ("", "token", "sequence", "geometric"),
      "loss.rollout_mis",
      f"{l.rollout_mis!r}; choose '', token, sequence or geometric",
  )
  _need(l.eps_low < 1.0, "loss.eps_low", "must be < 1 (a ratio bound 1 - eps_low > 0), or < 0 for the default")
  _need(l.dual_clip_c == 0 or l.dual_clip_c > 1, "loss.dual_clip_c", "must be 0 (off) or > 1")
  _need(l.tis_cap > 0, "loss.tis_cap", f"must be > 0, got {l.tis_cap}")
  _need(l.logprob_chunk_size > 0, "loss.logprob_chunk_size", f"must be > 0, got {l.logprob_chunk_size}")
  _need(
      c.optimizer.schedule in ("constant", "cosine", "linear"),
      "optimizer.schedule",
      f"{c.optimizer.schedule!r}; choose constant, cosine or linear",
  )
  _need(c.optimizer.learning_rate > 0, "optimizer.learning_rate", f"must be > 0, got {c.optimizer.learning_rate}")
  _need(c.advantage_mode in ADVANTAGE_MODES, "advantage_mode", f"{c.advantage_mode!r}; choose one of {ADVANTAGE_MODES}")
  _need(c.reward.mode in ("math", "integer"), "reward.mode", f"{c.reward.mode!r}; choose math or integer")
  _need(
      c.eval.reward_mode in ("", "math", "integer"),
      "eval.reward_mode",
      f"{c.eval.reward_mode!r}; choose '' (= reward.mode), math or integer",
  )
  _need(c.data.template in TEMPLATES, "data.template", f"{c.data.template!r}; choose one of {TEMPLATES}")
  _need(c.data.num_epochs > 0, "data.num_epochs", f"must be > 0, got {c.data.num_epochs}")
  _need(c.data.max_prompt_tokens > 0, "data.max_prompt_tokens", f"must be > 0, got {c.data.max_prompt_tokens}")
  if c.model.source == "scratch":
    _need(c.model.preset in PRESETS, "model.preset", f"{c.model.preset!r}; choose one of {sorted(PRESETS)}")
    _need(
        c.tokenizer.kind != "model",
        "tokenizer.kind",
        "'model' reads the tokenizer of an hf/gguf checkpoint; with model.source=scratch use train_spm or path",
    )
  for name in ("sampling.top_p", "eval.top_p"):
    v = c.sampling.top_p if name.startswith("sampling") else c.eval.top_p
    _need(0.0 < v <= 1.0, name, f"must lie in (0, 1] (1 = off), got {v}")
  _need(c.sampling.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 = off), got {c.sampling.top_k}")
  _need(c.eval.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {c.eval.temperature}")
  _need(c.eval.every >= 0, "eval.every", f"must be >= 0 (0 = only at start and end), got {c.eval.every}")
  if c.mipu.rollback:
    _need(
        math.isfinite(c.mipu.gap_tolerance),
        "mipu.gap_tolerance",
        f"must be a finite number, got {c.mipu.gap_tolerance}",
    )
    _need(c.mipu.val_prompts >= 1, "mipu.val_prompts", f"must be >= 1, got {c.mipu.val_prompts}")
    _need(
        c.mipu.val_group_size >= 2,
        "mipu.val_group_size",
        f"must be >= 2 (T_post needs group-normalised advantages), got {c.mipu.val_group_size}",
    )
    n_val = c.mipu.val_prompts * c.mipu.val_group_size
    mini = c.prompts_per_step * c.group_size // c.num_updates_per_step
    mb = min(c.micro_batch_size, mini, n_val)  # the learner scores the validation batch in these micro-batches
    _need(
        n_val % mb == 0,
        "mipu.val_prompts",
        f"val_prompts * val_group_size = {n_val} validation samples are not divisible by the scoring micro-batch "
        f"{mb} (micro_batch_size); choose sizes whose product is a multiple of {mb}",
    )
  if c.sft.enabled:
    _need(
        c.sft.steps > 0 and c.sft.batch_size > 0 and c.sft.learning_rate > 0,
        "sft",
        "sft.steps, sft.batch_size and sft.learning_rate must be > 0 (or set sft.enabled=False)",
    )
  if c.eval.path:
    for item in c.eval.path.split(","):
      path = item.partition("=")[2].partition(":")[2]
      _need(bool(path) and os.path.isfile(path), "eval.path", f"{item!r}: write name=fmt:path with an existing file")


# Fields a run checkpoint is only valid for: resuming with other values would silently change the experiment.
RESUME_KEYS = (
    "seed",
    "prompts_per_step",
    "group_size",
    "num_updates_per_step",
    "delay",
    "loss",
    "model",
    "data",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.precision",
    "sampling.max_new_tokens",
    "advantage_mode",
    "reward",
    "mipu",
    "eval.seed",
    "eval.num_problems",
    "eval.path",
)  # the held-out prompts are removed from training


def _mipu_equivalent(now: Any, stored: Any) -> bool:
  """The mipu settings matter only when rollback is on (a checkpoint from before they existed has none)."""
  off = lambda v: not (v or {}).get("rollback", False)  # noqa: E731
  return now == stored or (off(now) and off(stored))


# Fingerprint keys whose values may differ without changing the experiment.
# A key added to RESUME_KEYS after a checkpoint was written is absent from its fingerprint: accept it.
_added_later = lambda now, stored: stored is None or now == stored  # noqa: E731
_EQUIVALENT = {
    "mipu": _mipu_equivalent,
    "sampling.max_new_tokens": _added_later,
    "eval.seed": _added_later,
    "eval.num_problems": _added_later,
    "eval.path": _added_later,
}


def _differing_fields(key: str, now: Any, stored: Any) -> list[str]:
  """`key`, or `key.field` for each differing field when the values are dicts (absent = empty)."""
  if isinstance(now, dict) or isinstance(stored, dict):
    now, stored = now if isinstance(now, dict) else {}, stored if isinstance(stored, dict) else {}
    return [f"{key}.{k}" for k in sorted(set(now) | set(stored)) if now.get(k) != stored.get(k)]
  return [key]


def resume_fingerprint(c) -> dict[str, Any]:
  """The values of `RESUME_KEYS` as plain JSON (stored in each run checkpoint)."""
  out = {}
  for key in RESUME_KEYS:
    node = c
    for part in key.split("."):
      node = node[part]
    out[key] = node.to_dict() if hasattr(node, "to_dict") else node
  return json.loads(json.dumps(out, default=str))


def check_resume(c, stored: dict[str, Any] | None, workdir: str) -> None:
  """Raises ConfigError when the config differs from the one the checkpoint in `workdir` was written with."""
  if not stored:
    return
  now = resume_fingerprint(c)
  diff = [
      f
      for k in sorted(set(now) | set(stored))
      if now.get(k) != stored.get(k) and not (k in _EQUIVALENT and _EQUIVALENT[k](now.get(k), stored.get(k)))
      for f in _differing_fields(k, now.get(k), stored.get(k))
  ]
  _need(
      not diff,
      "workdir",
      f"{workdir} holds a checkpoint of a run with different {', '.join(diff)}; resuming would mix two "
      "experiments. Use a new --config.workdir (or delete the old one)",
  )


def loss_config(c) -> LossConfig:
  """`LossConfig` from `config.loss` (negative/empty values mean the method's default)."""
  l = c.loss
  hp: dict[str, Any] = {}
  if l.method == "minpro":
    hp["prefix_statistic"] = l.prefix_statistic
  if l.eps_low >= 0:
    hp["eps_low"] = float(l.eps_low)
  if l.eps_high >= 0:
    hp["eps_high"] = float(l.eps_high)
  if l.loss_agg_mode:
    hp["loss_agg_mode"] = l.loss_agg_mode
    if l.loss_agg_mode == "seq-mean-token-sum-norm":
      hp["max_response_length"] = int(c.sampling.max_new_tokens)
  if l.method == "grpo" and l.dual_clip_c > 0:
    hp["dual_clip_c"] = float(l.dual_clip_c)
  if l.rollout_is:
    hp["rollout_is"] = l.rollout_is
    hp["tis_cap"] = float(l.tis_cap)
  if l.rollout_mis:
    hp["rollout_mis"] = l.rollout_mis
  return LossConfig(
      method=l.method,
      hparams=tuple(sorted(hp.items())),
      temperature=float(c.sampling.temperature),
      entropy_coef=float(l.entropy_coef),
      kl_coef=float(l.kl_coef),
      router_aux_coef=float(l.router_aux_coef),
      logprob_chunk_size=int(l.logprob_chunk_size),
  )


def optimizer_config(c) -> OptimizerConfig:
  o = c.optimizer
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


def load_problems(c, *, seed: int, size: int) -> list[MathProblem]:
  """Problems of `config.data` (for reasoning-gym: `size` problems from generator seed `seed`)."""
  from minpro_jax.data import champ_problems, load_file, reasoning_gym_problems

  d = c.data
  if d.source == "reasoning_gym":
    try:
      return reasoning_gym_problems(d.task, size, seed, **dict(d.task_config))
    except (ValueError, TypeError) as e:  # unknown task name / a task_config key the task does not take
      raise ConfigError(
          f"config.data.task / config.data.task_config: reasoning-gym refused task {d.task!r} with "
          f"task_config={dict(d.task_config)} ({e}); minpro_jax/configs/default.py sets chain_sum's fields, so "
          "for another task set data.task_config to that task's fields in your config file"
      ) from e
  if d.source == "champ":
    return champ_problems()
  problems = load_file(d.path, d.format)
  _need(
      bool(problems),
      "data.path",
      f"{d.path!r} holds no usable problem (skipped rows are logged above); each row "
      f"needs a question and an answer in data.format={d.format!r}",
  )
  return problems


def eval_benchmarks(c) -> dict[str, list[MathProblem]]:
  """Held-out problems: a reasoning-gym draw with generator seed `eval.seed` (the trainer removes these prompts from
  the training set), plus the `eval.path` files ("name=fmt:path,...")."""
  from minpro_jax.data import load_file

  out: dict[str, list[MathProblem]] = {}
  if c.data.source == "reasoning_gym":
    probs = load_problems(c, seed=c.eval.seed, size=c.eval.num_problems)
    unique = list({p.prompt: p for p in probs}.values())
    out[f"{c.data.task}_heldout"] = unique
  if c.eval.path:
    for item in c.eval.path.split(","):
      name, _, rest = item.partition("=")
      fmt, _, path = rest.partition(":")
      _need(bool(name and fmt and path), "eval.path", f"cannot parse {item!r}; write name=fmt:path")
      out[name] = load_file(path, fmt)[: c.eval.num_problems]
  return out


def remove_heldout(train: list[MathProblem], eval_sets: dict[str, list[MathProblem]]) -> list[MathProblem]:
  """Training problems whose prompt text appears in no held-out set."""
  held = {p.prompt for ps in eval_sets.values() for p in ps}
  return [p for p in train if p.prompt not in held]


HELDOUT_MAX_FRACTION = 0.2  # a split taken from the training data holds out at most this share of its prompts


def train_and_eval_problems(c) -> tuple[list[MathProblem], dict[str, list[MathProblem]]]:
  """The run's training problems and held-out benchmarks.

  Held-out sets are `eval_benchmarks(c)`. A file or champ source has no held-out draw of its own: if `eval.path`
  is empty too, `min(eval.num_problems, 20 % of the distinct prompts)` problems (at least 1) are split off the
  training data with a shuffle seeded by `eval.seed` (benchmark "<name>_heldout"), so every run is evaluated on
  problems it does not train on. Training problems whose prompt is in any held-out set are removed.

  Returns:
    (train problems in source order, {benchmark name: problems}).

  Raises:
    ConfigError: naming `config.data` if the held-out sets leave no training problem.
  """
  import numpy as np

  eval_sets = eval_benchmarks(c)
  problems = load_problems(c, seed=c.seed, size=c.data.size)
  if not eval_sets:
    prompts = list(dict.fromkeys(p.prompt for p in problems))
    _need(
        len(prompts) >= 2,
        "data",
        f"{len(prompts)} distinct problem(s), too few to split off a held-out set; "
        "give more problems or a held-out file with eval.path=name=fmt:path",
    )
    n_held = min(int(c.eval.num_problems), max(1, int(HELDOUT_MAX_FRACTION * len(prompts))))
    held = {prompts[i] for i in np.random.default_rng(int(c.eval.seed)).permutation(len(prompts))[:n_held]}
    first = {}
    for p in problems:
      if p.prompt in held:
        first.setdefault(p.prompt, p)
    name = os.path.splitext(os.path.basename(c.data.path))[0] if c.data.source == "file" else c.data.source
    eval_sets[f"{name}_heldout"] = list(first.values())
    logger.warning(
        "config.eval.path is empty: holding out %d of %d distinct %s problems (eval.seed=%d) as benchmark "
        "%s_heldout; set eval.path=name=fmt:path to evaluate on a separate file instead",
        n_held,
        len(prompts),
        c.data.source,
        int(c.eval.seed),
        name,
    )
  train = remove_heldout(problems, eval_sets)
  _need(
      bool(train),
      "data",
      "every training problem is also in a held-out set (eval.path or the reasoning-gym draw "
      "of eval.seed); use other data or other held-out problems",
  )
  return train, eval_sets
