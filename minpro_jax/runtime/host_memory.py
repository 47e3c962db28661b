"""Keep freed host memory mapped, so XLA:CPU steps stop paying a page fault per 4 KiB of their temporaries.

XLA:CPU allocates each execution's temporaries with `malloc` and frees them when the step ends. glibc serves
large blocks (above its dynamic mmap threshold, at most 32 MiB on 64-bit) with a fresh `mmap` and unmaps them on
`free` (and trims its heaps), so every step page-faults on fresh pages again. With `keep_freed_host_memory()`
the freed blocks stay mapped and are reused, so the faults stop after the first step. Source: glibc
`mallopt(3)` (M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD).

The cost: the process keeps its peak host memory instead of returning freed blocks to the OS, which is what a
training or benchmark process wants anyway. Accelerator backends allocate their buffers on the device, so this
only matters for host (CPU) computation; calling it there is harmless.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

OPT_OUT_ENV = "MINPRO_KEEP_HOST_MEMORY"


def keep_freed_host_memory() -> bool:
  """Configure glibc malloc to reuse freed blocks instead of unmapping them.

  Sets one malloc arena (M_ARENA_MAX=1), no `mmap` for large blocks (M_MMAP_MAX=0) and no trimming
  (M_TRIM_THRESHOLD=SIZE_MAX), the `mallopt` equivalent of `MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
  MALLOC_TRIM_THRESHOLD_=<huge>`. Call it at the start of a process, before its first JAX computation: the
  arena limit only covers threads that have not allocated yet.

  Set the environment variable `MINPRO_KEEP_HOST_MEMORY=0` to skip it (e.g. to compare).

  Returns:
    True if applied; False on a non-glibc platform (macOS, musl), when opted out, or if `mallopt` refused.
    Never raises.
  """
  if os.environ.get(OPT_OUT_ENV, "1") == "0" or platform.system() != "Linux":
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # glibc stores the trim threshold as size_t, so -1 means "never trim"
  return all(
      mallopt(param, value) == 1 for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  )


def minor_page_faults() -> int:
  """Minor page faults of this process so far (`getrusage`); -1 where unavailable."""
  try:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  except (ImportError, OSError):
    return -1


def host_memory_bytes() -> int | None:
  """This machine's physical memory in bytes (`sysconf` pages x page size), or None where it cannot be read."""
  try:
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return None


def run_memory_bytes(devices) -> tuple[int | None, str]:
  """(bytes, what they are) of the memory a run on `devices` has for its buffers: on CPU the machine's memory
  (every CPU device shares it), on an accelerator the sum of the devices' `bytes_limit` (a sharded buffer spreads
  over them); None where the backend does not say."""
  devices = list(devices)
  if not devices or all(d.platform == "cpu" for d in devices):
    return host_memory_bytes(), "this machine's memory"
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if any(not isinstance(x, int) for x in limits):
    return None, ""
  return sum(limits), f"the memory of {len(devices)} {devices[0].device_kind} device(s)"
