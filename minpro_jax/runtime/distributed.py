"""Multi-process start-up: `jax.distributed.initialize()` only when the run spans several processes.

`minpro_jax.train` calls :func:`maybe_initialize_distributed` first thing in `main()`, before any JAX call that
could start the XLA backend (`jax.distributed.initialize` must come first, see its docstring).

TPU VM pods (v4-16, v5p-32, v6e-16, ...): every worker is a host with its own process. Run the *same* command on
every worker at once (`gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "..."`, see
`launch/tpu_vm.sh`). JAX then finds the coordinator, the process count and this worker's id from the TPU
metadata server, so no addresses are passed. The metadata server is not visible as environment variables, so on a
pod set ``MINPRO_DISTRIBUTED=1`` (the launcher does). Starting the command on only one worker hangs: initialize
waits for all workers (jax-ml/jax#22436). A single-host TPU VM (v4-8, v5e-8, ...) needs nothing: one process sees
all its chips.

GPU: one node with several GPUs is one process (`launch/gpu.sh`); nothing to initialize. For several nodes, start
one process per node (or per GPU) with either
  * SLURM (`srun`): JAX reads SLURM_JOB_ID / SLURM_NTASKS / SLURM_PROCID / SLURM_STEP_NODELIST itself;
  * Open MPI (`mpirun`): JAX reads OMPI_MCA_orte_hnp_uri / OMPI_COMM_WORLD_*;
  * explicit variables on every node: JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i
    (optionally JAX_LOCAL_DEVICE_IDS=0,1,... for one process per GPU).
Whatever the launcher, `jax.devices()` then lists every device of every process and `--config.mesh.shape` must
multiply to that global count.

CPU (tests, this machine): several processes on one host, each with its own CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N) and the explicit variables above; gloo carries the
collectives (selected here). `python -m minpro_jax.launch_local` starts such a job.

A process that dies ends the others within seconds: the coordination service runs in recoverable mode (no native
abort), counts a process dead after ``MINPRO_HEARTBEAT_TIMEOUT_S`` seconds without a heartbeat (default 10), and a
daemon thread in every process (`_watch_peers`) polls the live processes every 0.5 s and ends this one with one
line (`report_peer_loss`) naming the dead process, the newest checkpoint and the command that resumes.

Control: ``MINPRO_DISTRIBUTED=1`` forces initialize (auto-detection by JAX, e.g. the TPU metadata server),
``MINPRO_DISTRIBUTED=0`` forbids it, unset = detect from the variables above.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Callable, Mapping

import jax

from minpro_jax.errors import LaunchEnvironmentError
from minpro_jax.runtime import abort_line

logger = logging.getLogger(__name__)

ENV_FLAG = "MINPRO_DISTRIBUTED"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _count(env: Mapping[str, str], key: str) -> int:
  """Integer value of env[key] (>= 0); 0 when unset or empty. Raises LaunchEnvironmentError naming the variable if
  it is not a non-negative integer."""
  raw = env.get(key, "").strip()
  if not raw:
    return 0
  try:
    value = int(raw)
  except ValueError:
    value = -1
  if value < 0:
    raise LaunchEnvironmentError(
        f"environment variable {key}={raw!r} must be a non-negative integer (e.g. {key}=2); fix it in the launch "
        "command, or unset it"
    )
  return value


def _flag(env: Mapping[str, str]) -> bool | None:
  raw = env.get(ENV_FLAG, "").strip().lower()
  if not raw:
    return None
  if raw in _TRUE:
    return True
  if raw in _FALSE:
    return False
  raise LaunchEnvironmentError(
      f"environment variable {ENV_FLAG}={raw!r}: use 1 (force multi-process), 0 (never) or unset it (detect)"
  )


def multiprocess_reason(env: Mapping[str, str] | None = None) -> str | None:
  """Why this looks like one process of a multi-process job, or None for a single-process run.

  Signals (any one): JAX_COORDINATOR_ADDRESS; MEGASCALE_COORDINATOR_ADDRESS (TPU multislice);
  TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES listing more than one host (GKE TPU); SLURM_NTASKS > 1 inside a
  SLURM job; OMPI_COMM_WORLD_SIZE > 1 (Open MPI). ``MINPRO_DISTRIBUTED`` is not read here.

  Args:
    env: mapping to read (default `os.environ`).

  Returns:
    A short reason naming the variable, e.g. "SLURM_NTASKS=4", or None.

  Raises:
    LaunchEnvironmentError: a count variable (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE) is not an integer.
  """
  env = os.environ if env is None else env
  for key in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS"):
    if env.get(key, "").strip():
      return f"{key}={env[key].strip()}"
  for key in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
    hosts = [h for h in env.get(key, "").split(",") if h.strip()]
    if len(hosts) > 1:
      return f"{key} lists {len(hosts)} hosts"
  if env.get("SLURM_JOB_ID") and _count(env, "SLURM_NTASKS") > 1:
    return f"SLURM_NTASKS={_count(env, 'SLURM_NTASKS')}"
  if _count(env, "OMPI_COMM_WORLD_SIZE") > 1:
    return f"OMPI_COMM_WORLD_SIZE={_count(env, 'OMPI_COMM_WORLD_SIZE')}"
  return None


def maybe_initialize_distributed(
    enable: bool | None = None,
    *,
    env: Mapping[str, str] | None = None,
    initialize_fn: Callable[..., None] | None = None,
) -> bool:
  """Calls `jax.distributed.initialize()` when running multi-process; a no-op on a single host.

  Must run before anything starts the XLA backend (jax.devices(), any computation). Idempotent: returns True
  without a second call when the distributed client is already up. Logs process_index / process_count and the
  local / global device counts either way.

  Args:
    enable: True forces initialize (JAX auto-detects coordinator, process count and id: TPU metadata, SLURM,
      Open MPI, GKE); False never initializes; None (default) reads ``MINPRO_DISTRIBUTED`` and, if that is unset,
      :func:`multiprocess_reason`.
    env: environment mapping to read (default `os.environ`); for tests.
    initialize_fn: replacement for `jax.distributed.initialize` (tests); called with keyword arguments
      num_processes / process_id taken from JAX_NUM_PROCESSES / JAX_PROCESS_ID when those are set (JAX reads
      JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS itself).

  Returns:
    True when this process is (now) part of a multi-process job, False for the single-process no-op.

  Raises:
    LaunchEnvironmentError (a UserError and a ValueError): MINPRO_DISTRIBUTED, JAX_NUM_PROCESSES, JAX_PROCESS_ID,
      SLURM_NTASKS or OMPI_COMM_WORLD_SIZE holds an unusable value (JAX_PROCESS_ID >= JAX_NUM_PROCESSES too).
    RuntimeError: from JAX, when the backend was already started before this call (call it earlier).

  Source: `jax.distributed.initialize` docs (multi-process JAX); MaxText/Levanter launch the same way.
  """
  env = os.environ if env is None else env
  initialize_fn = jax.distributed.initialize if initialize_fn is None else initialize_fn
  if jax.distributed.is_initialized():
    _log("already initialized")
    return True
  if enable is None:
    enable = _flag(env)
  reason = None
  if enable is None:
    reason = multiprocess_reason(env)
    enable = reason is not None
  elif enable:
    reason = f"{ENV_FLAG}=1" if _flag(env) else "enable=True"
  if not enable:
    _log("not initialized (single process)")
    return False
  kwargs = launch_arguments(env)
  logger.info(
      "multi-process run (%s): calling jax.distributed.initialize(%s)",
      reason,
      ", ".join(f"{k}={v}" for k, v in kwargs.items()),
  )
  use_gloo_on_cpu()
  if initialize_fn is jax.distributed.initialize:
    _recoverable()
    initialize_fn(**kwargs, heartbeat_timeout_seconds=heartbeat_timeout_s(env))
    atexit.register(_stop_watching)
    _watch_peers()
    _start_abort_line()
  else:
    initialize_fn(**kwargs)
  _log("initialized")
  return True


def launch_arguments(env: Mapping[str, str]) -> dict[str, int]:
  """`num_processes` / `process_id` of JAX_NUM_PROCESSES / JAX_PROCESS_ID (those set).

  Raises:
    LaunchEnvironmentError: a value that is not an integer, JAX_NUM_PROCESSES < 1, or JAX_PROCESS_ID outside
      [0, JAX_NUM_PROCESSES).
  """
  kwargs = {}
  if env.get("JAX_NUM_PROCESSES", "").strip():
    kwargs["num_processes"] = _count(env, "JAX_NUM_PROCESSES")
    if kwargs["num_processes"] < 1:
      raise LaunchEnvironmentError(
          "environment variable JAX_NUM_PROCESSES=0 must be >= 1 (the number of processes of the run), or unset"
      )
  if env.get("JAX_PROCESS_ID", "").strip():
    kwargs["process_id"] = _count(env, "JAX_PROCESS_ID")
    n = kwargs.get("num_processes")
    if n is not None and kwargs["process_id"] >= n:
      raise LaunchEnvironmentError(
          f"environment variable JAX_PROCESS_ID={kwargs['process_id']} must lie in [0, JAX_NUM_PROCESSES={n}): "
          f"give the processes the distinct ids 0 .. {n - 1}"
      )
  return kwargs


def use_gloo_on_cpu() -> None:
  """Selects gloo for the collectives of JAX's CPU backend (a multi-process CPU run has none without it).

  It only affects the CPU client, so it is harmless on TPU and GPU; a value set in the environment variable
  JAX_CPU_COLLECTIVES_IMPLEMENTATION is kept. Call it before the backend starts. Source: JAX's multi-process
  CPU collectives (the `jax_cpu_collectives_implementation` option; docs/multihost.md).
  """
  if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):  # JAX 0.10's default, pinned against a change
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _log(what: str) -> None:
  logger.info(
      "jax.distributed %s: process_index=%d process_count=%d local_devices=%d global_devices=%d",
      what,
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
  )


# Where a collective or the coordination service reports that another process of the run is gone (gloo's
# connection errors, gRPC's UNAVAILABLE from the coordinator, a missed heartbeat).
_PEER_GONE = ("gloo", "connection reset", "connection closed", "connection refused", "broken pipe", "unavailable",
              "heartbeat", "socket closed", "end of file", "peer")  # fmt: skip


def peer_gone(error: BaseException) -> bool:
  """Whether `error` (or one it came from) says another process of a multi-process run ended."""
  while error is not None:
    if any(s in str(error).lower() for s in _PEER_GONE):
      return True
    error = error.__cause__ or error.__context__
  return False


HEARTBEAT_ENV = "MINPRO_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 10  # JAX's default is 100 s: a dead process held the others that long


def heartbeat_timeout_s(env: Mapping[str, str]) -> int:
  """Seconds without a heartbeat after which the coordinator counts a process as dead: MINPRO_HEARTBEAT_TIMEOUT_S,
  default 10 (the bound on how long the others run on after one died; raise it on a network that stalls longer).

  Raises:
    LaunchEnvironmentError: a value that is not an integer >= 1.
  """
  value = _count(env, HEARTBEAT_ENV) if env.get(HEARTBEAT_ENV, "").strip() else DEFAULT_HEARTBEAT_TIMEOUT_S
  if value < 1:
    raise LaunchEnvironmentError(f"environment variable {HEARTBEAT_ENV}={value} must be >= 1 (seconds), or unset")
  return value


_epilogue: Callable[[], str] = lambda: "re-run the same launch command on every host to resume"  # noqa: E731
_reported = threading.Lock()


def on_peer_loss(epilogue: Callable[[], str]) -> None:
  """Sets what the line of a lost peer ends with (the trainer: its newest checkpoint and how to resume)."""
  global _epilogue
  _epilogue = epilogue


def report_peer_loss(dead: str, cause: str) -> None:
  """Writes `error: <dead> of the N-process run ended (<cause>); process i stops too. <epilogue>` once (the first
  caller: the peer watch or a collective's exception) and ends this process at once with status
  1, without JAX's shutdown barrier (which waits for the dead process, then aborts with a native stack dump)."""
  if not _reported.acquire(blocking=False):
    time.sleep(60)  # the other caller is writing the line and ends the process
  try:
    n, me = jax.process_count(), jax.process_index()
  except Exception:  # noqa: BLE001 - the backend is going down: the launch variables still say who this is
    n, me = os.environ.get("JAX_NUM_PROCESSES", "N"), os.environ.get("JAX_PROCESS_ID", "?")
  tail = _tail()
  sys.stderr.write(f"error: {dead} of the {n}-process run ended ({cause}); process {me} stops too. {tail}\n")
  sys.stderr.flush()
  abort_line.exit_now(1)  # disarms the watcher first: this process has spoken for itself


def _watch_peers(interval_s: float = 0.5) -> None:
  """A daemon thread that asks the coordinator every `interval_s` seconds which processes are live and ends this
  one with `report_peer_loss` when one is not (the coordinator counts a process dead after the heartbeat timeout),
  or when the coordinator itself no longer answers."""
  # private JAX state: the distributed client jax.distributed.initialize made (jax/_src/distributed.py)
  from jax._src import distributed as jax_distributed

  client, n, me = jax_distributed.global_state.client, jax.process_count(), jax.process_index()

  def watch():
    beats = 0
    while not _stop.wait(interval_s):
      beats += 1
      if beats % 4 == 1:  # the abort line's tail (the newest checkpoint), every 2 s
        abort_line.update(_tail())
      try:
        live = set(client.get_live_nodes(list(range(n))))
      except Exception as e:  # noqa: BLE001 - the coordinator is gone (or this process is shutting down)
        if me != 0 and not _shutting_down:
          report_peer_loss("process 0 (the coordinator)", str(e).strip().splitlines()[0][:120] if str(e) else "")
        return
      dead = sorted(set(range(n)) - live)
      if dead and not _shutting_down:
        report_peer_loss("process " + ", ".join(map(str, dead)), f"no heartbeat for {DEFAULT_HEARTBEAT_TIMEOUT_S}+ s")

  _watcher.append(threading.Thread(target=watch, name="peer-watch", daemon=True))
  _watcher[-1].start()


def _tail() -> str:
  try:
    return _epilogue()
  except Exception:  # noqa: BLE001 - the line must come out whatever the epilogue does
    return "re-run the same launch command on every host to resume"


def _start_abort_line() -> None:
  """The watcher that writes the line when this process dies natively (`abort_line`: Gloo's abort when the
  coordinator dies mid-collective)."""
  # private JAX state: the coordinator's address jax.distributed.initialize used (jax/_src/distributed.py)
  from jax._src import distributed as jax_distributed

  address = jax_distributed.global_state.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  abort_line.start(jax.process_index(), jax.process_count(), address, _tail())


_shutting_down = False
_stop = threading.Event()  # set at exit: the peer watch ends before JAX's client does
_watcher: list[threading.Thread] = []


def _stop_watching(timeout_s: float = 60.0) -> None:
  """At exit, before JAX's own shutdown (atexit runs it after this): a finished run's shutdown is not a lost peer,
  and the processes leave together. In recoverable mode JAX's shutdown barrier blocks no task, so the coordinator
  (process 0) could end the service while another process still disconnects from it, which aborts that one: every
  process meets at a barrier, the others disconnect, and process 0 waits (at most `timeout_s`) until they have."""
  global _shutting_down
  _shutting_down = True
  _stop.set()
  for t in _watcher:  # not inside a call to the client while JAX shuts it down
    t.join(timeout=5)
  # private JAX state: the distributed client jax.distributed.initialize made (jax/_src/distributed.py)
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  if client is None:
    return
  n, me = jax.process_count(), jax.process_index()
  try:
    client.wait_at_barrier("minpro_exit", int(timeout_s * 1000))
    if me != 0:
      jax.distributed.shutdown()  # disconnects while the coordinator still serves
      return
    deadline = time.monotonic() + timeout_s
    while len(client.get_live_nodes(list(range(n)))) > 1 and time.monotonic() < deadline:
      time.sleep(0.05)
  except Exception:  # noqa: BLE001 - a process is gone or stopped without reaching the barrier: JAX's shutdown
    return


def _recoverable() -> None:
  """The coordination service in recoverable mode (`jax_enable_recoverability`): a dead process is reported to the
  others' `_watch_peers` instead of aborting them with a native stack dump (JAX's default)."""
  try:
    jax.config.update("jax_enable_recoverability", True)
  except (AttributeError, KeyError, ValueError):  # a JAX without it: its default abort stays
    pass
