"""A study grid's runs as commands: each run's `--config.FIELD` overrides and `python -m minpro_jax.train` command,
and the configs those commands give, checked before anything runs (`plan`): the grid's fields against the base
config, each value read back from its command line, and (in a child process, so the runner never imports JAX) the
trainer's own config checks.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any

from minpro_jax.config_lib.parse import parse_config
from minpro_jax.errors import UserError
from minpro_jax.study.grid import (
    REPO,
    VARIANT,
    Grid,
    GridError,
    Run,
    expand,
    resolve_path,
    split_spec,
    tuplify,
    variant_overrides,
)


# ------------------------------------------------------------------------------------------------ commands
def format_cli_value(v: Any) -> str:
  """A value as `--config.FIELD=` takes it (ml_collections): tuples as "(a,b,)", the rest as `str`."""
  if isinstance(v, (tuple, list)):
    return "(" + "".join(f"{format_cli_value(x)}," for x in v) + ")"
  return str(v)


def run_overrides(grid: Grid, run: Run, workdir: str) -> dict[str, Any]:
  """Every `--config.FIELD` of `run`: fixed, then the variant's, the cell's, the derived fields, the seed and the
  workdir (the cell's "variant" is no config field: its overrides stand for it)."""
  cell = dict(run.cell)
  variant = variant_overrides(grid, cell)
  if grid.variants:
    cell.pop(VARIANT, None)
  return {**dict(grid.fixed), **variant, **cell, **dict(run.extra), "seed": run.seed, "workdir": workdir}


def train_argv(grid: Grid, run: Run, workdir: str, python: str = sys.executable) -> list[str]:
  """The command of `run`: `python -m minpro_jax.train --config=<base> --config.FIELD=VALUE ...`.

  `log.progress=False` is added unless the grid sets it (a progress bar in a log file is noise).
  """
  path, arg = split_spec(grid.base)
  base = (resolve_path(path) or path) + (f":{arg}" if arg is not None else "")
  ov = run_overrides(grid, run, workdir)
  ov.setdefault("log.progress", False)
  return [
      python,
      "-m",
      "minpro_jax.train",
      f"--config={base}",
      *(f"--config.{k}={format_cli_value(v)}" for k, v in ov.items()),
  ]


def parse_run_config(argv: list[str]):
  """The locked config the trainer will build from `argv` (a `train_argv`), parsed by `config_lib.parse.parse_config`.

  Raises:
    UserError: from `minpro_jax.config_lib.parse.parse_config` (an unknown field, a value that does not parse).
  """
  return parse_config([argv[0], *argv[3:]])  # without "-m minpro_jax.train"


def _get(config, field: str) -> Any:
  node = config
  for part in field.split("."):
    node = node[part]
  return node


def check_fields(grid: Grid, config) -> None:
  """Checks every field the grid sets against the base config `config` (an ml_collections ConfigDict): it exists
  and takes the value's type (ints are accepted for float fields, lists for tuple fields).

  Raises:
    GridError: naming the grid field (`grid.axes`, `grid.fixed`, `grid.cells[i]`), the config field and the fix.
  """
  import copy

  probe = copy.deepcopy(config)
  probe.lock()
  sources = [
      ("grid.fixed", list(grid.fixed.items())),
      ("grid.axes", [(f, v) for f, vs in grid.axes.items() for v in vs]),
  ]
  sources += [(f"grid.variants[{n!r}]", list(ov.items())) for n, ov in grid.variants.items()]
  skip = VARIANT if grid.variants else None
  sources += [(f"grid.cells[{i}]", [kv for kv in cell.items() if kv[0] != skip]) for i, cell in enumerate(grid.cells)]
  for where, items in sources:
    for field, value in items:
      *parents, leaf = field.split(".")
      node = probe
      try:
        for i, p in enumerate(parents):
          node = node[p]
          if not hasattr(node, "keys"):
            raise KeyError(".".join(parents[: i + 1]))
        keys = list(node.keys())
        if leaf not in keys:
          raise KeyError(leaf)
      except (KeyError, AttributeError):
        near = difflib.get_close_matches(field, _all_fields(config), n=1)
        hint = f"did you mean {near[0]}?" if near else f"see {split_spec(grid.base)[0]} for the fields"
        raise GridError(f"{where}: {field}: the base config {grid.base} has no such field; {hint}") from None
      if hasattr(node[leaf], "keys"):
        raise GridError(f"{where}: {field} is a group of fields; set its fields ({field}.<name>) instead")
      try:
        node[leaf] = value
      except TypeError:
        want = node.get_type(leaf).__name__ if hasattr(node, "get_type") else type(node[leaf]).__name__
        raise GridError(
            f"{where}: {field}={value!r} is of type {type(value).__name__}, the config field takes type {want}; "
            f"write the value as a {want}"
        ) from None


def _all_fields(config, prefix: str = "") -> list[str]:
  out = []
  for k in config.keys():
    v = config[k]
    path = f"{prefix}{k}"
    out += _all_fields(v, path + ".") if hasattr(v, "keys") else [path]
  return out


def resolved_base(grid: Grid) -> dict[str, Any]:
  """The base config of `grid` as the trainer resolves it today (every field, defaults included), as a dict.

  Raises:
    GridError: the base config file is missing or does not load.
  """
  path, _ = split_spec(grid.base)
  if resolve_path(path) is None:
    raise GridError(f"grid.base: no such config file {path!r} (from {os.getcwd()} or {REPO}); fix the path")
  try:
    return parse_run_config(
        [sys.executable, "-m", "minpro_jax.train", f"--config={resolve_path(path)}{grid.base[len(path):]}"]
    ).to_dict()
  except UserError as e:
    raise GridError(f"grid.base: {e}") from e


def plan(
    grid: Grid, study_dir: str, python: str = sys.executable, validate: bool = True
) -> list[tuple[Run, list[str], Any]]:
  """Every run of `grid` with its command and the config that command gives, checked before anything runs.

  Args:
    grid: the study's grid.
    study_dir: the study workdir; run r trains in `study_dir/r.name`.
    python: the interpreter of the commands.
    validate: also check every run's config with the trainer's `run_config.validate_config` (in a child process:
      `validate_in_subprocess`).

  Returns:
    [(run, argv, config)] in run order.

  Raises:
    GridError: a grid field the base config lacks or of the wrong type (`check_fields`); a value that does not
      survive the command line; a run whose config the trainer would refuse (the trainer's message, prefixed by
      the run's name).
  """
  path, _ = split_spec(grid.base)
  if resolve_path(path) is None:
    raise GridError(f"grid.base: no such config file {path!r} (from {os.getcwd()} or {REPO}); fix the path")
  runs = expand(grid)
  base_argv = [python, "-m", "minpro_jax.train", f"--config={resolve_path(path)}{grid.base[len(path):]}"]
  try:
    base = parse_run_config(base_argv)
  except UserError as e:
    raise GridError(f"grid.base: {e}") from e
  check_fields(grid, base)
  out = []
  for run in runs:
    workdir = os.path.join(study_dir, run.name)
    argv = train_argv(grid, run, workdir, python)
    try:
      config = parse_run_config(argv)
    except UserError as e:
      raise GridError(f"run {run.name}: {e}") from e
    for field, value in run_overrides(grid, run, workdir).items():
      got = _get(config, field)
      if tuplify(got) != tuplify(value) and not (isinstance(value, (int, float)) and got == value):
        raise GridError(
            f"run {run.name}: {field}={value!r} reads back from the command line as {got!r}; use a value "
            "that --config.FIELD=VALUE keeps"
        )
    out.append((run, argv, config))
  if validate:
    errors = validate_in_subprocess([(run.name, argv) for run, argv, _ in out], python)
    for run, _, _ in out:
      if errors.get(run.name):
        raise GridError(f"run {run.name}: {errors[run.name]}")
  return out


def validate_in_subprocess(named_argvs: Sequence[tuple[str, list[str]]], python: str = sys.executable) -> dict:
  """{run name: the trainer's config error or None}: `run_config.validate_config` of each command's config, in
  one child process (`python -m minpro_jax.study.commands`), so that the runner itself never imports JAX (it forks
  the training processes, and a fork of a process with JAX's threads can deadlock).

  Raises:
    GridError: the child process failed (its last output line).
  """
  import json
  import subprocess

  payload = json.dumps([[n, list(a)] for n, a in named_argvs])
  r = subprocess.run(
      [python, "-m", "minpro_jax.study.commands"], input=payload, capture_output=True, text=True, env=_child_env()
  )
  if r.returncode != 0:
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise GridError(f"grid: validating the runs' configs failed ({tail})")
  return json.loads(r.stdout.strip().splitlines()[-1])


def _child_env() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _validate_main() -> None:
  """The child of `validate_in_subprocess`: reads [[name, argv], ...] (JSON) on stdin, prints {name: error}."""
  import json

  # JAX only in this child process: the study runner itself never imports it (it forks trainers)
  from minpro_jax.run import run_config

  out = {}
  for name, argv in json.loads(sys.stdin.read()):
    try:
      run_config.validate_config(parse_run_config(argv))
      out[name] = None
    except UserError as e:
      out[name] = str(e)
  print(json.dumps(out))


if __name__ == "__main__":
  _validate_main()
