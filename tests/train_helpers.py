"""Shared helpers for the trainer tests: a tiny config and CLI flags for it (fast on a 2-core CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zlib

from minpro_jax.config_lib import set_fields
from minpro_jax.launch_local import with_device_count

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
}


def tiny_overrides(tmp_path, **extra) -> dict:
  """Dotted-field overrides of configs/default.py for a run of a few seconds per step."""
  ov = {
      "workdir": str(tmp_path / "run"),
      "total_steps": 4,
      "prompts_per_step": 4,
      "group_size": 2,
      "num_updates_per_step": 2,
      "micro_batch_size": 2,
      "delay": 1,
      "tokenizer.vocab_size": 384,
      "data.size": 400,
      "data.max_prompt_tokens": 32,
      "sampling.max_new_tokens": 6,
      "sft.steps": 5,
      "sft.batch_size": 16,
      "sft.num_examples": 64,
      "sft.cache_dir": str(tmp_path / "cache"),
      "eval.every": 0,
      "eval.num_problems": 8,
      "eval.n": 2,
      "eval.ks": (1, 2),
      "checkpoint.every": 0,
      "log.tensorboard": False,
      "log.plots": False,
      "log.progress": False,
  }
  ov.update(extra)
  return ov


def load_default_config():
  spec = importlib.util.spec_from_file_location("minpro_default_config", DEFAULT_CONFIG)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def make_config(overrides: dict, model: dict | None = None):
  """configs/default.py with `overrides` ({"a.b": value}) and the tiny model applied."""
  c = set_fields(load_default_config(), overrides)
  c.model.overrides = dict(TINY_MODEL, **(model or {}))
  return c


def cli_args(overrides: dict, model: dict | None = None) -> list[str]:
  """`python -m minpro_jax.train` argv for the same config."""
  args = [sys.executable, "-m", "minpro_jax.train", f"--config={DEFAULT_CONFIG}"]
  for k, v in overrides.items():
    if isinstance(v, tuple):
      v = "(" + ",".join(str(x) for x in v) + ",)"
    args.append(f"--config.{k}={v}")
  for k, v in dict(TINY_MODEL, **(model or {})).items():
    args.append(f"--config.model.overrides.{k}={v}")
  return args


def cli_env() -> dict:
  env = dict(os.environ)
  # one CPU device, as a user would run it; the session's other XLA flags (tests/conftest.py) stay
  flags = with_device_count(env.pop("XLA_FLAGS", ""), None)
  if flags:
    env["XLA_FLAGS"] = flags
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


TIMING_PREFIXES = ("time/", "throughput/")  # metrics that differ between equal runs


def metrics_records(workdir: str, ignored=TIMING_PREFIXES) -> dict[int, dict]:
  """{step: the record of workdir/metrics.jsonl without the fields whose names start with `ignored`}."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(ignored)} for r in map(json.loads, f)}


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints under workdir/checkpoints, ascending ([] before the first)."""
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []


def kill_at_call(real, n: int, calls: list):
  """`real` wrapped to append to `calls` at every call and raise RuntimeError("killed") at call n (0: never): a
  study killed mid-run, for the resume tests (monkeypatch it over the study's `draw`)."""

  def f(*args):
    calls.append(1)
    if len(calls) == n:
      raise RuntimeError("killed")
    return real(*args)

  return f


def coin_grade(texts, golds, **kwargs):
  """Rewards 0/1 from a checksum of the text, in `grade_split`'s form (monkeypatch it over
  `minpro_jax.run.trainer.grade_split`): mixed rewards inside groups even for an untrained tiny model, so the advantages,
  the loss and the updates are not zero."""
  del golds, kwargs
  return [float(zlib.crc32(t.encode()) % 2) for t in texts], {"no_answer": 0, "timeout": 0}


def global_steps(trainer, params, loader_state, num_steps: int):
  """The trainer's global steps 0..num_steps-1 (sample, buffer, learn: `Trainer._run`'s loop without evaluation and
  checkpoints) from a copy of `params` (the updates donate the state) and `loader_state`.

  Returns:
    ([(each step's batch, its metrics)], the final learner state).
  """
  import jax
  import jax.numpy as jnp

  from minpro_jax.rl.rollout import RolloutBuffer

  trainer.loader.set_state(loader_state)
  state = trainer.learner.init_state(jax.tree.map(jnp.copy, params))
  buffer, out = RolloutBuffer(trainer.c.delay), []
  for step in range(num_steps):
    batch, metrics = trainer.sample_step(state, step)
    buffer.push(step, batch)
    released = buffer.pop(step)
    if released is not None:
      state, learn_metrics = trainer.learn_step(state, released)
      metrics.update(learn_metrics)
    out.append((batch, metrics))
  return out, state
