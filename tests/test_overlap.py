"""Sampling overlapped with learning on disjoint devices (`config.sampling.devices`, `minpro_jax/run/step_runner.py`): the
device split and its config errors, the sampler's layout on its own devices, and the overlapped run equal to the
sequential one on the same split, bit for bit, after a SIGKILL and resume too."""

import logging
import signal
import subprocess
import threading
import time
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import checkpoint_steps, cli_args, cli_env, make_config, metrics_records, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.launch_local import with_device_count
from minpro_jax.models import get_preset, init_model
from minpro_jax.rl.rollout import RolloutBuffer
from minpro_jax.run.run_config import validate_config
from minpro_jax.run.step_runner import StepRunner
from minpro_jax.runtime.device_split import sampler_device_count, split_devices
from minpro_jax.runtime.inference_mesh import sampler_layout
from minpro_jax.runtime.sharding import make_mesh, use_mesh
from minpro_jax.sampling import Sampler, SamplingParams


# ------------------------------------------------------------------------------------------------ the split
@pytest.mark.parametrize(
    "value, n, procs, want", [(0, 8, 1, 0), (4, 8, 1, 4), (0.25, 8, 1, 2), (0, 8, 2, 0), (7, 8, 1, 7), (2.0, 8, 1, 2)]
)
def test_sampler_device_count(value, n, procs, want):
  assert sampler_device_count(value, n, procs) == want


@pytest.mark.parametrize(
    "value, n, procs, match",
    [
        (8, 8, 1, "8 of 8 devices leaves the learner no device; give the sampler between 1 and 7"),
        (-1, 8, 1, "-1 of 8 devices leaves the sampler no device"),
        (0.01, 8, 1, r"0.01 of 8 devices = 0 leaves the sampler no device"),
        (1.5, 8, 1, r"a fraction of the devices must lie in \(0, 1\), got 1.5"),
        (4, 8, 2, "a run of 2 processes cannot split its devices yet"),
        ("half", 8, 1, "must be 0 .no split., a device count or a fraction"),
        (True, 8, 1, "must be 0"),
    ],
)
def test_sampler_device_count_refuses_naming_the_field(value, n, procs, match):
  with pytest.raises(ConfigError, match=r"^config\.sampling\.devices: " + match):
    sampler_device_count(value, n, procs)


def test_split_takes_the_last_devices_of_every_process():
  devs = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
  split = split_devices(4, devs)
  assert [d.id for d in split.sampler] == [2, 3, 6, 7] and [d.id for d in split.learner] == [0, 1, 4, 5]
  assert split_devices(0, devs) is None
  one = split_devices(3, jax.devices())
  assert one.sampler == tuple(jax.devices()[5:]) and one.learner == tuple(jax.devices()[:5])


def test_config_errors_name_the_field(tmp_path):
  ov = tiny_overrides(tmp_path, micro_batch_size=4)
  with pytest.raises(ConfigError, match=r"^config\.sampling\.devices: 8 of 8 devices leaves the learner no device"):
    validate_config(make_config({**ov, "sampling.devices": 8}), num_devices=8)
  msg = r"^config\.mesh\.shape: 'fsdp=8': .*sampling\.devices=4 gives the sampler 4"
  with pytest.raises(ConfigError, match=msg):
    validate_config(make_config({**ov, "sampling.devices": 4, "mesh.shape": "fsdp=8"}), num_devices=8)
  with pytest.raises(ConfigError, match=r"^config\.sampling\.mesh: 'data=8' spans 8 devices, but .* 4"):
    validate_config(make_config({**ov, "sampling.devices": 4, "mesh.shape": "fsdp=4", "sampling.mesh": "data=8"}), 8)
  validate_config(make_config({**ov, "sampling.devices": 0.5, "mesh.shape": "fsdp=-1"}), num_devices=8)
  validate_config(make_config({**ov, "sampling.devices": 1, "micro_batch_size": 2}), num_devices=2)  # "": 1 device
  with pytest.raises(
      ConfigError, match=r"^config\.mesh\.shape: empty means one device, but sampling\.devices=4 leaves"
  ):
    validate_config(make_config({**ov, "sampling.devices": 4}), num_devices=8)  # 3 learner devices idle
  with pytest.raises(
      ConfigError, match=r"^config\.sampling\.devices: a split needs at least 2 devices, this run has 1"
  ):
    validate_config(make_config({**ov, "sampling.devices": 0.5}), num_devices=1)


