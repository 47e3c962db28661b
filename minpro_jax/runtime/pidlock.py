"""An exclusive lock on a file that names its holder: one trainer per run workdir, one runner per study workdir."""

from __future__ import annotations

import fcntl
import os


class HeldError(OSError):
  """Another process holds the lock; `holder` is the pid it wrote ("unknown" if none)."""

  def __init__(self, path: str, holder: str):
    super().__init__(f"{path} is held by pid {holder}")
    self.path, self.holder = path, holder


def acquire(path: str):
  """An exclusive, non-blocking `flock` on `path` (created if missing), held as long as the returned file stays
  open: the kernel releases it when the process exits, however it exits, so a killed process leaves no stale lock.
  The file then holds this process's pid. Only the same host sees the lock (`flock` is local).

  Raises:
    HeldError: another open file of `path` (another process, or this one) holds it.
  """
  f = open(path, "a+")
  try:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    f.seek(0)
    holder = f.read().strip() or "unknown"
    f.close()
    raise HeldError(path, holder) from None
  f.seek(0)
  f.truncate()
  f.write(str(os.getpid()))
  f.flush()
  return f
