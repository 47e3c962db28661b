"""keep_freed_host_memory: freed large blocks are reused without new page faults (subprocesses, so the test
process keeps its own malloc settings)."""

import json
import os
import platform
import subprocess
import sys

import pytest

from minpro_jax.runtime import host_memory

_CHILD = r"""
import ctypes, ctypes.util, json, sys
from minpro_jax.runtime.host_memory import keep_freed_host_memory, minor_page_faults
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 64 * 2**20  # above glibc's largest mmap threshold (32 MiB), like XLA's step temporaries
faults = []
for _ in range(3):
  f0 = minor_page_faults()
  ptr = libc.malloc(size)  # plain malloc, as XLA's allocator (numpy would madvise huge pages)
  ctypes.memset(ptr, 1, size)  # touch every page
  libc.free(ptr)
  faults.append(minor_page_faults() - f0)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _run(mode, env=None):
  out = subprocess.run(
      [sys.executable, "-c", _CHILD, mode],
      capture_output=True,
      text=True,
      check=True,
      env={**os.environ, **(env or {})},
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc mallopt")
def test_freed_blocks_are_reused_without_page_faults():
  pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
  default = _run("default")
  kept = _run("keep")
  assert kept["applied"] is True and default["applied"] is False
  # default glibc: every 64 MiB allocation is a fresh mmap, so each one faults in (almost) every page
  assert all(f > 0.9 * pages for f in default["faults"]), default
  # kept: the first allocation faults its pages in, the next ones reuse them
  assert kept["faults"][0] > 0.9 * pages and all(f < 0.01 * pages for f in kept["faults"][1:]), kept


def test_opt_out_env_var(monkeypatch):
  monkeypatch.setenv(host_memory.OPT_OUT_ENV, "0")
  assert host_memory.keep_freed_host_memory() is False
  assert host_memory.minor_page_faults() >= 0
