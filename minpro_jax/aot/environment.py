"""The process set-up of the compile-only tool's command lines (`python -m minpro_jax.aot`, with and without
`--budget`): the platform before JAX starts, one line at SIGTERM / SIGINT, and the run config of the `--config`
flags. Imports no JAX, so a command line calls `prepare_environment` before anything does."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

from minpro_jax.config_lib.parse import DEFAULT_CONFIG, parse_config

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prepare_environment(topology: str, quiet: bool = True) -> None:
  """Before JAX starts: N virtual CPU devices for cpu:N; libtpu importable (and shareable) for TPU slices, and with
  `quiet` (a command line's own process, not a test calling `main`) libtpu's load-time lines and signal handler off."""
  if topology.startswith("cpu:"):
    n = topology.split(":", 1)[1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and n.isdigit() and int(n) > 0:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    return
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip is claimed
  # Off a TPU VM libtpu cannot read the slice from the metadata server and prints lines about it at load; these
  # name a one-host slice (the topology compiled is --topology's, whatever they say). Its failure-signal handler
  # would print a native stack on SIGTERM / SIGINT: `exit_on_signal` says what is kept instead.
  if quiet:
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", re.sub(r"^v5e-", "v5litepod-", topology))
  if quiet and "install_signal_handlers" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --install_signal_handlers=false".strip()
  try:
    import libtpu  # noqa: F401
  except ImportError:
    for where in (os.environ.get("MINPRO_LIBTPU_DIR"), os.path.join(_REPO, ".venv", "libtpu")):
      if where and os.path.isdir(os.path.join(where, "libtpu")):
        sys.path.insert(0, where)
        break


def exit_on_signal(kept: str) -> None:
  """Ends the process at SIGTERM / SIGINT with one line, `error: stopped by signal N; <kept>`, even while the main
  thread compiles in native code (Python runs handlers only between bytecodes; a thread reads each signal from the
  wakeup fd). Nothing is lost by ending at once: `--out` is replaced atomically after each row (`_write`)."""

  first = threading.Lock()  # the main thread's handler and the watcher may both see one signal: one line

  def stop(signum, frame):
    del frame
    if not first.acquire(blocking=False):
      threading.Event().wait()  # the other caller is ending the process
    sys.stderr.write(f"error: stopped by signal {signum}; {kept}\n")
    sys.stderr.flush()
    os._exit(128 + signum)

  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, stop)

  def watch():
    while data := os.read(read_fd, 1):
      if data[0] in (signal.SIGTERM, signal.SIGINT):
        stop(data[0], None)

  threading.Thread(target=watch, name="signal-watch", daemon=True).start()


def run_config_of(config_args: list[str]):
  """(config file name, parsed run config) of the command line's `--config=FILE[:ARG]` and `--config.<field>=...`
  flags (the train command's default config when no file is named). Raises UserError on a bad field."""
  name = next((a.split("=", 1)[1] for a in reversed(config_args) if a.startswith("--config=")), DEFAULT_CONFIG)
  return name, parse_config(["aot", f"--config={name}", *[a for a in config_args if not a.startswith("--config=")]])
