"""The config of a command line: `--config=FILE[:ARG]` and its `--config.FIELD=VALUE` overrides, parsed and checked
(ml_collections' config flags), with one-line errors that name the flag and the fix. The training CLI, the
compile-only tool (`minpro_jax.aot`) and the study runner all load configs through `parse_config`.
"""

from __future__ import annotations

import os
import re
import sys

from absl import flags
from ml_collections import config_flags

from minpro_jax.config_lib import files
from minpro_jax.config_lib.defaults import base_config
from minpro_jax.errors import UserError

DEFAULT_CONFIG = "configs/default.py"  # found from the current directory or the repository root (`_find_config`)
DEFAULTS_FILE = "minpro_jax/config_lib/defaults.py"  # every field and its default


def parse_config(argv: list[str]):
  """The config of `--config=FILE[:ARG]` with the `--config.FIELD=VALUE` overrides of `argv` (locked).

  Raises:
    UserError: a missing config file, an unknown field, a value that does not parse, an unknown flag; the
      message names the flag.
  """
  fv = flags.FlagValues()
  found = [_find_config(a) if a.startswith("--config=") else a for a in argv]
  try:
    holder = config_flags.DEFINE_config_file(
        "config",
        _find_config(f"--config={DEFAULT_CONFIG}")[len("--config=") :],
        "Experiment config file.",
        flag_values=fv,
        lock_config=True,
        sys_argv=found,
    )
    fv(found)
    config = holder.value
    config.keys()  # the file loads lazily: make its errors happen here
  except (OSError, AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    raise UserError(_flag_message(argv, e)) from e
  _refuse_repeated_tuples(config, argv)
  return config


def _refuse_repeated_tuples(config, argv: list[str]) -> None:
  """ml_collections joins the values of a tuple field given twice (`--config.eval.ks=1,2 --config.eval.ks=1,8` is
  (1, 2, 1, 8)) where a scalar's last value wins. Raises UserError naming such a flag."""
  names = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.") and "=" in a]
  for name in sorted({n for n in names if names.count(n) > 1}):
    value = config
    for part in name.split("."):
      value = value.get(part) if hasattr(value, "get") else None
    if isinstance(value, tuple):
      raise UserError(
          f"--config.{name}: given {names.count(name)} times, so its values were joined into {value}; give a tuple "
          "field once, with every value (e.g. --config.eval.ks=1,8)"
      )


def _find_config(flag: str) -> str:
  """`--config=PATH[:ARG]` with PATH found by `config_lib.files.resolve` when it is not there as given: from the
  repository root, or in `configs/` for a path into the configs' old folder `minpro_jax/configs/` (said on
  stderr). Unchanged when it is found nowhere (the loader then names it)."""
  path, sep, arg = flag[len("--config=") :].partition(":")
  found = None if os.path.isfile(path) else files.resolve(path)
  if found is None:
    return flag
  if files.canonical(path) != path:
    print(f"note: --config={path}: the configs moved to configs/; reading {found}", file=sys.stderr)
  return f"--config={found}{sep}{arg}"


def _flag_message(argv: list[str], e: BaseException) -> str:
  text = str(e)
  if "Failed loading config file" in text or "Configuration is not available" in text:
    path = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--config=")), DEFAULT_CONFIG)
    return (
        f"--config={path}: cannot load the config file ({text.splitlines()[-1].strip()}); pass an existing .py file "
        f"(looked as given, from {os.getcwd()} and from the repository root; the experiment configs ship with the "
        "repository, not the installed package: clone it, or write a get_config() that calls "
        "minpro_jax.config_lib.defaults.base_config())"
    )
  if isinstance(e, AttributeError) and "no attribute 'get_config'" in text:  # e.g. a study grid (get_grid)
    path = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--config=")), DEFAULT_CONFIG)
    file = files.resolve(path.partition(":")[0]) or path.partition(":")[0]
    try:
      with open(file) as f:
        is_grid = "def get_grid" in f.read()
    except OSError:
      is_grid = False
    what = (
        f"it is a study grid: run .venv/bin/python -m minpro_jax.study --grid={path}"
        if is_grid
        else "pass a config file"
    )
    return f"--config={path}: the file has no get_config(); {what}"
  if m := re.match(r"Found (\S+) in argv before a value for --config was specified", text):
    return f"{m.group(1)}: comes before --config=FILE; put --config=FILE first (the overrides apply to that file)"
  if "Error whilst parsing config file" in text:  # get_config raised: its reason is the traceback's last line
    flag = next((a for a in reversed(argv) if a.startswith("--config=")), "--config")
    reason = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return f"{flag}: the config file's get_config refused its argument ({reason}); fix the part after ':'"
  if isinstance(e, (AttributeError, KeyError)):  # an override names a field the config does not have
    return _unknown_field_message(argv, e)
  return text.splitlines()[0] if text else type(e).__name__


def _unknown_field_message(argv: list[str], e: BaseException) -> str:
  """`config.FIELD: the config has no such field` for the override that names FIELD (the whole flag, e.g.
  `config.samplng.x` for a typo in `samplng`), with ml_collections' suggestion as `did you mean ...?`."""
  while isinstance(e, AttributeError) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]  # ml_collections wraps the KeyError of a nested field in an AttributeError
  raw = str(e.args[0]) if e.args else str(e)
  first, _, rest = raw.partition("\n")
  key = first.strip("\"'")
  pattern = rf"--config\.(.+\.)?{re.escape(key)}[.=]"
  flag = next((a.split("=", 1)[0] for a in argv if re.match(pattern, a)), key)
  hint = ""
  if m := re.search(r'Did you mean "([^"]+)" instead of', rest):
    parts = flag.lstrip("-").split(".")
    parts[parts.index(key)] = m.group(1)
    hint = f"; did you mean {'.'.join(parts)}?"
  elif elsewhere := _fields_named(flag.lstrip("-").split(".")[-1], flag.lstrip("-")):
    hint = f"; did you mean {' or '.join(elsewhere)}?"
  return f"{flag.lstrip('-')}: the config has no such field{hint}; see {DEFAULTS_FILE} for the fields"


def _fields_named(leaf: str, flag: str) -> list[str]:
  """The default config's fields (`config.a.b`) whose last name is `leaf`, other than `flag` (a field put in the
  wrong section: `config.learner.micro_batch_size` for `config.micro_batch_size`)."""

  def walk(d, prefix):
    for k, v in d.items():
      path = f"{prefix}.{k}"
      if hasattr(v, "items"):
        yield from walk(v, path)
      elif k == leaf and path != flag:
        yield path

  return sorted(walk(base_config(), "config"))
