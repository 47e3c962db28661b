"""Where a study's folder is: the committed studies of record live in `results/<study>`, apart from `runs/`, where
users' own runs and studies land (the trainer's default workdir root; not committed).

Until issue 39 the committed studies lived under `runs/`. A path of either root still finds the study: `resolve`
reads `runs/<study>` as `results/<study>` once the study has moved (and `results/<study>` as `runs/<study>` while it
has not), saying so on stderr. The study tools take their default folder from `committed` and every folder they are
given through `resolve`; the docs name `results/<study>`.
"""

from __future__ import annotations

import os
import sys

RESULTS_DIR = "results"  # committed studies of record (docs/study.md, docs/mechanism.md, docs/mipu.md)
RUNS_DIR = "runs"  # users' runs and studies, and the committed studies until issue 39


def committed(study: str) -> str:
  """The committed folder of `study` (e.g. "fidelity_toy"), relative to the repository root: `results/<study>`."""
  return os.path.join(RESULTS_DIR, study)


def other_root(path: str) -> str | None:
  """`path` (`runs[/X...]` or `results[/X...]`, relative, optionally `./`-prefixed) under the other root; None for a
  path under neither (absolute paths included: they name a place, not a study of record)."""
  parts = os.path.normpath(path).split(os.sep)
  if os.path.isabs(path) or parts[0] not in (RESULTS_DIR, RUNS_DIR):
    return None
  return os.path.join(RUNS_DIR if parts[0] == RESULTS_DIR else RESULTS_DIR, *parts[1:])


def resolve(path: str, flag: str = "--workdir") -> str:
  """The study folder `path` names: `path` itself when it exists (or is under neither root); else the same study
  under the other root when that exists (a note on stderr names `flag`, both paths and the move); else `path` (a new
  study starts there)."""
  if os.path.exists(path):
    return path
  other = other_root(path)
  if other is None or not os.path.exists(other):
    return path
  if os.path.normpath(path).startswith(RUNS_DIR + os.sep):
    why = f"the committed studies moved to {RESULTS_DIR}/"
  else:
    why = f"this checkout still keeps the study under {RUNS_DIR}/ (git mv {other} {path})"
  print(f"note: {flag}={path}: {why}; using {other}", file=sys.stderr)
  return other


def committed_root(repo: str) -> str:
  """The folder of checkout `repo` that holds its committed studies: `repo/results`, or `repo/runs` in a checkout
  from before they moved."""
  new = os.path.join(repo, RESULTS_DIR)
  return new if os.path.isdir(new) else os.path.join(repo, RUNS_DIR)