def test_delay_zero_runs_sequentially_and_says_so(tmp_path, caplog):
  split = split_devices(4, jax.devices())
  fake = lambda delay, overlap=True: types.SimpleNamespace(  # noqa: E731
      c=make_config(tiny_overrides(tmp_path, delay=delay, **{"sampling.overlap": overlap})),
      parts=types.SimpleNamespace(device_split=split),
  )
  with caplog.at_level(logging.INFO, logger="minpro_jax.run.step_runner"):
    runner = StepRunner(fake(0))
  assert not runner.overlapped and runner._pool is None
  assert "learns one after the other (delay=0: step s learns from its own batch)" in caplog.text
  assert not StepRunner(fake(2, overlap=False)).overlapped
  runner = StepRunner(fake(1))
  assert runner.overlapped
  runner.close()


class _State(NamedTuple):
  params: dict
  step: jax.Array


class _FakeTrainer:
  """What `StepRunner` reads of a trainer: sample_step waits for learn_step to have started (so it returns only
  if the two run at the same time) and records what it was given."""

  def __init__(self, tmp_path, delay=1, fail=False):
    self.c = make_config(tiny_overrides(tmp_path, delay=delay))
    self.parts = types.SimpleNamespace(device_split=split_devices(4, jax.devices()))
    self.mesh, self.rules = None, ()
    self.sampler = types.SimpleNamespace(prepare_params=lambda p: ("prepared", p))
    self.learning, self.learnt, self.fail, self.seen = threading.Event(), threading.Event(), fail, {}

  def scoring(self, step):
    return True, True

  def sample_step(self, state, step, prepared):
    self.seen.update(
        thread=threading.current_thread() is threading.main_thread(),
        concurrent=self.learning.wait(timeout=10),
        params=state.params,
        version=int(state.step),
        prepared=prepared,
    )
    if self.fail:
      raise RuntimeError("sampling failed")
    return f"batch {step}", {"reward/mean": 0.5}

  def learn_step(self, state, batch, lr_scale):
    self.seen.update(learner_thread=threading.current_thread().name, released=batch)
    self.learning.set()
    time.sleep(0.2)
    self.learnt.set()
    return _State({"w": state.params["w"] + 1}, state.step + 2), {"time/learn": 0.2}


def test_the_runner_learns_in_a_worker_thread_while_the_main_thread_samples(tmp_path):
  tr = _FakeTrainer(tmp_path)
  runner = StepRunner(tr)
  buffer = RolloutBuffer(1)
  buffer.push(0, "batch 0")
  state = _State({"w": jnp.arange(3.0)}, jnp.asarray(4))
  w = state.params["w"]
  try:
    new, before, metrics = runner.run(state, 1, buffer, 1.0)
  finally:
    runner.close()
  seen = tr.seen
  assert seen["thread"] and seen["concurrent"] and seen["learner_thread"].startswith("learner")
  assert seen["released"] == "batch 0" and seen["version"] == 4 and seen["prepared"][1]["w"] is w
  assert seen["params"]["w"] is not w and np.array_equal(seen["params"]["w"], w)  # a copy for the score pass
  assert int(new.step) == 6 and before is None and buffer.pop(2) == "batch 1"
  assert set(metrics) == {"reward/mean", "time/learn", "time/weight_transfer"}


def test_a_sampling_error_waits_for_the_updates_then_raises(tmp_path):
  tr = _FakeTrainer(tmp_path, fail=True)
  runner = StepRunner(tr)
  buffer = RolloutBuffer(1)
  buffer.push(0, "batch 0")
  with pytest.raises(RuntimeError, match="sampling failed"):
    runner.run(_State({"w": jnp.zeros(2)}, jnp.asarray(0)), 1, buffer, 1.0)
  assert tr.learnt.is_set()
  runner.close()


