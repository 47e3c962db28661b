"""Mistakes in a multi-process launch end in one `error: ...` line and exit status 2 before any work, on real
processes on this machine (`minpro_jax.launch_local`'s launch contract): launch variables that do not parse, a mesh
that does not span every process's devices, a workdir that is not one directory shared by every process."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from train_helpers import cli_args, cli_env, tiny_overrides

from minpro_jax import launch_local


def _one_line_error(stderr: str) -> str:
  errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
  return errors[0]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MINPRO_DISTRIBUTED": "maybe"}, "MINPRO_DISTRIBUTED='maybe': use 1 (force multi-process), 0 (never)"),
        (
            {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            "JAX_NUM_PROCESSES='two' must be a non-negative integer",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            "JAX_PROCESS_ID=2 must lie in [0, JAX_NUM_PROCESSES=2): give the processes the distinct ids 0 .. 1",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "0"},
            "JAX_NUM_PROCESSES=0 must be >= 1",
        ),
    ],
)
def test_bad_launch_variables_give_one_line(tmp_path, env, message):
  r = subprocess.run(
      cli_args(tiny_overrides(tmp_path)), env={**cli_env(), **env}, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 2, r.stderr[-3000:]
  assert message in _one_line_error(r.stderr)
  assert not (tmp_path / "run").exists()  # refused before the workdir is made


def test_debug_shows_the_launch_variable_traceback(tmp_path):
  env = {**cli_env(), "MINPRO_DISTRIBUTED": "maybe"}
  r = subprocess.run([*cli_args(tiny_overrides(tmp_path)), "--debug"], env=env, capture_output=True, text=True)
  assert r.returncode != 0 and "Traceback" in r.stderr and "LaunchEnvironmentError" in r.stderr


def _two_processes(argv, cwds, timeout=300):
  """Runs `argv` as processes 0 and 1 of one job, process i in `cwds[i]`; returns (exit codes, outputs, seconds)."""
  port = launch_local.free_port()
  t0 = time.time()
  procs = [
      subprocess.Popen(
          argv,
          cwd=cwd,
          env=launch_local.process_env(i, 2, 1, port, cli_env()),
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i, cwd in enumerate(cwds)
  ]
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], outs, time.time() - t0


@pytest.mark.slow
def test_two_processes_without_a_spanning_mesh_stop_before_any_work(tmp_path):
  ov = tiny_overrides(tmp_path)  # mesh.shape "" = one device, but the job has one device in each of 2 processes
  codes, outs, _ = _two_processes(cli_args(ov), [tmp_path, tmp_path])
  for code, (_, err) in zip(codes, outs):
    assert code == 2, err[-3000:]
    line = _one_line_error(err)
    assert line.startswith("error: config.mesh.shape: empty means one device, but this run has 2 processes"), line
    assert "--config.mesh.shape=fsdp=-1" in line
  assert not (tmp_path / "cache").exists()  # no tokenizer, no SFT warm start
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_workdir_that_is_not_shared_is_found_at_start_up(tmp_path):
  ov = tiny_overrides(tmp_path, workdir="run", **{"mesh.shape": "data=2"})  # relative: each process's own cwd
  a, b = tmp_path / "host_a", tmp_path / "host_b"
  a.mkdir()
  b.mkdir()
  codes, outs, seconds = _two_processes(cli_args(ov), [a, b])
  for code, (_, err) in zip(codes, outs):
    assert code == 2, err[-3000:]
    line = _one_line_error(err)
    assert "config.workdir: " in line and "is not one directory shared by every process: processes [1]" in line
    assert "absolute path" in line
  assert not (tmp_path / "cache").exists()  # stopped before the tokenizer and the SFT warm start
  assert seconds < 120  # not orbax's 600 s timeout
  assert os.listdir(a / "run") == []  # process 0 removed its probe file


def test_check_shared_dir_is_a_no_op_for_one_process(tmp_path):
  from minpro_jax.runtime import multihost

  multihost.check_shared_dir(str(tmp_path), "workdir")
  assert os.listdir(tmp_path) == []


def test_one_device_leaves_are_replicated_on_the_mesh_and_others_checked():
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.errors import ConfigError
  from minpro_jax.runtime.sharding import check_global, make_mesh, replicate_local_leaves

  mesh = make_mesh({"data": 2, "fsdp": -1})  # the 8 CPU devices of tests/conftest.py
  w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("fsdp")))
  tree = {"w": w, "n": jnp.zeros((), jnp.int32) + 3, "host": 1.5}
  assert replicate_local_leaves(tree, None) is tree
  placed = replicate_local_leaves(tree, mesh)
  assert placed["w"] is w and placed["host"] == 1.5  # already on the mesh, or not an array: left alone
  assert placed["n"].sharding == NamedSharding(mesh, P()) and int(placed["n"]) == 3
  check_global(placed, mesh, "the state")
  half = make_mesh({"data": 4}, devices=jax.devices()[:4])
  bad = {**placed, "v": jax.device_put(jnp.zeros(4), NamedSharding(half, P()))}
  with pytest.raises(ConfigError, match=r"^config.mesh.shape: leaf \['v'\] of the state is laid out on 4 device"):
    check_global(bad, mesh, "the state")
  with pytest.raises(ConfigError, match=r"leaf \['n'\] of the state is laid out on 1 device"):
    check_global(tree, mesh, "the state")


def test_with_device_count_sets_or_removes_only_the_device_count():
  flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8 --xla_cpu_foo=1"
  assert launch_local.with_device_count(flags, 2) == (
      "--xla_backend_optimization_level=0 --xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
  )
  assert launch_local.with_device_count(flags, None) == "--xla_backend_optimization_level=0 --xla_cpu_foo=1"
  assert launch_local.with_device_count("", 4) == "--xla_force_host_platform_device_count=4"
  env = launch_local.process_env(1, 2, 3, 1234, {"XLA_FLAGS": flags})
  assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=3") and env["XLA_FLAGS"].count("device") == 1
