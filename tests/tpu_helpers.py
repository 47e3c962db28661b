"""Compiling for TPU topologies from a test: libtpu lives outside the test process (`make setup` unpacks it to
.venv/libtpu), so TPU programs are lowered and compiled in a subprocess with it on PYTHONPATH."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def libtpu_dir() -> str | None:
  """The first of $MINPRO_LIBTPU_DIR, <repo>/.venv/libtpu, /tmp/libtpu that holds an unpacked `libtpu` package."""
  candidates = [os.environ.get("MINPRO_LIBTPU_DIR"), os.path.join(REPO, ".venv", "libtpu"), "/tmp/libtpu"]
  return next((d for d in candidates if d and os.path.isdir(os.path.join(d, "libtpu"))), None)


def run_with_libtpu(code: str, timeout: int = 300) -> list[dict[str, str]]:
  """Runs `code` in a Python subprocess with libtpu importable; returns its `RESULT k=v ...` lines as dicts.

  Skips the test (with the reason) when no libtpu is unpacked; fails with the subprocess's stderr when it fails.
  """
  where = libtpu_dir()
  if where is None:
    pytest.skip("no unpacked libtpu: set MINPRO_LIBTPU_DIR or unpack it to <repo>/.venv/libtpu (make setup does)")
  # no lockfile: xdist workers (and a benchmark) may compile for TPU at the same time
  env = {**os.environ, "PYTHONPATH": where, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  # no persistent compilation cache (tests/conftest.py): a compile-only TPU client writes entries it cannot load
  # back ("PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  # nor XLA:CPU's codegen flags: the TPU compiler would read them too
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "backend_optimization_level" not in f)
  proc = subprocess.run(
      [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = []
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      print(line)
      results.append(dict(item.split("=", 1) for item in line.split()[1:]))
  return results
