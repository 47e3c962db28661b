"""One line when a process of a multi-process run dies where Python cannot speak (a native abort, a kill).

When the coordinator dies while another process is inside a CPU (Gloo) collective, Gloo aborts that process natively
(SIGABRT, a stack dump) before any Python handler runs, so `distributed.report_peer_loss` never writes its line. A
small watcher process started beside each JAX process (`start`; no JAX in it) waits for its parent to go: if the
parent is gone without having said it ends in order (`disarm`: at exit, in `report_peer_loss`, and before every
`os._exit` of the entry points, `exit_now`), the watcher writes the line the parent would have written, to the same
stderr: which process ended (the coordinator when its address no longer answers, else this one), the newest
checkpoint and the command that resumes (`update`: the parent keeps the line's tail current). docs/multihost.md.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile

# The watcher: argv = parent pid, line file, coordinator "host:port", process index, process count. It polls
# every 0.2 s; the file gone = the parent ended in order (silence).
_WATCHER = r"""
import os, socket, sys, time
parent, path, coordinator, me, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
while os.getppid() == parent:
  time.sleep(0.2)
  if not os.path.exists(path):
    sys.exit(0)
try:
  with open(path) as f:
    tail = f.read().strip()
  os.remove(path)
except OSError:
  sys.exit(0)
host, _, port = coordinator.rpartition(":")
try:
  socket.create_connection((host or "localhost", int(port)), timeout=1.0).close()
  coordinator_up = True
except (OSError, ValueError):
  coordinator_up = False
how = "a native abort or a kill, no Python exception"
if me != "0" and not coordinator_up:
  line = (f"error: process 0 (the coordinator) of the {n}-process run ended (its address {coordinator} no longer "
          f"answers; process {me} was then ended by {how}, as Gloo aborts a collective whose peer died); "
          f"process {me} stops too. {tail}")
else:
  line = f"error: process {me} of the {n}-process run ended ({how}). {tail}"
sys.stderr.write(line + "\n")
sys.stderr.flush()
"""

_path: str | None = None
_tail: str | None = None


def start(process_index: int, process_count: int, coordinator: str, tail: str) -> None:
  """Starts the watcher of this process (once; module docstring) with the line's first `tail`.

  Args:
    process_index, process_count: this process's index and the run's process count (for the line).
    coordinator: the coordinator's "host:port" (probed with a 1 s TCP connect once this process is gone).
    tail: what the line ends with (`update` changes it).

  Raises:
    OSError: the line's file (in the temp directory) or the watcher process cannot be created.
  Source: Gloo's abort of a collective whose peer died (issue 58; docs/multihost.md).
  """
  global _path
  if _path is not None:
    return
  fd, path = tempfile.mkstemp(prefix=f"minpro_abort_line_{process_index}_")
  os.close(fd)
  _path = path
  update(tail)
  args = [sys.executable, "-c", _WATCHER, str(os.getpid()), path, coordinator, str(process_index), str(process_count)]
  subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)  # not killed with the parent's group
  atexit.register(disarm)


def update(tail: str) -> None:
  """Sets what the watcher's line ends with (the newest checkpoint and how to resume); a no-op before `start` or
  after `disarm`. The file is replaced atomically (`os.replace`), so the watcher never reads half a line.

  Raises:
    OSError: the temp directory cannot be written.
  """
  global _tail
  if _path is None or tail == _tail:
    return
  tmp = _path + ".tmp"
  with open(tmp, "w") as f:
    f.write(tail)
  os.replace(tmp, _path)
  _tail = tail


def disarm() -> None:
  """This process ends in order (it speaks for itself): the watcher exits without a word."""
  global _path
  if _path is not None:
    try:
      os.remove(_path)
    except OSError:
      pass
    _path = None


def exit_now(status: int) -> None:
  """`os._exit(status)` after `disarm`: the exit of a signal handler or of a lost peer, which has written its line."""
  disarm()
  os._exit(status)
