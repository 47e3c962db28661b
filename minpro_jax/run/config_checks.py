"""The checks of a training config's fields (`run_config.validate_config` runs them), and the readers of the fields
they check (mesh shape, model fields, evaluation files, learner micro-batch).

Each field is checked once, against the choices of the module that owns it (imported, never copied); a failure is
a `ConfigError` whose message starts with `config.<field>:` and says how to fix it (`need`). The checks that build a
part's typed config to validate it (sampling, loss, optimizer) are `minpro_jax.run.run_config`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax

from minpro_jax.data.prompts import TEMPLATES
from minpro_jax.data.sources import FORMATS, check_data_file, get_source
from minpro_jax.data.tokenizers import CHAT_TEMPLATES
from minpro_jax.errors import ConfigError, FileFormatError
from minpro_jax.models.config import PRESETS, get_preset
from minpro_jax.models.hf_io import config_from_hf
from minpro_jax.rl import mipu
from minpro_jax.rl.aggregation import ROLLOUT_IS_LEVELS, ROLLOUT_MIS_LEVELS
from minpro_jax.runtime import row_layout
from minpro_jax.runtime.device_split import sampler_device_count
from minpro_jax.runtime.inference_mesh import parse_sampling_mesh
from minpro_jax.runtime.rules import parse_rules
from minpro_jax.runtime.sharding import MESH_AXES, batch_split

REWARD_MODES = ("math", "integer")  # minpro_jax.data.rewards.math_reward's modes


MODEL_SOURCES = ("scratch", "hf", "gguf")  # how run_setup builds the model


TOKENIZER_KINDS = ("train_spm", "path", "model")  # how run_setup builds the tokenizer


def need(cond: bool, field: str, msg: str) -> None:
  """Raises `ConfigError("config.<field>: <msg>")` unless `cond`."""
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def parse_mesh_shape(spec: str) -> dict[str, int] | None:
  """`"data=2,fsdp=4"` -> `{"data": 2, "fsdp": 4}`; `""` -> None. Raises ConfigError naming `config.mesh.shape`."""
  if not spec:
    return None
  out = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    ok = bool(name.strip()) and re.fullmatch(r"-?[0-9]+", size.strip()) is not None
    need(ok, "mesh.shape", f"cannot parse {part!r}; write e.g. 'data=2,fsdp=4'")
    need(name.strip() not in out, "mesh.shape", f"{spec!r} gives axis {name.strip()!r} twice; give each axis once")
    out[name.strip()] = int(size)
  return out


def check_batch_split(c) -> None:
  for field in ("prompts_per_step", "group_size", "num_updates_per_step"):
    need(c[field] >= 1, field, f"must be >= 1, got {c[field]}")
  n = c.prompts_per_step * c.group_size
  need(
      n % c.num_updates_per_step == 0,
      "num_updates_per_step",
      f"prompts_per_step * group_size = {n} samples must split into {c.num_updates_per_step} equal mini-batches",
  )
  mini = n // c.num_updates_per_step
  need(
      c.group_size == 1 or mini % c.group_size == 0,
      "num_updates_per_step",
      f"each mini-batch of {mini} samples must hold whole groups of group_size={c.group_size}",
  )
  need(c.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1 (samples per micro-batch), got {c.micro_batch_size}")
  need(
      mini % c.micro_batch_size == 0 or c.micro_batch_size > mini,
      "micro_batch_size",
      f"mini-batch of {mini} samples is not divisible by micro_batch_size={c.micro_batch_size}",
  )


def check_run(c) -> None:
  need(
      bool(c.workdir),
      "workdir",
      "must not be empty (the run writes checkpoints, metrics and plots there); e.g. --config.workdir=runs/my_run",
  )
  need(
      not os.path.exists(c.workdir) or os.path.isdir(c.workdir),
      "workdir",
      f"{c.workdir!r} exists and is not a directory; choose another path",
  )
  need(
      not os.path.isfile(os.path.join(c.workdir, "study.json")),  # minpro_jax.study.runner.STUDY_FILE
      "workdir",
      f"{c.workdir!r} is a study's directory (it holds study.json; the run would overwrite the study's summary.json); "
      "give the run its own directory, e.g. a new folder inside it",
  )
  need(c.total_steps >= 1, "total_steps", f"must be >= 1, got {c.total_steps}")
  need(c.delay >= 0, "delay", f"must be >= 0 (0 = on-policy), got {c.delay}")
  for field in ("every", "keep"):
    low = 0 if field == "every" else 1
    need(c.checkpoint[field] >= low, f"checkpoint.{field}", f"must be >= {low}, got {c.checkpoint[field]}")


STALENESS_MODES = ("delay", "inflight")  # config.staleness.mode (docs/inflight.md)
INFLIGHT_KV = ("keep", "recompute")  # config.staleness.inflight_kv: `minpro_jax.sampling.streaming.KV_MODES`
CHECKPOINT_KV = ("save", "rebuild")  # config.staleness.inflight_checkpoint_kv: the pool's KV cache in checkpoints
INT32_MAX = 2**31 - 1  # the streaming pool's segment loop counts decode steps in int32 (sampling/streaming.py)
SEQUENCE_METHODS = ("gspo", "gspo_token")  # objectives whose ratio is a sequence's: one version per response


def check_staleness(c) -> None:
  """`config.staleness` (absent in configs from before it: delay mode), and what in-flight updates cannot run with:
  sequence-level ratios (GSPO, sequence IS / MIS: a response drawn by several versions has no one behaviour
  sequence probability they are defined for), A-3PO's interpolation (one version per mini-batch), MIPU's rollback
  (it would move the version counter back under tokens already drawn), dynamic sampling, router replay, a sampler
  on its own devices and engines other than the continuous one."""
  st = c.get("staleness")
  if st is None:
    return
  need(st.mode in STALENESS_MODES, "staleness.mode", f"{st.mode!r}; choose one of {STALENESS_MODES}")
  need(st.inflight_kv in INFLIGHT_KV, "staleness.inflight_kv", f"{st.inflight_kv!r}; choose one of {INFLIGHT_KV}")
  kv_ckpt = st.get("inflight_checkpoint_kv", "save")
  need(kv_ckpt in CHECKPOINT_KV, "staleness.inflight_checkpoint_kv", f"{kv_ckpt!r}; choose one of {CHECKPOINT_KV}")
  if st.mode != "inflight":
    return
  k = st.inflight_every  # also a domain of config_domains (every mode); checked here for the compile-only runs too
  need(
      isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= INT32_MAX,
      "staleness.inflight_every",
      f"must be an int in [1, {INT32_MAX}] (decode steps per segment, counted in int32 by the segment loop; a "
      f"segment also ends when nothing is live or waiting), got {k!r}",
  )
  why = "with staleness.mode='inflight', where one response's tokens come from several versions"
  l = c.loss
  need(
      l.method not in SEQUENCE_METHODS,
      "loss.method",
      f"{l.method!r} takes a sequence-level ratio, which is not defined {why}; use a token-level objective "
      "(minpro, grpo, cispo, m2po, ...) or staleness.mode='delay'",
  )
  for field, levels in (("rollout_is", ROLLOUT_IS_LEVELS), ("rollout_mis", ROLLOUT_MIS_LEVELS)):
    value = l.get(field)
    need(
        value in (None, "token") or value not in levels,  # an unknown level: the loss's check names the choices
        f"loss.{field}",
        f"{value!r} corrects with a sequence-level ratio, which is not defined {why}; use 'token' or "
        "staleness.mode='delay'",
    )
  need(
      l.get("proximal") != "interpolate",
      "loss.proximal",
      f"'interpolate' (A-3PO) needs one version per mini-batch, not so {why}; unset it or use staleness.mode='delay'",
  )
  for field, off in (
      ("mipu.rollback", False),
      ("sampling.drop_equal_reward_groups", False),
      ("loss.router_replay", False),
      ("sampling.record_routes", False),
  ):
    group, name = field.split(".")
    need(
        c[group].get(name, off) == off,
        field,
        f"is not supported with staleness.mode='inflight' yet; set {field}={off} or staleness.mode='delay'",
    )
  need(
      c.sampling.get("devices", 0) in (0, 0.0),
      "sampling.devices",
      "staleness.mode='inflight' runs the sampler on the learner's devices; set sampling.devices=0",
  )
  pool = "staleness.mode='inflight' streams the continuous engine's pool on the dense cache"
  for field, ok, fix in (  # the field the user set is the one named
      ("engine", ("", "continuous"), "unset it"),
      ("continuous", (True,), "set sampling.continuous=True"),
      ("kv_cache", ("auto", "dense"), "set sampling.kv_cache='dense' (or 'auto')"),
  ):
    value = c.sampling.get(field, ok[0])
    need(value in ok, f"sampling.{field}", f"{value!r}: {pool}; {fix} or use staleness.mode='delay'")


_MODEL_FIELD = re.compile(r"ModelConfig\.(\w+)")


def check_model(c) -> None:
  m = c.model  # m.source: checked by validate_shapes_config
  if m.source == "hf":
    need(
        bool(m.path) and os.path.isdir(m.path),
        "model.path",
        f"HF checkpoint folder {m.path!r} does not exist; point it at a folder with config.json + safetensors",
    )
  if m.source == "gguf" and m.path:
    need(os.path.isfile(m.path), "model.path", f"GGUF file {m.path!r} does not exist")
  t = c.tokenizer
  need(t.kind in TOKENIZER_KINDS, "tokenizer.kind", f"{t.kind!r}; choose one of {TOKENIZER_KINDS}")
  if t.kind == "path":
    need(bool(t.path) and os.path.exists(t.path), "tokenizer.path", f"{t.path!r} does not exist")
  need(
      t.chat_format is None or t.chat_format in CHAT_TEMPLATES,
      "tokenizer.chat_format",
      f"{t.chat_format!r}; choose one of {sorted(CHAT_TEMPLATES)}, or leave it unset for the tokenizer's own",
  )
  every_source = model_overrides(c)
  scratch_overrides = dict(m.overrides) if m.source == "scratch" else {}
  for name in every_source:
    need(name not in m.overrides, f"model.overrides.{name}", f"set config.model.{name} instead (every source)")
  if m.source == "scratch":
    need(m.preset in PRESETS, "model.preset", f"{m.preset!r}; choose one of {sorted(PRESETS)}")
    need(
        t.kind != "model",
        "tokenizer.kind",
        "'model' reads the tokenizer of an hf/gguf checkpoint; with model.source=scratch use train_spm or path",
    )
  try:  # ModelConfig checks its own fields (a loaded checkpoint's: those every source takes); name the config field
    built = get_preset(m.preset if m.source == "scratch" else "tiny", **every_source, **scratch_overrides)
  except (TypeError, ValueError) as e:
    hit = _MODEL_FIELD.search(str(e)) or re.search(r"argument '(\w+)'", str(e))
    name = hit.group(1) if hit else ""
    field = f"model.overrides.{name}" if name in m.overrides else f"model.{name}" if name in m else "model.overrides"
    raise ConfigError(f"config.{field}: {e}") from e
  if m.source == "scratch":  # the architecture of a loaded checkpoint comes from it (checked below, or once read)
    check_routes_fit(c, built)
  if m.source == "hf":
    loaded = hf_model_config(m.path)
    check_overrides_match(c, loaded)
    check_routes_fit(c, loaded)


def check_routes_fit(c, model_config) -> None:
  """Raises ConfigError naming `config.loss.router_replay` / `config.sampling.record_routes` when one is set for a
  model without experts (`model_config`, its `ModelConfig`): routes exist only in MoE models."""
  for part, name in (("loss", "router_replay"), ("sampling", "record_routes")):
    msg = "routes exist only in MoE models; this model has no experts, unset it"
    need(not c[part][name] or model_config.is_moe, f"{part}.{name}", msg)


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
    need(
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


def check_data(c) -> None:
  d = c.data
  source = get_source(d.source)
  need(d.format in FORMATS, "data.format", f"{d.format!r}; choose one of {FORMATS}")
  if source.validate is not None:
    source.validate(d)
  need(d.template in TEMPLATES, "data.template", f"{d.template!r}; choose one of {TEMPLATES}")
  need(d.num_epochs > 0, "data.num_epochs", f"must be > 0, got {d.num_epochs}")


def check_eval(c) -> None:
  """The `config.eval` fields (the trainer's evaluations and `minpro_jax.evaluate`). Raises ConfigError naming one."""
  e = c.eval
  need(e.n >= 1, "eval.n", f"must be >= 1, got {e.n}")
  need(e.num_problems >= 1, "eval.num_problems", f"must be >= 1, got {e.num_problems}")
  need(all(1 <= k <= e.n for k in e.ks), "eval.ks", f"every k must lie in [1, eval.n={e.n}]")
  repeated = sorted({k for k in e.ks if tuple(e.ks).count(k) > 1})
  need(not repeated, "eval.ks", f"{tuple(e.ks)} lists k={repeated} more than once; list each k once")
  need(0.0 < e.top_p <= 1.0, "eval.top_p", f"must lie in (0, 1] (1 = off), got {e.top_p}")
  need(e.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {e.temperature}")
  need(e.every >= 0, "eval.every", f"must be >= 0 (0 = only at start and end), got {e.every}")
  need(
      e.reward_mode is None or e.reward_mode in REWARD_MODES,
      "eval.reward_mode",
      f"{e.reward_mode!r}; choose one of {REWARD_MODES}, or leave it unset for reward.mode",
  )
  for name, fmt, path in eval_files(c):
    need(
        bool(name and fmt and path),
        "eval.path",
        f"cannot parse an item into name={name!r}, fmt={fmt!r}, path={path!r}; write each item as name=fmt:path "
        "(e.g. math500=math500:data/math500.jsonl)",
    )
    need(
        fmt in FORMATS or fmt == "tfds",
        "eval.path",
        f"{name}={fmt}:{path}: unknown format {fmt!r}; use one of {FORMATS}",
    )
    if fmt == "tfds":  # name=tfds:DATASET/SPLIT@DATA_DIR (minpro_jax.data.tfds_source)
      # optional dependency (tensorflow-datasets), imported only for a tfds source
      from minpro_jax.data.tfds_source import dataset_dir_exists, parse_tfds_ref

      ds, _, data_dir = parse_tfds_ref(path)
      need(dataset_dir_exists(ds, data_dir), "eval.path", f"{name}=tfds:{path}: no dataset {ds!r} in {data_dir!r}")
      continue
    need(os.path.isfile(path), "eval.path", f"{name}={fmt}:{path}: write name=fmt:path with an existing file")
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


def check_mipu(c) -> None:
  m = c.mipu
  if not m.rollback:  # the Step-2 settings do nothing without rollback: a set one would be a silent plain run
    unset_fields = (("mode", "gap"), ("random_rate", None), ("match_rate_of", ""), ("ground_truth", False))
    for field, unset in unset_fields + (("statistic", "t_post"), ("tolerance", "fixed")):
      msg = f"{m[field]!r} needs mipu.rollback=True (MIPU Step 2: no rollback without it); set it or unset mipu.{field}"
      need(m[field] == unset, f"mipu.{field}", msg)
    return
  need(m.mode in mipu.MODES, "mipu.mode", f"must be one of {mipu.MODES}, got {m.mode!r}")
  need(m.statistic in mipu.STATISTICS, "mipu.statistic", f"must be one of {mipu.STATISTICS}, got {m.statistic!r}")
  need(m.tolerance in mipu.TOLERANCES, "mipu.tolerance", f"must be one of {mipu.TOLERANCES}, got {m.tolerance!r}")
  if m.mode == "random":
    for field, unset in (("statistic", "t_post"), ("tolerance", "fixed")):
      need(m[field] == unset, f"mipu.{field}", "is for mode=gap (random rollbacks test nothing); unset it")
  if m.tolerance == "calibrated":
    need(
        m.statistic == "t_post",
        "mipu.tolerance",
        f"calibrated sets c against the standing gap of T_post; {m.statistic} is a paired difference with no "
        "standing gap (its value at theta' = theta_k is 0): use tolerance=fixed with gap_tolerance (e.g. 0)",
    )
    need(m.calibration_draws >= 2, "mipu.calibration_draws", f"must be >= 2, got {m.calibration_draws}")
    need(math.isfinite(m.calibration_z), "mipu.calibration_z", f"must be a finite number, got {m.calibration_z}")
  if m.mode == "random":
    need(
        (m.random_rate is None) != (not m.match_rate_of),
        "mipu.random_rate",
        "mode=random needs exactly one of mipu.random_rate (a probability) and mipu.match_rate_of (a finished run's "
        f"workdir); got random_rate={m.random_rate!r}, match_rate_of={m.match_rate_of!r}",
    )
    need(
        m.random_rate is None or 0.0 <= m.random_rate <= 1.0,
        "mipu.random_rate",
        f"must lie in [0, 1], got {m.random_rate}",
    )
    need(not m.ground_truth, "mipu.ground_truth", "needs mode=gap (random rollbacks sample nothing to compare)")
    return  # the reference run is read when the run starts (`random_rollback_rate`): in a study it runs first
  need(
      m.random_rate is None and not m.match_rate_of,
      "mipu.random_rate",
      "is for mode=random; unset it or set mipu.mode=random",
  )
  need(math.isfinite(m.gap_tolerance), "mipu.gap_tolerance", f"must be a finite number, got {m.gap_tolerance}")
  need(m.val_prompts >= 1, "mipu.val_prompts", f"must be >= 1, got {m.val_prompts}")
  need(
      m.val_group_size >= 2,
      "mipu.val_group_size",
      f"must be >= 2 (T_post needs group-normalised advantages), got {m.val_group_size}",
  )
  n_val = m.val_prompts * m.val_group_size
  mb = min(learner_micro_batch(c), n_val)  # the learner scores the validation batch in these micro-batches
  need(
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
  if fill and num_devices % prod:
    raise ValueError(f"the sizes other than -1 ({prod}) do not divide the {num_devices} available devices")
  if not fill and prod != num_devices:
    raise ValueError(f"the sizes multiply to {prod}, not the {num_devices} available devices (or use one -1)")
  return {a: num_devices // prod if v == -1 else v for a, v in shape.items()}


def check_mesh(c, num_devices: int) -> None:
  sampler_devices = sampler_device_count(c.sampling.devices, num_devices, jax.process_count())
  num_devices -= sampler_devices  # the learner's mesh spans the rest (runtime/device_split.py)
  row_layout.process_prompts(c.prompts_per_step, 0, jax.process_count())  # each process owns whole groups
  shape = parse_mesh_shape(c.mesh.shape)
  need(
      bool(shape) or jax.process_count() == 1,
      "mesh.shape",
      f"empty means one device, but this run has {jax.process_count()} processes with {num_devices} devices in all; "
      "the mesh must span every process's devices (they checkpoint together): set e.g. --config.mesh.shape=fsdp=-1",
  )
  need(
      bool(shape) or not sampler_devices or num_devices == 1,
      "mesh.shape",
      f"empty means one device, but sampling.devices={c.sampling.devices} leaves the learner {num_devices}: set "
      "e.g. --config.mesh.shape=fsdp=-1 to learn on all of them",
  )
  if shape:
    try:
      shape = resolve_mesh_shape(shape, num_devices)
    except ValueError as e:
      split = f" (sampling.devices={c.sampling.devices} gives the sampler {sampler_devices}; or change that)"
      raise ConfigError(f"config.mesh.shape: {c.mesh.shape!r}: {e}{split if sampler_devices else ''}") from e
  check_micro_batch_split(c, shape or {}, num_devices)
  spec = c.sampling.mesh
  heads = _model_heads(c)
  if spec and (heads or spec != "auto"):  # the sampler's mesh spans the learner mesh's devices (one without a mesh)
    n = sampler_devices or (math.prod(shape.values()) if shape else 1)  # or its own
    parse_sampling_mesh(spec, n, *(heads or (None, None)))


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
  axes, split = batch_split(mesh_shape, parse_rules(c.mesh.rules, "default", "mesh.rules"))
  micro, mini = learner_micro_batch(c), c.prompts_per_step * c.group_size // c.num_updates_per_step
  where = f"mesh.shape={c.mesh.shape!r} on {num_devices} devices: {' x '.join(axes)} = {split}"
  fits = [m for m in range(split, mini + 1, split) if mini % m == 0]
  need(
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
    need(
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
    need(
        c.mipu.val_prompts <= num_problems,
        "mipu.val_prompts",
        f"{c.mipu.val_prompts} validation prompts are drawn from the training problems, but only {num_problems} "
        "are available; lower mipu.val_prompts or raise data.size",
    )
