"""The resume check: the config fields that define an experiment, stored in every run checkpoint and compared when
a run resumes, so that a workdir never mixes two experiments (docs/checkpoints.md)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

from minpro_jax.config_lib.defaults import ISSUE_57_LOSS_FIELDS
from minpro_jax.data.tfds_source import parse_tfds_ref
from minpro_jax.errors import ConfigError
from minpro_jax.run.run_config import eval_files
from minpro_jax.run.sampler_setup import FP8_OPTIONS

# Fields a run checkpoint is only valid for: resuming with other values would silently change the experiment.
RESUME_KEYS = (
    "seed",
    "tokenizer",
    "prompts_per_step",
    "group_size",
    "num_updates_per_step",
    "num_epochs",
    "delay",
    "loss",
    "model",
    "data",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.precision",
    *(f"sampling.{field}" for field, _, _ in FP8_OPTIONS),
    "sampling.max_new_tokens",
    "sampling.drop_equal_reward_groups",
    "sampling.max_sampling_rounds",
    "advantage_mode",
    "reward",
    "mipu",
    "eval.seed",  # the held-out prompts are removed from training, so the eval fields that choose them count
    "eval.num_problems",
    "eval.path",
    "eval.n",  # the grader and the sampling of the evaluations: the curve and best/ compare their scores
    "eval.reward_mode",
    "eval.temperature",
    "eval.top_p",
    "sft.target",  # the warm start's targets are also the trained tokenizer's corpus
    "learner.ess_step",
    "staleness",
)

# Keys added to RESUME_KEYS after checkpoints existed: a stored fingerprint without one ran with this value.
RESUME_DEFAULTS = {f"sampling.{field}": default for field, _, default in FP8_OPTIONS} | {"sft.target": "answer"}
RESUME_DEFAULTS |= {"sampling.drop_equal_reward_groups": False, "sampling.max_sampling_rounds": 4}
RESUME_DEFAULTS |= {"num_epochs": 1, "learner.ess_step": False}
RESUME_DEFAULTS |= {
    "staleness": {"mode": "delay", "inflight_every": 16, "inflight_kv": "keep", "inflight_checkpoint_kv": "save"}
}
# Fields added later to a group that RESUME_KEYS compares whole (e.g. `reward`): a stored group without one ran with
# this value.
GROUP_DEFAULTS = {"reward.mask_truncated": False, "staleness.inflight_checkpoint_kv": "save"}
GROUP_DEFAULTS |= {f"loss.{field}": None for field in ISSUE_57_LOSS_FIELDS}  # unset: the method's default
# Keys added later whose value then is unknown: a stored fingerprint without one is not compared on them.
UNRECORDED_KEYS = ("eval.n", "eval.reward_mode", "eval.temperature", "eval.top_p", "tfds")


# mipu fields added after checkpoints existed: a stored fingerprint without one ran with this value
MIPU_DEFAULTS = {"statistic": "t_post", "tolerance": "fixed", "calibration_draws": 8, "calibration_z": 2.0}


def _mipu_equivalent(now: Any, stored: Any) -> bool:
  """The mipu settings change the experiment only when rollback is on."""
  off = lambda v: not (v or {}).get("rollback", False)  # noqa: E731
  if isinstance(now, dict) and isinstance(stored, dict):
    stored = {**MIPU_DEFAULTS, **stored}
  return now == stored or (off(now) and off(stored))


def _staleness_equivalent(now: Any, stored: Any) -> bool:
  """The in-flight fields (`inflight_every`, `inflight_kv`) are read only in the in-flight mode: two delay-mode
  settings are the same experiment whatever they hold. `inflight_checkpoint_kv` is how checkpoints are written, not
  the experiment (each checkpoint records it): it may change on resume."""
  strip = lambda v: {k: x for k, x in (v or {}).items() if k != "inflight_checkpoint_kv"}  # noqa: E731
  delay = lambda v: strip(v).get("mode", "delay") == "delay"  # noqa: E731
  return strip(now) == strip(stored) or (delay(now) and delay(stored))


EQUIVALENT = {"mipu": _mipu_equivalent, "staleness": _staleness_equivalent}  # group -> same experiment?


def _differing_fields(key: str, now: Any, stored: Any) -> list[str]:
  """`key`, or `key.field` for each differing field when the values are dicts (absent = empty), each with the
  checkpoint's and the config's value."""
  if isinstance(now, dict) or isinstance(stored, dict):
    now, stored = now if isinstance(now, dict) else {}, stored if isinstance(stored, dict) else {}
    keys = [k for k in sorted(set(now) | set(stored)) if now.get(k) != stored.get(k)]
    return [f"{key}.{k} ({_short(stored.get(k))} in the checkpoint, {_short(now.get(k))} now)" for k in keys]
  return [f"{key} ({_short(stored)} in the checkpoint, {_short(now)} now)"]


def _short(value: Any, width: int = 40) -> str:
  text = repr(value)
  return text if len(text) <= width else text[: width - 3] + "..."


def resume_fingerprint(c) -> dict[str, Any]:
  """The values of `RESUME_KEYS` as plain JSON (stored in each run checkpoint), plus "files": the sha256 of every
  data, held-out and tokenizer file the run reads, so an edited file is seen even when its name did not change."""
  out = {}
  for key in RESUME_KEYS:
    node = c
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node = node.get(leaf, RESUME_DEFAULTS[key]) if key in RESUME_DEFAULTS else node[leaf]
    out[key] = node.to_dict() if hasattr(node, "to_dict") else node
  paths = [p for _, _, p in eval_files(c)]
  if c.data.source == "file":
    paths.append(c.data.path)
  if c.tokenizer.kind == "path":
    paths.append(c.tokenizer.path)
  out["files"] = {p: _file_sha256(os.path.abspath(p), *_stat(p)) for p in sorted(set(paths)) if os.path.isfile(p)}
  out["tfds"] = {f"{name}@{data_dir}": _tfds_sha256(name, data_dir) for name, data_dir in sorted(_tfds_datasets(c))}
  return json.loads(json.dumps(out, default=str))


def _tfds_datasets(c) -> set[tuple[str, str]]:
  """(dataset, data_dir) of every TFDS dataset the run reads: `data.source=tfds` and the `eval.path` items."""
  out = set()
  if c.data.source == "tfds":
    out.add((c.data.tfds_name, c.data.tfds_data_dir))
  for _, fmt, path in eval_files(c):
    if fmt == "tfds":
      ds, _, data_dir = parse_tfds_ref(path)
      out.add((ds, data_dir))
  return out


def _tfds_sha256(name: str, data_dir: str) -> str:
  """sha256 over the relative paths and contents of every file of TFDS dataset `name` in `data_dir` (all versions
  and splits, so a dataset rebuilt under the same name is seen); "remote" for a `scheme://` data_dir, which is not
  read (a rebuilt remote dataset is not seen)."""
  if "://" in data_dir:
    return "remote"
  root = os.path.join(data_dir, name)
  h = hashlib.sha256()
  for folder, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for f in sorted(files):
      path = os.path.join(folder, f)
      h.update(
          os.path.relpath(path, root).encode() + b"\0" + _file_sha256(os.path.abspath(path), *_stat(path)).encode()
      )
  return h.hexdigest()


def _stat(path: str) -> tuple[int, int]:
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
  """sha256 of a file's content; cached by (path, size, mtime) because every checkpoint stores it."""
  del size, mtime_ns
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def check_resume(c, stored: dict[str, Any] | None, workdir: str) -> None:
  """Raises ConfigError naming `config.workdir` and each differing field when the config differs from the one the
  checkpoint in `workdir` was written with (`stored`, its `resume_fingerprint`)."""
  if not stored:
    return
  stored = {**RESUME_DEFAULTS, **stored}
  for key, default in GROUP_DEFAULTS.items():
    group, field = key.split(".", 1)
    if isinstance(stored.get(group), dict):
      stored[group] = {field: default, **stored[group]}
  now = {k: v for k, v in resume_fingerprint(c).items() if k in stored or k not in UNRECORDED_KEYS}
  diff = [
      f
      for k in sorted(set(now) | set(stored))
      if now.get(k) != stored.get(k) and not (k in EQUIVALENT and EQUIVALENT[k](now.get(k), stored.get(k)))
      for f in _differing_fields(k, now.get(k), stored.get(k))
  ]
  if diff:
    raise ConfigError(
        f"config.workdir: {workdir} holds a checkpoint of a run with different {', '.join(diff)}; resuming would "
        "mix two experiments. Use a new --config.workdir (or delete the old one)"
    )
