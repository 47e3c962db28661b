"""Runs one multi-process JAX job on this machine: the same command in N processes, as on N hosts of a pod.

    python -m minpro_jax.launch_local --num_processes=2 --devices_per_process=2 -- \\
        --config=configs/default.py --config.mesh.shape=data=2,fsdp=2

starts `python -m minpro_jax.train <the arguments after -->` N times, each with JAX_COORDINATOR_ADDRESS (a free
localhost port), JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_PLATFORMS=cpu and XLA_FLAGS giving it
`--devices_per_process` CPU devices: the launch contract of a pod host (`minpro_jax.runtime.distributed`), with
gloo carrying the collectives. Every output line is prefixed with its process index. SIGTERM and SIGINT are
forwarded to every process (the trainer then checkpoints and exits; processes still running `--grace_s` later,
or at a second signal, are killed); when one process fails, the others are ended (SIGTERM, then SIGKILL after
`--grace_s`) and the launcher exits with the failed process's status
(128 + signal for a signal). The processes die with the launcher (Linux), so a killed launcher leaves none behind.

Exit status: 0 when every process exits 0, else the first failure's; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (the coordinator binds it)."""
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def with_device_count(xla_flags: str, devices: int | None) -> str:
  """`xla_flags` (an `XLA_FLAGS` value) with its CPU device count (`--xla_force_host_platform_device_count`) set to
  `devices`, or removed when `devices` is None; its other flags kept in order."""
  flags = _DEVICE_FLAG.sub("", xla_flags).split()
  return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices is not None else []))


def process_env(index: int, num_processes: int, devices_per_process: int, port: int, base=None) -> dict[str, str]:
  """The environment of process `index`: `base` (default os.environ) plus the launch contract's variables."""
  env = dict(os.environ if base is None else base)
  env.update(
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES=str(num_processes),
      JAX_PROCESS_ID=str(index),
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=with_device_count(env.get("XLA_FLAGS", ""), devices_per_process),
  )
  return env


def _die_with_parent() -> None:  # runs in the child before exec
  with contextlib.suppress(Exception):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    argv: Sequence[str], num_processes: int, devices_per_process: int, *, port: int | None = None, env=None, cwd=None
) -> list[subprocess.Popen]:
  """Starts `argv` (a full command) in `num_processes` processes; their output is piped (see `stream`).

  Raises:
    ValueError: num_processes or devices_per_process < 1, or an empty command.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(f"num_processes={num_processes} and devices_per_process={devices_per_process} must be >= 1")
  if not argv:
    raise ValueError("no command to run")
  port = free_port() if port is None else port
  return [
      subprocess.Popen(
          list(argv),
          env=process_env(i, num_processes, devices_per_process, port, env),
          cwd=cwd,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          start_new_session=True,  # a Ctrl-C reaches them once, forwarded by the launcher
          preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
      )
      for i in range(num_processes)
  ]


def stream(procs: Sequence[subprocess.Popen], out=None) -> list[threading.Thread]:
  """Copies each process's output lines to `out` (default stdout), prefixed with "[i] "."""
  out = sys.stdout if out is None else out
  lock = threading.Lock()

  def pump(i: int, p: subprocess.Popen) -> None:
    for raw in iter(p.stdout.readline, b""):
      with lock:
        out.write(f"[{i}] " + raw.decode(errors="replace"))
        out.flush()

  threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for t in threads:
    t.start()
  return threads


def _status(code: int) -> int:
  return 128 - code if code < 0 else code


def wait_all(
    procs: Sequence[subprocess.Popen], grace_s: float = 120.0, poll_s: float = 0.2, kill_at: list[float] | None = None
) -> int:
  """Waits for every process; when one fails, ends the others. Returns the exit status (see the module doc).

  `kill_at`, when it holds a time (set by the signal forwarder), SIGKILLs every process still running after it: a
  process blocked in a collective never runs its SIGTERM handler.
  """
  failed: int | None = None
  while True:
    if kill_at and time.time() > kill_at[0]:
      print(f"launch_local: processes still running {grace_s:.0f} s after the signal; killing them", file=sys.stderr)
      for p in procs:
        if p.poll() is None:
          p.kill()
      kill_at.clear()
    codes = [p.poll() for p in procs]
    bad = [c for c in codes if c not in (None, 0)]
    if bad and failed is None:
      failed = _status(bad[0])
      i = codes.index(bad[0])
      print(f"launch_local: process {i} exited with status {failed}; ending the others", file=sys.stderr)
      terminate(procs, grace_s)
    if all(c is not None for c in codes):
      return failed if failed is not None else 0
    time.sleep(poll_s)


def terminate(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to every running process, SIGKILL to those still running after `grace_s` seconds."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.time() + grace_s
  for p in procs:
    with contextlib.suppress(subprocess.TimeoutExpired):
      p.wait(timeout=max(0.0, deadline - time.time()))
  for p in procs:
    if p.poll() is None:
      p.kill()


def main(argv: Sequence[str] | None = None) -> int:
  """The CLI of the module docstring; returns the exit status (argparse exits 2 on bad arguments)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
  ap = argparse.ArgumentParser(prog="python -m minpro_jax.launch_local", description=__doc__.split("\n\n")[0])
  ap.add_argument("--num_processes", type=int, default=2)
  ap.add_argument("--devices_per_process", type=int, default=2)
  ap.add_argument("--module", default="minpro_jax.train", help="the python module each process runs (-m)")
  ap.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
  ap.add_argument(
      "--grace_s", type=float, default=120.0, help="seconds from SIGTERM to SIGKILL (a step and a checkpoint)"
  )
  args = ap.parse_args(ours)
  if args.num_processes < 1 or args.devices_per_process < 1:
    ap.error(f"--num_processes={args.num_processes} and --devices_per_process={args.devices_per_process} must be >= 1")
  if not 0 <= args.port <= 65535:
    ap.error(f"--port={args.port}: must be a TCP port in [1, 65535], or 0 for a free one")
  if not 0 <= args.grace_s < float("inf"):  # NaN fails too
    ap.error(f"--grace_s={args.grace_s}: must be a finite number of seconds >= 0 (SIGTERM to SIGKILL)")
  procs = spawn(
      [sys.executable, "-m", args.module, *rest], args.num_processes, args.devices_per_process, port=args.port or None
  )

  kill_at: list[float] = []

  def forward(signum, frame):  # the first signal is forwarded; a second one, or grace_s later, kills
    del frame
    if kill_at:
      kill_at[:] = [0.0]
      return
    kill_at.append(time.time() + args.grace_s)
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
  threads = stream(procs)
  code = wait_all(procs, args.grace_s, kill_at=kill_at)
  for t in threads:
    t.join(timeout=5)
  return code


if __name__ == "__main__":
  sys.exit(main())
