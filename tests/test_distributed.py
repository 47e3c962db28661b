"""minpro_jax.runtime.distributed: single-host no-op, detection of multi-process launchers, forced / forbidden modes.

The main path, the explicit JAX_* variables and a real `jax.distributed.initialize` in two processes, runs in
tests/test_multihost.py. Here are the launchers this machine cannot start (TPU pods, GKE, SLURM, Open MPI) and the
control flag: only their detection is checked, with the initialize call replaced by a recorder (a real call in
this already-started process would raise)."""

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
