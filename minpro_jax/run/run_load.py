"""A run's config, tokenizer and parameters, read back from its workdir (what `export` and `evaluate` load).

The trainer writes two files for this when a run starts or resumes, after the resume check (`save_run_files`,
process 0):
  * `workdir/config.json`: the run's whole config (`ConfigDict.to_json_best_effort`);
  * `workdir/tokenizer.model`: the sentencepiece model of a run that trained one (`tokenizer.kind=train_spm`), which
    otherwise lives only in `sft.cache_dir`. Other tokenizers are read from where the config points.
A run started before these files existed is still read: the config from its `summary.json` (finished runs only), the
trained tokenizer from `sft.cache_dir` (resolved against the current directory, as the run did).

Parameters: `which="best"` reads `workdir/best` (the highest evaluation, as the papers select), `"final"` the newest
run checkpoint, an int step that run checkpoint. Only the parameters are read from a run checkpoint (an orbax partial
restore): the optimizer state never leaves the disk. The model is built on one device (`mesh=None`) or sharded on a
mesh by the default logical-axis rules.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from minpro_jax.config_lib.defaults import base_config
from minpro_jax.data.tokenizers import load_sentencepiece, smollm2_gguf_path
from minpro_jax.errors import CheckpointError, ConfigError
from minpro_jax.models import Transformer, get_preset
from minpro_jax.models.config import ModelConfig
from minpro_jax.models.gguf_io import gguf_config
from minpro_jax.models.hf_io import config_from_hf
from minpro_jax.run import run_config
from minpro_jax.run.run_setup import build_tokenizer, train_and_eval_problems
from minpro_jax.runtime.sharding import use_mesh

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"


@dataclasses.dataclass
class LoadedRun:
  """A run's model at one checkpoint.

  Attributes:
    config: the run's config (a `ml_collections.ConfigDict`).
    tokenizer: the run's tokenizer (`minpro_jax.data.tokenizers`).
    model: the `Transformer` with the checkpoint's parameters.
    which: "best", "final" or "step".
    step: the checkpoint's step: the global step of the best evaluation, or the run checkpoint's global step.
    eval_step: the global steps done when the run had these parameters (best: `step`; run checkpoint s: s + 1),
      which offsets the seed of the run's evaluation of them (`eval.seed + eval_step`, `Trainer.evaluate`).
  """

  config: Any
  tokenizer: Any
  model: Transformer
  which: str
  step: int
  eval_step: int


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def changed_fields(before: dict, now: dict) -> list[str]:
  """`field (before -> now)` for every dotted field whose value differs between two config dicts (absent: None)."""
  a, b = _flat(before), _flat(now)
  return [f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def save_run_files(workdir: str, c, tokenizer) -> None:
  """Writes `config.json` (and `tokenizer.model` for a trained sentencepiece tokenizer) into `workdir`. When it
  replaces the config.json of an earlier start of the run, logs a warning naming the fields that changed (those the
  resume check lets change, e.g. `optimizer.learning_rate` or `total_steps`: they apply from the resumed step on)."""
  path = os.path.join(workdir, CONFIG_FILE)
  text = c.to_json_best_effort(indent=2)
  if os.path.isfile(path):
    try:
      with open(path) as f:
        changed = changed_fields(json.load(f), json.loads(text))
    except (OSError, ValueError):
      changed = []  # an unreadable earlier file is replaced below
    if changed:
      logger.warning(
          "%s: this start changes %d config field(s) of the run's earlier start, from the resumed step on: %s",
          workdir,
          len(changed),
          "; ".join(changed[:12]) + (f"; and {len(changed) - 12} more" if len(changed) > 12 else ""),
      )
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
  if c.tokenizer.kind == "train_spm":
    with open(os.path.join(workdir, TOKENIZER_FILE + ".tmp"), "wb") as f:
      f.write(tokenizer.sp.serialized_model_proto())
    os.replace(os.path.join(workdir, TOKENIZER_FILE + ".tmp"), os.path.join(workdir, TOKENIZER_FILE))


def with_defaults(stored: dict, defaults: dict) -> dict:
  """`stored` (a run's config as JSON) completed with `defaults` (today's `base_config().to_dict()`) for every field
  it lacks: a run written before a field existed reads as having that field's default, so the code that reads a
  run's config never needs a fallback. Groups merge recursively; a stored value always wins."""
  out = dict(defaults)
  for k, v in stored.items():
    out[k] = with_defaults(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config of the run in `workdir`: its `config.json`, else the `config` of its `summary.json`, with today's
  default for each field it lacks (`with_defaults`: a run from before the field existed).

  Raises:
    ConfigError: `workdir` is not a directory, or holds neither file (naming both and the fix).
  """
  if not os.path.isdir(workdir):
    raise ConfigError(f"--workdir: {workdir} is not a directory; give the workdir of a run (e.g. runs/NAME)")
  for name, key in ((CONFIG_FILE, None), ("summary.json", "config")):
    path = os.path.join(workdir, name)
    if os.path.isfile(path):
      try:
        with open(path) as f:
          d = json.load(f)
        d = d if key is None else d[key]
        if not isinstance(d, dict) or "model" not in d or "tokenizer" not in d:
          raise ValueError("not a run config (no model and tokenizer sections)")
      except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--workdir: {path} does not hold a run's config ({type(e).__name__}: {e}); it is damaged or not a "
            "run's workdir (re-running the run's train command rewrites it)"
        ) from e
      return ml_collections.ConfigDict(with_defaults(d, base_config().to_dict()))
  raise ConfigError(
      f"--workdir: {workdir} has no {CONFIG_FILE} (written at the start of a run) and no summary.json (written at "
      "its end); give the workdir of a run of minpro_jax.train"
  )


def load_run_tokenizer(workdir: str, c):
  """The run's tokenizer: `workdir/tokenizer.model` when the run trained one, else as `run_setup` builds it."""
  saved = os.path.join(workdir, TOKENIZER_FILE)
  if c.tokenizer.kind == "train_spm" and os.path.isfile(saved):
    return load_sentencepiece(saved, chat_format=c.tokenizer.chat_format or "plain")
  if c.tokenizer.kind == "train_spm":
    logger.warning("%s has no %s: the run's tokenizer is read from sft.cache_dir or trained again", workdir, saved)
  problems = train_and_eval_problems(c)[0] if c.tokenizer.kind == "train_spm" else []
  return build_tokenizer(c, problems)


def model_config(c, tokenizer) -> ModelConfig:
  """The run's `ModelConfig`, without reading any weights (scratch preset, HF config.json or GGUF metadata)."""
  overrides = run_config.model_overrides(c)
  if c.model.source == "scratch":
    return get_preset(c.model.preset, vocab_size=tokenizer.vocab_size, **dict(c.model.overrides), **overrides)
  if c.model.source == "hf":
    with open(os.path.join(c.model.path, "config.json")) as f:
      return config_from_hf(json.load(f), **overrides)

  return gguf_config(c.model.path or smollm2_gguf_path(), **overrides)


def _which(workdir: str, which: str | int) -> tuple[str, str, int]:
  """(kind, orbax manager directory, step) of `which` in `workdir`."""
  best, ckpts = os.path.join(workdir, "best"), os.path.join(workdir, "checkpoints")
  if which == "best":
    steps = ocp.CheckpointManager(best).all_steps() if os.path.isdir(best) else []
    if not steps:
      raise CheckpointError(
          f"--which=best: {workdir} has no best-parameter checkpoint (written at the first evaluation); "
          "use --which=final"
      )
    return "best", best, max(steps)
  steps = sorted(ocp.CheckpointManager(ckpts).all_steps()) if os.path.isdir(ckpts) else []
  if not steps:
    raise CheckpointError(f"--which={which}: {workdir} has no run checkpoint under checkpoints/; use --which=best")
  if which == "final":
    return "final", ckpts, steps[-1]
  try:
    step = int(which)
  except (TypeError, ValueError):
    raise ConfigError(f"--which={which!r}: use best, final or a global step of a run checkpoint ({steps})") from None
  if step not in steps:
    raise CheckpointError(f"--which={step}: no run checkpoint of that step in {ckpts}; the run keeps steps {steps}")
  return "step", ckpts, step


def load_run(workdir: str, which: str | int = "best", mesh=None) -> LoadedRun:
  """The model of the run in `workdir` at checkpoint `which` (see the module docstring).

  Args:
    workdir: a run's workdir.
    which: "best", "final" or a global step (int or digits) of a kept run checkpoint.
    mesh: a device mesh to shard the parameters on (by the run's `config.mesh.rules`), or None for one device.

  Raises:
    ConfigError: no config in `workdir`, or `which` is not best/final/a step.
    CheckpointError: the checkpoint asked for does not exist (the message lists those that do).
  """
  workdir = os.path.abspath(workdir)
  c = load_run_config(workdir)
  kind, directory, step = _which(workdir, which)
  if kind == "final" and step + 1 < c.total_steps:
    logger.warning(
        "--which=final: the run in %s stopped after global step %d of %d (total_steps); its newest checkpoint is "
        "read, not a finished run's final parameters (re-run its training command to finish it)",
        workdir,
        step + 1,
        c.total_steps,
    )
  tokenizer = load_run_tokenizer(workdir, c)
  cfg = model_config(c, tokenizer)
  with nnx.use_eager_sharding(False) if mesh is None else use_mesh(mesh, run_config.learner_rules(c)):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  template = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
  if mesh is not None:  # eval_shape lays the shapes out on the abstract mesh; orbax reads onto the real one
    template = jax.tree.map(lambda s: _on_mesh(s, mesh), template)
  check_stored_shapes(os.path.join(directory, str(step)), "params" if kind == "best" else "state", template, which)
  mngr = ocp.CheckpointManager(directory)
  try:
    restored = _restore(mngr, kind, step, template)
  except Exception as e:  # noqa: BLE001 - a checkpoint that does not read back: name it
    raise CheckpointError(
        f"--which={which}: the checkpoint {directory}/{step} does not read back ({type(e).__name__}: "
        f"{str(e).strip().splitlines()[0][:300] if str(e) else ''}); it is damaged, or the run's config.json no "
        "longer describes its model"
    ) from e
  finally:
    mngr.close()
  model = nnx.merge(graphdef, restored, rest)
  eval_step = step if kind == "best" else step + 1  # checkpoint s is written after global step s, the (s+1)-th
  return LoadedRun(config=c, tokenizer=tokenizer, model=model, which=kind, step=step, eval_step=eval_step)


def _shape_key(path) -> str:
  """A parameter's name in a checkpoint's tree and in an `nnx.State` alike (`layers/attn/q/kernel`)."""
  parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def check_stored_shapes(step_dir: str, item: str, template, which) -> None:
  """Compares the parameter shapes stored in a checkpoint (its metadata; nothing is read) with `template`'s, before
  orbax restores it: a restore of other shapes fails inside orbax's event loop, which leaves tracebacks behind the
  error, or (a run checkpoint's partial restore) reads the stored shapes into a model that does not fit them.

  Raises:
    CheckpointError: a parameter's stored shape differs from the model the run's config.json describes, naming the
      parameter, both shapes and the fix. An unreadable metadata file is left to the restore to report.
  """
  absl_log = logging.getLogger("absl")  # orbax warns that the item has no _CHECKPOINT_METADATA (the step has)
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    meta = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, item)).item_metadata.tree
  except Exception:  # noqa: BLE001 - no metadata to go on: the restore reports what is wrong
    return
  finally:
    absl_log.setLevel(level)
  if item == "state":
    meta = meta.get("params", {}) if isinstance(meta, dict) else {}
  stored = {_shape_key(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(meta) if hasattr(v, "shape")}
  for path, want in jax.tree_util.tree_leaves_with_path(template):
    key = _shape_key(path)
    got = stored.get(key)
    if got is not None and got != tuple(want.shape):
      raise CheckpointError(
          f"--which={which}: the checkpoint {step_dir} holds {key} of shape {got}, but the run's config.json "
          f"describes a model with {tuple(want.shape)}: config.json was edited or is another run's; put back the "
          "run's own config.json (the model fields it was trained with)"
      )


def _on_mesh(s: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
  spec = s.sharding.spec if isinstance(s.sharding, jax.sharding.NamedSharding) else jax.sharding.PartitionSpec()
  return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def _restore(mngr, kind: str, step: int, template) -> Any:
  """The parameters of checkpoint `step`: the best parameters, or a run checkpoint's (partial restore)."""
  if kind == "best":
    args = ocp.args.Composite(params=ocp.args.StandardRestore(template))
    return mngr.restore(step, args=args)["params"]
  item = {"params": template}
  restore = ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
  )
  return mngr.restore(step, args=ocp.args.Composite(state=restore))["state"]["params"]


def copy_tokenizer_source(c, out: str) -> bool:
  """Copies the HF tokenizer files of an `hf`-source run's `model.path` into `out`; False when there are none."""
  if c.model.source != "hf" or c.tokenizer.kind != "model":
    return False
  names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
  found = [n for n in names if os.path.isfile(os.path.join(c.model.path, n))]
  for n in found:
    shutil.copy(os.path.join(c.model.path, n), os.path.join(out, n))
  return "tokenizer.json" in found
