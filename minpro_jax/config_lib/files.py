"""Finding and loading the experiment config and study grid files, which live in the repository's `configs/`
(docs/configs.md), not in the installed package.

Until issue 39 they lived in `minpro_jax/configs/`. A path written then (a committed study.json's base config and
grid, an old command line) still works: `canonical` rewrites it to the new folder and `resolve` finds the file
under its new name.
"""

from __future__ import annotations

import os
import sys
import types

OLD_DIR, NEW_DIR = "minpro_jax/configs/", "configs/"
# the checkout that holds this package (its `configs/` is there when the package runs from a clone)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODULES: dict[str, types.ModuleType] = {}


def canonical(spec: str) -> str:
  """`spec` (a config or grid path, with or without `:arg`) with the old folder `minpro_jax/configs/` written as
  `configs/`; any other spec unchanged. Two specs name the same file and argument when their `canonical`s are
  equal (the study runner compares a stored study.json's paths this way)."""
  if spec.startswith(OLD_DIR):
    return NEW_DIR + spec[len(OLD_DIR) :]
  if spec.startswith("./" + OLD_DIR):
    return "./" + NEW_DIR + spec[len(OLD_DIR) + 2 :]
  return spec.replace("/" + OLD_DIR, "/" + NEW_DIR, 1)


def resolve(path: str) -> str | None:
  """The absolute path of the file `path` names (no `:arg`): as given (absolute, or from the current directory),
  else under its `canonical` name, else either of them from the repository root `REPO`; None when none exists."""
  for p in dict.fromkeys((path, canonical(path))):
    for q in (p,) if os.path.isabs(p) else (p, os.path.join(REPO, p)):
      if os.path.isfile(q):
        return os.path.abspath(q)
  return None


def load_module(path: str, relative_to: str | None = None) -> types.ModuleType:
  """The Python module of a config or grid file, executed once per process and file.

  Config files are no package, so they share settings with this instead of `import`, e.g. a study grid building
  on another: `short = load_module("minpro_staleness.py", relative_to=__file__)`. A second call for the same file
  returns the same module object (a test's monkeypatch of it is what the other files see).

  Args:
    path: the file; relative to the directory of `relative_to` when that is given, else found by `resolve`.
    relative_to: a file (a caller's `__file__`) whose directory `path` is relative to.

  Raises:
    FileNotFoundError: naming `path` and where it was looked for. Errors of the file's own code propagate.
  """
  found = resolve(os.path.join(os.path.dirname(os.path.abspath(relative_to)), path) if relative_to else path)
  if found is None:
    raise FileNotFoundError(f"config file {path!r}: not found (from {os.getcwd()} or {REPO})")
  found = os.path.realpath(found)
  if found not in _MODULES:
    import importlib.util

    name = "minpro_config_file_" + "".join(ch if ch.isalnum() else "_" for ch in found)
    spec = importlib.util.spec_from_file_location(name, found)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
      spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
    _MODULES[found] = module
  return _MODULES[found]