# ------------------------------------------------------------------------------------------------ the sampler
def test_sampler_on_its_own_devices_samples_what_one_device_samples():
  """The learner's fsdp=4 parameters on devices 0-3, transferred to the sampler's "auto" layout on devices 4-7 (the
  default of sampling.mesh with a split): every prepared weight lives on the sampler's devices only, the learner's
  stay where they were, and the tokens are the one-device sampler's; also when called under the learner's mesh (as
  the trainer does) with a sample count that is not a batch bucket (6 rows padded to 8)."""
  cfg = get_preset("tiny")
  split = split_devices(4, jax.devices())
  learner_mesh = make_mesh({"fsdp": -1}, devices=split.learner)
  state = nnx.split(init_model(cfg, seed=3, mesh=learner_mesh))[1]
  mesh, rules = sampler_layout("", learner_mesh, cfg, devices=split.sampler)
  assert set(mesh.devices.flat) == set(split.sampler)
  sampler = Sampler(cfg, prompt_buckets=(8, 16), mesh=mesh, rules=rules)
  prepared = sampler.prepare_params(state)
  for x in jax.tree.leaves(prepared.state):
    assert x.sharding.device_set <= set(split.sampler)
  for x in jax.tree.leaves(state):
    assert x.sharding.device_set <= set(split.learner)
  sp = SamplingParams(temperature=0.7, top_k=40, max_new_tokens=9)
  prompts = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [4, 4, 2]]
  one = nnx.split(init_model(cfg, seed=3))[1]
  want = Sampler(cfg, prompt_buckets=(8, 16)).generate(one, prompts, sp, seed=4, group_size=2)
  with use_mesh(learner_mesh):
    got = sampler.generate(prepared, prompts, sp, seed=4, group_size=2)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ the runs
STEPS = 5


def _overrides(tmp_path, name, overlap):
  # delay 2; the mismatch metrics (the score pass) every 2 steps: steps that score and update read the copy of
  # the parameters; entropy bonus and a high learning rate so that the parameters move although rewards are 0
  return tiny_overrides(
      tmp_path,
      workdir=str(tmp_path / name),
      total_steps=STEPS,
      delay=2,
      micro_batch_size=4,
      **{
          "sampling.devices": 4,
          "sampling.overlap": overlap,
          "mesh.shape": "fsdp=-1",
          "log.mismatch_every": 2,
          "checkpoint.every": 1,
          "checkpoint.keep": 2,
          "loss.entropy_coef": 0.05,
          "optimizer.learning_rate": 1e-2,
      },
  )


def _env():
  env = cli_env()
  env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), 8)
  return env


def _run(ov):
  r = subprocess.run(cli_args(ov), capture_output=True, text=True, env=_env(), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stderr


@pytest.mark.slow
def test_overlapped_run_equals_sequential_run_after_sigkill_and_resume(tmp_path):
  seq = _overrides(tmp_path, "sequential", False)
  err = _run(seq)
  assert "sampler on 4 devices, learner on 4: a step samples and learns one after the other" in err
  ref = metrics_records(seq["workdir"])
  ov = _overrides(tmp_path, "overlapped", True)
  p = subprocess.Popen(cli_args(ov), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
  t0 = time.time()
  try:
    while not any(s >= 2 for s in checkpoint_steps(ov["workdir"])):  # steps 0-2 done: updates and a score pass
      assert p.poll() is None, "run finished before it could be interrupted"
      assert time.time() - t0 < 600
      time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == -signal.SIGKILL
  assert "a step samples and learns at the same time" in err
  restored = max(checkpoint_steps(ov["workdir"]))
  assert restored < STEPS - 1
  first = metrics_records(ov["workdir"])
  _run(ov)
  got = metrics_records(ov["workdir"])
  assert sorted(got) == sorted(ref) == list(range(-1, STEPS + 1))
  for s in ref:  # the steps the first process logged, then those after the resume
    assert got[s] == ref[s], f"step {s} differs (restored from {restored})"
  assert all(first[s] == ref[s] for s in first if s <= restored)
  assert ref[STEPS - 1]["policy_version"] == (STEPS - 2) * 2
  assert ref[2]["sampler_learner/mismatch_k3"] != ref[4]["sampler_learner/mismatch_k3"]  # the policy moved


def test_the_compile_only_tool_refuses_a_split():
  from minpro_jax.aot.budget import Budget
  from minpro_jax.aot.topologies import parse_slice
  from minpro_jax.config_lib import set_fields
  from minpro_jax.config_lib.defaults import get_config

  c = set_fields(get_config(), {"sampling.devices": 4, "micro_batch_size": 16, "sampling.max_new_tokens": 8})
  with pytest.raises(ConfigError, match=r"^--config\.sampling\.devices=4: the compile-only tool compiles the prog"):
    Budget(c, parse_slice("cpu:8"), "fsdp=8", lengths="const:4", prompt_len=6)
