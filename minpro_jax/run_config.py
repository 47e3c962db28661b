"""A training config (`minpro_jax/configs/default.py`) checked and turned into the typed configs of its parts.

`validate_config` runs before anything expensive. Each field is checked once, against the choices of the module
that owns it (imported, never copied), and a failure is a `ConfigError` whose message starts with
`config.<field>:` and says how to fix it. Where a part validates its own settings (`SamplingParams`, the
objectives' hyper-parameters, `ModelConfig`), the config is handed to it and its error is renamed to the config
field. `loss_config`, `optimizer_config` and `sampling_params` build the typed configs the learner and the
sampler take. The resume check (one workdir, one experiment) is `minpro_jax/resume_check.py`.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from minpro_jax.config_domains import check_domains
from minpro_jax.data.prompts import TEMPLATES
from minpro_jax.data.sources import FORMATS, check_data_file, get_source
from minpro_jax.data.tokenizers import CHAT_TEMPLATES
from minpro_jax.data.worked import check_sft_target
from minpro_jax.errors import ConfigError, FileFormatError
from minpro_jax.models.config import PRESETS, get_preset
from minpro_jax.models.hf_io import config_from_hf
from minpro_jax.models.quant import FP8_ACTIVATIONS, FP8_FORMATS, FP8_WEIGHT_SCALES, PRECISIONS
from minpro_jax.rl import mipu
from minpro_jax.rl.advantages import ADVANTAGE_MODES
from minpro_jax.rl.learner import LossConfig, OptimizerConfig
from minpro_jax.rl.lr_decay import LrDecayConfig
from minpro_jax.rl.objectives import OBJECTIVES, get_objective, policy_loss
from minpro_jax.rl.packing import check_row_tokens
from minpro_jax.runtime.inference_mesh import parse_sampling_mesh
from minpro_jax.runtime.sharding import MESH_AXES, batch_split
from minpro_jax.sampling import PagedKV, SamplingParams

__all__ = [
    "ConfigError",
    "validate_config",
    "check_mipu_problem_count",
    "loss_config",
    "optimizer_config",
    "lr_decay_config",
]

MODEL_SOURCES = ("scratch", "hf", "gguf")  # how run_setup builds the model
TOKENIZER_KINDS = ("train_spm", "path", "model")  # how run_setup builds the tokenizer
REWARD_MODES = ("math", "integer")  # minpro_jax.data.rewards.math_reward's modes
SCHEDULES = ("constant", "cosine", "linear")  # minpro_jax.rl.learner.make_schedule's schedules
KV_CACHES = ("dense", "paged")  # the continuous sampler's KV caches (minpro_jax.sampling.paged_continuous)
# config.sampling.fp8_* field, choices, default (the sampler's FP8 options, minpro_jax.models.quant)
FP8_OPTIONS = (
    ("fp8_weight_scale", FP8_WEIGHT_SCALES, "tensor"),
    ("fp8_format", tuple(FP8_FORMATS), "e4m3"),
    ("fp8_activations", FP8_ACTIVATIONS, "token"),
)


def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def parse_mesh_shape(spec: str) -> dict[str, int] | None:
  """`"data=2,fsdp=4"` -> `{"data": 2, "fsdp": 4}`; `""` -> None. Raises ConfigError naming `config.mesh.shape`."""
  if not spec:
    return None
  out = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    ok = bool(name.strip()) and size.strip().lstrip("-").isdigit()
    _need(ok, "mesh.shape", f"cannot parse {part!r}; write e.g. 'data=2,fsdp=4'")
    out[name.strip()] = int(size)
  return out


def validate_config(c, num_devices: int | None = None) -> None:
  """Checks every field and cross-field constraint of a training config.

  Args:
    c: the `ml_collections.ConfigDict` of `minpro_jax/configs/default.py` (or a config built on it).
    num_devices: devices the mesh must use (default `len(jax.devices())`).

  Raises:
    ConfigError: naming `config.<field>` and the fix.
  """
  _check_run(c)
  validate_shapes_config(c)
  _check_model(c)
  _check_data(c)
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
  _check_mipu(c)
  if c.sft.enabled:
    ok = c.sft.steps > 0 and c.sft.batch_size > 0 and c.sft.learning_rate > 0
    _need(ok, "sft", "sft.steps, sft.batch_size and sft.learning_rate must be > 0 (or set sft.enabled=False)")
  check_domains(c)  # the fields no part checks itself, and settings under which nothing is learnt
  check_row_tokens(c)
  check_sft_target(c.sft.get("target", "answer"), c.data)  # also shapes the tokenizer corpus, so checked without SFT
  _check_mesh(c, num_devices or len(jax.devices()))


def validate_shapes_config(c) -> None:
  """The checks of `validate_config` that a compile-only run needs: batch and micro-batch sizes, the loss, the
  optimizer, sampling and the fields every model source takes; no file, workdir or device is looked at.

  Raises:
    ConfigError: naming `config.<field>` and the fix.
  """
  _check_batch_split(c)
  _need(c.model.source in MODEL_SOURCES, "model.source", f"{c.model.source!r}; choose one of {MODEL_SOURCES}")
  _need(c.data.max_prompt_tokens > 0, "data.max_prompt_tokens", f"must be > 0, got {c.data.max_prompt_tokens}")
  sampling_params(c, stop_token_ids=())
  _need(
      c.sampling.precision in PRECISIONS, "sampling.precision", f"{c.sampling.precision!r}; choose one of {PRECISIONS}"
  )
  sampler_fp8_options(c)
  sampler_decode_rows(c)
  sampler_paged_kv(c)
  loss_config(c)
  _check_optimizer(c)


def sampler_fp8_options(c) -> dict[str, str]:
  """The `Sampler` keyword arguments of `config.sampling.fp8_*` (defaults where a config lacks them).

  Raises:
    ConfigError: a value outside its choices, or one changed from its default while sampling.precision is not fp8.
  """
  out = {}
  for field, choices, default in FP8_OPTIONS:
    value = c.sampling.get(field, default)
    _need(value in choices, f"sampling.{field}", f"{value!r}; choose one of {choices}")
    _need(
        value == default or c.sampling.precision == "fp8",
        f"sampling.{field}",
        f"{value!r} needs sampling.precision='fp8' (got {c.sampling.precision!r}); set it or unset this field",
    )
    out[field] = value
  return out


def sampler_decode_rows(c) -> int | str:
  """`config.sampling.decode_rows` (64, the `Sampler` default, where a config lacks it): an int, or "auto", which
  the trainer and the compile-only tool resolve for their layout (`minpro_jax.sampling.rows`).

  Raises:
    ConfigError: neither an int >= 1 nor "auto".
  """
  rows = c.sampling.get("decode_rows", 64)
  ok = rows == "auto" or isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1
  _need(
      ok,
      "sampling.decode_rows",
      f"must be an int >= 1 (the continuous sampler's decode rows) or 'auto' (as many as fit), got {rows!r}",
  )
  return rows


def sampler_paged_kv(c) -> PagedKV | None:
  """The `Sampler(paged_kv=...)` of `config.sampling.kv_cache` / `page_size` / `num_pages` ("dense", 64, 0 where
  a config lacks them): a `PagedKV` for "paged" (num_pages 0 = None, the dense cache's memory), None for "dense".

  Raises:
    ConfigError: an unknown kv_cache, "paged" without sampling.continuous, a page_size < 1, a num_pages < 0, or
      a pool too small for one response at the configured lengths (it would wait forever).
  """
  kind = c.sampling.get("kv_cache", "dense")
  _need(kind in KV_CACHES, "sampling.kv_cache", f"{kind!r}; choose one of {KV_CACHES}")
  page_size, num_pages = c.sampling.get("page_size", 64), c.sampling.get("num_pages", 0)
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
  _need(is_int(page_size) and page_size >= 1, "sampling.page_size", f"must be an int >= 1 (tokens), got {page_size!r}")
  _need(
      is_int(num_pages) and num_pages >= 0,
      "sampling.num_pages",
      f"must be an int >= 0 (pages per layer; 0 = auto), got {num_pages!r}",
  )
  if kind == "dense":
    return None
  _need(
      c.sampling.continuous,
      "sampling.kv_cache",
      "'paged' runs the continuous sampler; set sampling.continuous=True or sampling.kv_cache='dense'",
  )
  tokens = c.data.max_prompt_tokens + c.sampling.max_new_tokens - 1  # the last sampled token is never stored
  per_row = -(-tokens // page_size)
  _need(
      num_pages == 0 or num_pages >= per_row,
      "sampling.num_pages",
      f"{num_pages} pages of {page_size} tokens cannot hold one response of data.max_prompt_tokens + "
      f"sampling.max_new_tokens - 1 = {tokens} tokens ({per_row} pages); raise it, or 0 = auto",
  )
  return PagedKV(page_size=page_size, num_pages=num_pages or None)


def _check_batch_split(c) -> None:
  for field in ("prompts_per_step", "group_size", "num_updates_per_step"):
    _need(c[field] >= 1, field, f"must be >= 1, got {c[field]}")
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


def _check_run(c) -> None:
  _need(
      bool(c.workdir),
      "workdir",
      "must not be empty (the run writes checkpoints, metrics and plots there); e.g. --config.workdir=runs/my_run",
  )
  _need(
      not os.path.exists(c.workdir) or os.path.isdir(c.workdir),
      "workdir",
      f"{c.workdir!r} exists and is not a directory; choose another path",
  )
  _need(c.total_steps >= 1, "total_steps", f"must be >= 1, got {c.total_steps}")
  _need(c.delay >= 0, "delay", f"must be >= 0 (0 = on-policy), got {c.delay}")
  for field in ("every", "keep"):
    low = 0 if field == "every" else 1
    _need(c.checkpoint[field] >= low, f"checkpoint.{field}", f"must be >= {low}, got {c.checkpoint[field]}")


_MODEL_FIELD = re.compile(r"ModelConfig\.(\w+)")


def _check_model(c) -> None:
  m = c.model  # m.source: checked by validate_shapes_config
  if m.source == "hf":
    _need(
        bool(m.path) and os.path.isdir(m.path),
        "model.path",
        f"HF checkpoint folder {m.path!r} does not exist; point it at a folder with config.json + safetensors",
    )
  if m.source == "gguf" and m.path:
    _need(os.path.isfile(m.path), "model.path", f"GGUF file {m.path!r} does not exist")
  t = c.tokenizer
  _need(t.kind in TOKENIZER_KINDS, "tokenizer.kind", f"{t.kind!r}; choose one of {TOKENIZER_KINDS}")
  if t.kind == "path":
    _need(bool(t.path) and os.path.exists(t.path), "tokenizer.path", f"{t.path!r} does not exist")
  _need(
      t.chat_format is None or t.chat_format in CHAT_TEMPLATES,
      "tokenizer.chat_format",
      f"{t.chat_format!r}; choose one of {sorted(CHAT_TEMPLATES)}, or leave it unset for the tokenizer's own",
  )
  every_source = model_overrides(c)
  for name in every_source:
    _need(name not in m.overrides, f"model.overrides.{name}", f"set config.model.{name} instead (every source)")
  if m.source == "scratch":
    _need(m.preset in PRESETS, "model.preset", f"{m.preset!r}; choose one of {sorted(PRESETS)}")
    _need(
        t.kind != "model",
        "tokenizer.kind",
        "'model' reads the tokenizer of an hf/gguf checkpoint; with model.source=scratch use train_spm or path",
    )
  try:  # ModelConfig checks its own fields: name the config field that set the bad value
    if m.source == "scratch":
      check_routes_fit(c, get_preset(m.preset, **dict(m.overrides), **every_source))
    else:  # the architecture comes from the checkpoint; check the fields every source takes
      get_preset("tiny", **every_source)
  except (TypeError, ValueError) as e:
    hit = _MODEL_FIELD.search(str(e)) or re.search(r"argument '(\w+)'", str(e))
    name = hit.group(1) if hit else ""
    field = f"model.overrides.{name}" if name in m.overrides else f"model.{name}" if name in m else "model.overrides"
    raise ConfigError(f"config.{field}: {e}") from e
  if m.source == "hf":
    loaded = hf_model_config(m.path)
    check_overrides_match(c, loaded)
    check_routes_fit(c, loaded)


def check_routes_fit(c, model_config) -> None:
  """Raises ConfigError naming `config.loss.router_replay` / `config.sampling.record_routes` when one is set for a
  model without experts (`model_config`, its `ModelConfig`): routes exist only in MoE models."""
  for part, name in (("loss", "router_replay"), ("sampling", "record_routes")):
    msg = "routes exist only in MoE models; this model has no experts, unset it"
    _need(not c[part][name] or model_config.is_moe, f"{part}.{name}", msg)


def hf_model_config(path: str):
  """The `ModelConfig` of a Hugging Face folder's config.json. Raises FileFormatError naming the file."""
  cfg_path = os.path.join(path, "config.json")
  try:
    with open(cfg_path) as f:
      return config_from_hf(json.load(f))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise FileFormatError(f"{cfg_path}: not a usable Hugging Face config.json ({type(e).__name__}: {e})") from e


def check_overrides_match(c, loaded) -> None:
  """`config.model.overrides` apply to scratch models; for a loaded checkpoint each one must equal the
  checkpoint's own value (`loaded`, its `ModelConfig`).

  Raises:
    ConfigError: naming `config.model.overrides.<field>` and both values.
  """
  for name, value in dict(c.model.overrides).items():
    have = getattr(loaded, name, None)
    _need(
        have == value,
        f"model.overrides.{name}",
        f"{value!r} contradicts the checkpoint's {name}={have!r} (model.source={c.model.source}); the architecture "
        "of a loaded checkpoint is its own: remove the override (model.param_dtype, dtype, remat, scan_layers, "
        "attention_impl, attn_block_size and moe_impl apply to every source)",
    )


def model_overrides(c) -> dict[str, Any]:
  """The `ModelConfig` fields `config.model` sets for every model source."""
  m = c.model
  return {
      "param_dtype": m.param_dtype,
      "dtype": m.dtype,
      "remat": m.remat,
      "scan_layers": bool(m.scan_layers),
      "attention_impl": m.attention_impl,
      "attn_block_size": int(m.attn_block_size),
      "moe_impl": m.moe_impl,
  }


def _check_data(c) -> None:
  d = c.data
  source = get_source(d.source)
  _need(d.format in FORMATS, "data.format", f"{d.format!r}; choose one of {FORMATS}")
  if source.validate is not None:
    source.validate(d)
  _need(d.template in TEMPLATES, "data.template", f"{d.template!r}; choose one of {TEMPLATES}")
  _need(d.num_epochs > 0, "data.num_epochs", f"must be > 0, got {d.num_epochs}")


MAX_LEARNING_RATE = 1.0  # AdamW moves each parameter by about lr per update: above 1 nothing survives


def _check_optimizer(c) -> None:
  o = c.optimizer
  _need(o.schedule in SCHEDULES, "optimizer.schedule", f"{o.schedule!r}; choose one of {SCHEDULES}")
  optimizer_config(c)
  lr_decay_config(c)
  _need(
      o.learning_rate <= MAX_LEARNING_RATE,
      "optimizer.learning_rate",
      f"{o.learning_rate} is above {MAX_LEARNING_RATE}: AdamW moves every parameter by about the learning rate per "
      "update, which destroys the policy; RL fine-tuning uses 1e-7 .. 1e-3",
  )


def check_eval(c) -> None:
  """The `config.eval` fields (the trainer's evaluations and `minpro_jax.evaluate`). Raises ConfigError naming one."""
  e = c.eval
  _need(e.n >= 1, "eval.n", f"must be >= 1, got {e.n}")
  _need(e.num_problems >= 1, "eval.num_problems", f"must be >= 1, got {e.num_problems}")
  _need(all(1 <= k <= e.n for k in e.ks), "eval.ks", f"every k must lie in [1, eval.n={e.n}]")
  _need(0.0 < e.top_p <= 1.0, "eval.top_p", f"must lie in (0, 1] (1 = off), got {e.top_p}")
  _need(e.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {e.temperature}")
  _need(e.every >= 0, "eval.every", f"must be >= 0 (0 = only at start and end), got {e.every}")
  _need(
      e.reward_mode is None or e.reward_mode in REWARD_MODES,
      "eval.reward_mode",
      f"{e.reward_mode!r}; choose one of {REWARD_MODES}, or leave it unset for reward.mode",
  )
  for name, fmt, path in eval_files(c):
    _need(
        bool(name and fmt and path),
        "eval.path",
        f"cannot parse an item into name={name!r}, fmt={fmt!r}, path={path!r}; write each item as name=fmt:path "
        "(e.g. math500=math500:data/math500.jsonl)",
    )
    _need(
        fmt in FORMATS or fmt == "tfds",
        "eval.path",
        f"{name}={fmt}:{path}: unknown format {fmt!r}; use one of {FORMATS}",
    )
    if fmt == "tfds":  # name=tfds:DATASET/SPLIT@DATA_DIR (minpro_jax.data.tfds_source)
      from minpro_jax.data.tfds_source import dataset_dir_exists, parse_tfds_ref

      ds, _, data_dir = parse_tfds_ref(path)
      _need(dataset_dir_exists(ds, data_dir), "eval.path", f"{name}=tfds:{path}: no dataset {ds!r} in {data_dir!r}")
      continue
    _need(os.path.isfile(path), "eval.path", f"{name}={fmt}:{path}: write name=fmt:path with an existing file")
    check_data_file(path, "eval.path")


def eval_files(c) -> list[tuple[str, str, str]]:
  """`config.eval.path` ("name=fmt:path,name2=fmt:path2") as (name, fmt, path) triples; for a TFDS split
  ("name=tfds:DATASET/SPLIT@DATA_DIR") fmt is "tfds" and path "DATASET/SPLIT@DATA_DIR"."""
  out = []
  for item in filter(None, (c.eval.path or "").split(",")):
    name, _, rest = item.partition("=")
    fmt, _, path = rest.partition(":")
    out.append((name, fmt, path))
  return out


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


def _check_mipu(c) -> None:
  m = c.mipu
  if not m.rollback:  # the Step-2 settings do nothing without rollback: a set one would be a silent plain run
    unset_fields = (("mode", "gap"), ("random_rate", None), ("match_rate_of", ""), ("ground_truth", False))
    for field, unset in unset_fields + (("statistic", "t_post"), ("tolerance", "fixed")):
      msg = f"{m[field]!r} needs mipu.rollback=True (MIPU Step 2: no rollback without it); set it or unset mipu.{field}"
      _need(m[field] == unset, f"mipu.{field}", msg)
    return
  _need(m.mode in mipu.MODES, "mipu.mode", f"must be one of {mipu.MODES}, got {m.mode!r}")
  _need(m.statistic in mipu.STATISTICS, "mipu.statistic", f"must be one of {mipu.STATISTICS}, got {m.statistic!r}")
  _need(m.tolerance in mipu.TOLERANCES, "mipu.tolerance", f"must be one of {mipu.TOLERANCES}, got {m.tolerance!r}")
  if m.mode == "random":
    for field, unset in (("statistic", "t_post"), ("tolerance", "fixed")):
      _need(m[field] == unset, f"mipu.{field}", "is for mode=gap (random rollbacks test nothing); unset it")
  if m.tolerance == "calibrated":
    _need(
        m.statistic == "t_post",
        "mipu.tolerance",
        f"calibrated sets c against the standing gap of T_post; {m.statistic} is a paired difference with no "
        "standing gap (its value at theta' = theta_k is 0): use tolerance=fixed with gap_tolerance (e.g. 0)",
    )
    _need(m.calibration_draws >= 2, "mipu.calibration_draws", f"must be >= 2, got {m.calibration_draws}")
    _need(math.isfinite(m.calibration_z), "mipu.calibration_z", f"must be a finite number, got {m.calibration_z}")
  if m.mode == "random":
    _need(
        (m.random_rate is None) != (not m.match_rate_of),
        "mipu.random_rate",
        "mode=random needs exactly one of mipu.random_rate (a probability) and mipu.match_rate_of (a finished run's "
        f"workdir); got random_rate={m.random_rate!r}, match_rate_of={m.match_rate_of!r}",
    )
    _need(
        m.random_rate is None or 0.0 <= m.random_rate <= 1.0,
        "mipu.random_rate",
        f"must lie in [0, 1], got {m.random_rate}",
    )
    _need(not m.ground_truth, "mipu.ground_truth", "needs mode=gap (random rollbacks sample nothing to compare)")
    return  # the reference run is read when the run starts (`random_rollback_rate`): in a study it runs first
  _need(
      m.random_rate is None and not m.match_rate_of,
      "mipu.random_rate",
      "is for mode=random; unset it or set mipu.mode=random",
  )
  _need(math.isfinite(m.gap_tolerance), "mipu.gap_tolerance", f"must be a finite number, got {m.gap_tolerance}")
  _need(m.val_prompts >= 1, "mipu.val_prompts", f"must be >= 1, got {m.val_prompts}")
  _need(
      m.val_group_size >= 2,
      "mipu.val_group_size",
      f"must be >= 2 (T_post needs group-normalised advantages), got {m.val_group_size}",
  )
  n_val = m.val_prompts * m.val_group_size
  mb = min(learner_micro_batch(c), n_val)  # the learner scores the validation batch in these micro-batches
  _need(
      n_val % mb == 0,
      "mipu.val_prompts",
      f"val_prompts * val_group_size = {n_val} validation samples are not divisible by the scoring micro-batch "
      f"{mb} (micro_batch_size); choose sizes whose product is a multiple of {mb}",
  )


def learner_micro_batch(c) -> int:
  """Samples per micro-batch of the learner: `micro_batch_size`, at most one mini-batch."""
  return min(c.micro_batch_size, c.prompts_per_step * c.group_size // c.num_updates_per_step)


def resolve_mesh_shape(shape: dict[str, int], num_devices: int) -> dict[str, int]:
  """`shape` ({axis: size}, one size may be -1) with the -1 replaced by the remaining devices.

  Raises:
    ValueError: an unknown axis, a size < 1 other than one -1, or sizes that do not divide (with a -1) or multiply
      to (without) `num_devices`; the message names neither the flag nor the field (the caller adds it).
  """
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown axes {sorted(unknown)}; mesh axes are {MESH_AXES}")
  fill = [a for a, v in shape.items() if v == -1]
  if len(fill) > 1 or not all(v > 0 or v == -1 for v in shape.values()):
    raise ValueError("sizes must be positive, with at most one -1 (= the remaining devices)")
  prod = math.prod(v for v in shape.values() if v > 0)
  if num_devices % prod if fill else prod != num_devices:
    raise ValueError(f"does not divide the {num_devices} available devices")
  return {a: num_devices // prod if v == -1 else v for a, v in shape.items()}


def _check_mesh(c, num_devices: int) -> None:
  shape = parse_mesh_shape(c.mesh.shape)
  _need(
      bool(shape) or jax.process_count() == 1,
      "mesh.shape",
      f"empty means one device, but this run has {jax.process_count()} processes with {num_devices} devices in all; "
      "the mesh must span every process's devices (they checkpoint together): set e.g. --config.mesh.shape=fsdp=-1",
  )
  if shape:
    try:
      shape = resolve_mesh_shape(shape, num_devices)
    except ValueError as e:
      raise ConfigError(f"config.mesh.shape: {c.mesh.shape!r}: {e}") from e
  check_micro_batch_split(c, shape or {}, num_devices)
  spec = c.sampling.get("mesh", "")
  heads = _model_heads(c)
  if spec and (heads or spec != "auto"):  # the sampler's mesh spans the learner mesh's devices (one without a mesh)
    parse_sampling_mesh(spec, math.prod(shape.values()) if shape else 1, *(heads or (None, None)))


def check_micro_batch_split(c, mesh_shape: dict[str, int], num_devices: int) -> None:
  """Every micro-batch the learner runs (updates and scoring; MIPU's validation batch when smaller) must split
  over the mesh's batch axes: otherwise GSPMD keeps its rows whole on every device, splits the contraction instead
  and all-reduces every matmul output (docs/aot.md). In a multi-process run `mesh_shape` is the mesh over every
  process's devices.

  Args:
    mesh_shape: the resolved `config.mesh.shape` ({} = one device); num_devices: its device count (for the message).

  Raises:
    ConfigError: naming `config.micro_batch_size` (or `config.mipu.val_prompts`), both figures and the fix.
  """
  axes, split = batch_split(mesh_shape)
  micro, mini = learner_micro_batch(c), c.prompts_per_step * c.group_size // c.num_updates_per_step
  where = f"mesh.shape={c.mesh.shape!r} on {num_devices} devices: {' x '.join(axes)} = {split}"
  fits = [m for m in range(split, mini + 1, split) if mini % m == 0]
  _need(
      micro % split == 0,
      "micro_batch_size",
      f"the learner's micro-batch of {micro} samples does not split over the mesh's batch axes ({where}), so every "
      "device would hold whole rows and all-reduce every matmul output; "
      + (
          f"set micro_batch_size to a multiple of {split} that divides the mini-batch of {mini} (e.g. {fits[0]})"
          if fits
          else f"no micro-batch of the mini-batch of {mini} samples does: choose a mesh whose {' x '.join(axes)} "
          f"divides {mini} (more tensor, fewer data/fsdp/expert devices)"
      ),
  )
  if c.mipu.rollback:  # the validation batch is scored in micro-batches of min(micro, its size)
    n_val = c.mipu.val_prompts * c.mipu.val_group_size
    _need(
        min(micro, n_val) % split == 0,
        "mipu.val_prompts",
        f"MIPU's validation batch of val_prompts * val_group_size = {n_val} samples does not split over the mesh's "
        f"batch axes ({where}); make it a multiple of {split}",
    )


def _model_heads(c) -> tuple[int, int] | None:
  """(attention heads, KV heads) of the config's model where they are known without loading it (a GGUF's are
  checked when the trainer builds its sampler)."""
  m = c.model
  if m.source == "scratch":
    cfg = get_preset(m.preset, **dict(m.overrides), **model_overrides(c))
  elif m.source == "hf":
    cfg = hf_model_config(m.path)
  else:
    return None
  return cfg.num_heads, cfg.num_kv_heads


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


# ---------------------------------------------------------------------------------------------- typed configs
def sampling_params(c, stop_token_ids) -> SamplingParams:
  """The sampler's `SamplingParams` of `config.sampling` (top_k 0 and top_p 1 mean off).

  Raises:
    ConfigError: naming the `config.sampling` field `SamplingParams` refuses.
  """
  s = c.sampling
  try:
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k or None,
        top_p=s.top_p if s.top_p != 1.0 else None,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=tuple(int(i) for i in stop_token_ids),
    )
  except ValueError as e:
    hit = re.search(r"SamplingParams\.(\w+)", str(e))
    raise ConfigError(f"config.sampling.{hit.group(1) if hit else ''}: {e}") from e


# config.loss fields that are not objective hyper-parameters
_LOSS_TERMS = ("method", "entropy_coef", "kl_coef", "router_aux_coef", "logprob_chunk_size", "router_replay")
_COMMON_HPARAMS = ("loss_agg_mode", "rollout_is", "tis_cap", "rollout_mis", "rollout_mis_bounds")


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
    value = l[name]
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
