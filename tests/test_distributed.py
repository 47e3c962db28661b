"""minpro_jax.runtime.distributed: single-host no-op, detection of multi-process launchers, forced / forbidden modes.

The main path, the explicit JAX_* variables and a real `jax.distributed.initialize` in two processes, runs in
tests/test_multihost.py. Here are the launchers this machine cannot start (TPU pods, GKE, SLURM, Open MPI) and the
control flag: only their detection is checked, with the initialize call replaced by a recorder (a real call in
this already-started process would raise)."""

import re
import tempfile
import time

import jax
import pytest

from minpro_jax.runtime.distributed import ENV_FLAG, maybe_initialize_distributed, multiprocess_reason

LAUNCHER_VARS = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_HOSTNAMES",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    ENV_FLAG,
)


class Recorder:

  def __init__(self):
    self.calls = []

  def __call__(self, **kwargs):
    self.calls.append(kwargs)


@pytest.fixture
def clean_env(monkeypatch):
  for key in LAUNCHER_VARS:
    monkeypatch.delenv(key, raising=False)
  return monkeypatch


def test_noop_without_env_vars(clean_env):
  rec = Recorder()
  assert multiprocess_reason() is None
  assert maybe_initialize_distributed(initialize_fn=rec) is False
  assert rec.calls == []
  assert not jax.distributed.is_initialized()
  assert jax.process_count() == 1 and jax.process_index() == 0


def test_noop_with_real_initialize_on_single_host(clean_env):
  # Without a fake: must return before touching jax.distributed.initialize (which would raise here, since the
  # backend is already up, or wait for a coordinator).
  assert maybe_initialize_distributed() is False
  assert jax.process_count() == 1


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS=10.0.0.1:1234"),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "TPU_WORKER_HOSTNAMES lists 4 hosts"),
        ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}, "SLURM_NTASKS=4"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2"),
    ],
)
def test_detects_multiprocess_launchers(env, reason):
  assert multiprocess_reason(env) == reason
  rec = Recorder()
  assert maybe_initialize_distributed(env=env, initialize_fn=rec) is True
  assert rec.calls == [{}]  # JAX auto-detects the rest


@pytest.mark.parametrize(
    "env",
    [
        {"TPU_WORKER_HOSTNAMES": "localhost"},  # single-host TPU VM
        {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"},  # one SLURM task
        {"OMPI_COMM_WORLD_SIZE": "1"},
        {"JAX_COORDINATOR_ADDRESS": "  "},
    ],
)
def test_single_process_launchers_are_noop(env):
  rec = Recorder()
  assert multiprocess_reason(env) is None
  assert maybe_initialize_distributed(env=env, initialize_fn=rec) is False
  assert rec.calls == []


def test_flag_forces_and_forbids():
  rec = Recorder()
  assert maybe_initialize_distributed(env={ENV_FLAG: "1"}, initialize_fn=rec) is True  # TPU pod: metadata server
  assert rec.calls == [{}]
  rec = Recorder()
  assert (
      maybe_initialize_distributed(env={ENV_FLAG: "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}, initialize_fn=rec)
      is False
  )
  assert rec.calls == []
  rec = Recorder()
  assert maybe_initialize_distributed(False, env={"JAX_COORDINATOR_ADDRESS": "h:1"}, initialize_fn=rec) is False
  assert maybe_initialize_distributed(True, env={}, initialize_fn=rec) is True
  assert rec.calls == [{}]


@pytest.mark.parametrize(
    "env, name",
    [
        ({ENV_FLAG: "maybe"}, ENV_FLAG),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "four"}, "SLURM_NTASKS"),
        ({ENV_FLAG: "1", "JAX_NUM_PROCESSES": "x"}, "JAX_NUM_PROCESSES"),
    ],
)
def test_bad_values_name_the_variable(env, name):
  with pytest.raises(ValueError, match=name):
    maybe_initialize_distributed(env=env, initialize_fn=Recorder())


def test_the_heartbeat_timeout_comes_from_its_variable():
  from minpro_jax.errors import LaunchEnvironmentError
  from minpro_jax.runtime.distributed import heartbeat_timeout_s

  assert heartbeat_timeout_s({}) == 10 and heartbeat_timeout_s({"MINPRO_HEARTBEAT_TIMEOUT_S": "45"}) == 45
  for bad in ("0", "ten", "-3"):
    with pytest.raises(LaunchEnvironmentError, match="MINPRO_HEARTBEAT_TIMEOUT_S"):
      heartbeat_timeout_s({"MINPRO_HEARTBEAT_TIMEOUT_S": bad})


# -------------------------------------------------------------------------------- the abort line (`abort_line`)
_CHILD = """
import os, sys, time
from minpro_jax.runtime import abort_line
abort_line.start(1, 2, sys.argv[1], "first tail")
abort_line.update("the newest run checkpoint is /w/checkpoints/3; re-running the same command resumes from it")
time.sleep(0.3)
{end}
"""


def _child_stderr_waiting(end: str, coordinator: str) -> tuple[int, str]:
  """Runs `_CHILD` ending with `end`; (its exit status, everything written to its stderr, the watcher's line too)."""
  import subprocess
  import sys

  code = _CHILD.format(end=end)
  with tempfile.TemporaryFile("w+") as err:
    p = subprocess.run([sys.executable, "-c", code, coordinator], stderr=err, timeout=60)
    time.sleep(2.0)  # the watcher polls every 0.2 s, then checks the coordinator's address (timeout 1 s)
    err.seek(0)
    return p.returncode, err.read()


@pytest.fixture()
def coordinator_port():
  """A port that listens (a live coordinator's address)."""
  import socket

  s = socket.socket()
  s.bind(("localhost", 0))
  s.listen()
  yield s.getsockname()[1]
  s.close()


def _closed_port() -> int:
  import socket

  s = socket.socket()
  s.bind(("localhost", 0))
  port = s.getsockname()[1]
  s.close()
  return port


def test_a_native_abort_after_the_coordinator_died_still_gives_the_one_line(tmp_path):
  """Gloo's abort (SIGABRT, no Python) while the coordinator's address no longer answers: the watcher writes the
  line report_peer_loss would have, naming the coordinator and the newest checkpoint (issue 58)."""
  code, err = _child_stderr_waiting("os.abort()", f"localhost:{_closed_port()}")
  assert code == -6, err
  assert re.search(
      r"error: process 0 \(the coordinator\) of the 2-process run ended \(.*\); process 1 stops too\. the newest "
      r"run checkpoint is /w/checkpoints/3; re-running the same command resumes from it",
      err,
  ), err


def test_a_kill_with_the_coordinator_up_names_this_process(coordinator_port):
  code, err = _child_stderr_waiting("os.kill(os.getpid(), 9)", f"localhost:{coordinator_port}")
  assert code == -9
  assert (
      "error: process 1 of the 2-process run ended (a native abort or a kill, no Python exception). the newest" in err
  )


@pytest.mark.parametrize("end", ["pass", "abort_line.exit_now(143)", "sys.exit(3)"])
def test_an_orderly_exit_leaves_the_watcher_silent(end):
  code, err = _child_stderr_waiting(end, f"localhost:{_closed_port()}")
  assert code in (0, 143, 3)
  assert "error:" not in err, err
