"""The trainer as several real JAX processes on this machine (gloo collectives, a localhost coordinator), started
with `python -m minpro_jax.launch_local` exactly as the README's "Multi-host" section says.

* 2 processes x 2 CPU devices on the mesh data=2,fsdp=2 give the per-step metrics of 1 process x 4 devices on the
  same mesh, with packed learner rows, dynamic sampling and MIPU's rollback test: every sampled token, reward, length, advantage,
  staleness, rollback decision and evaluation score equal; the float statistics of the log-probs (sampler-learner
  mismatch, policy ratios, weights, T_post) within 1e-5, because XLA's
  in-process all-reduce over 4 devices and gloo's over 2 processes sum partial results in another order (fp32
  round-off, ~1e-7 here).
* both processes SIGKILLed at a random moment and relaunched with the same command end with the metrics of the
  uninterrupted two-process run, exactly, resuming from a delay buffer each process wrote its rows of; SIGTERM to one process stops both after the same step, checkpointed;
* a resume with another process count fails naming both counts;
* `python -m minpro_jax.evaluate` in two processes gives the one-process tables, written once, resumable;
* the host primitives (all-gather, row split, grading split, config check) in two processes, and each process's
  rows of the sampler's outputs and of the score pass;
* `launch_local` ends the others when one fails and forwards SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import REPO, checkpoint_steps, cli_args, cli_env, metrics_records, tiny_overrides

from minpro_jax import launch_local
from minpro_jax.rl.advantages import group_advantages

pytestmark = pytest.mark.slow

STEPS = 4
REWARDS = np.asarray([1.0, 0.0, 0.5, 0.5, 0.25, 1.0, 0.0, 0.0], np.float32)  # tests/multihost_worker.py's batch
# Metrics that are float statistics of log-probs: equal up to the reduction order of the collectives.
ROUNDOFF = ("sampler_learner/", "learn/", "mipu/t_post")
EXACT_LEARN = ("learn/updates", "learn/skipped_updates")
# The tests that need no run of the `runs` fixture: another xdist group, free to go to the other worker.
LAUNCH_GROUP = pytest.mark.xdist_group("multihost_launch")


def _overrides(tmp, name):
  return tiny_overrides(
      tmp,
      workdir=str(tmp / name),
      total_steps=STEPS,
      micro_batch_size=4,  # splits over data x fsdp = 4 (run_config.check_micro_batch_split)
      **{"mesh.shape": "data=2,fsdp=2", "eval.every": 2, "checkpoint.every": 1, "checkpoint.keep": 2},
      # each process packs its own mini-batch (rl/process_packing.py), holds its rows of dynamic sampling's rounds
      # (rl/process_dynamic.py) and samples and scores its rows of MIPU's validation draw; the one-process run packs,
      # fills and checks the same rows (the soft overlong penalty makes some groups' rewards unequal: a filled
      # batch that takes groups across rounds and processes, a T_post that is not 0)
      **{"learner.row_tokens": 38, "mipu.rollback": True, "sampling.drop_equal_reward_groups": True},
      **{"reward.overlong_buffer": 5},
  )


def _launch_args(ov, num_processes=2, devices_per_process=2):
  train = cli_args(ov)[3:]  # the flags after `python -m minpro_jax.train`
  return [
      sys.executable,
      "-m",
      "minpro_jax.launch_local",
      f"--num_processes={num_processes}",
      f"--devices_per_process={devices_per_process}",
      "--",
      *train,
  ]


def _env(devices=None):
  env = cli_env()
  if devices:
    env["XLA_FLAGS"] = launch_local.with_device_count(env.get("XLA_FLAGS", ""), devices)
  return env


def _finish(p, timeout):
  """The output of `p` once it ends; killed (its processes die with it) and failed after `timeout` seconds."""
  try:
    return p.communicate(timeout=timeout)[0]
  except subprocess.TimeoutExpired:
    p.kill()
    out = p.communicate()[0]
    pytest.fail(f"still running after {timeout} s; output: ...{out[-3000:]}")


def _close(a, b, tol=1e-5):
  if isinstance(a, list):
    return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
  if isinstance(a, float) and isinstance(b, float):
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
  return a == b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The uninterrupted two-process run and the one-process, four-device run of the same config, side by side."""
  tmp = tmp_path_factory.mktemp("multihost")
  one, two = _overrides(tmp, "one"), _overrides(tmp, "two")
  out2 = run_side_by_side(tmp, one, two)
  return tmp, one["workdir"], two["workdir"], out2


def run_side_by_side(tmp, one: dict, two: dict) -> str:
  """Runs the config `one` as 1 process x 4 devices and `two` as 2 processes x 2 devices at the same time (one SFT
  cache each), asserts both exit 0, and returns the two-process run's output."""
  one["sft.cache_dir"] = str(tmp / "cache_one")
  p1 = subprocess.Popen(cli_args(one), env=_env(devices=4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  p2 = subprocess.Popen(_launch_args(two), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out1, out2 = _finish(p1, 600), _finish(p2, 600)
  assert p1.returncode == 0, out1[-3000:]
  assert p2.returncode == 0, out2[-3000:]
  return out2


def test_two_processes_give_the_metrics_of_one(runs):
  _, one, two, _ = runs
  ref, got = metrics_records(one), metrics_records(two)
  assert sorted(ref) == sorted(got) == list(range(-1, STEPS + 1))
  assert ref[STEPS - 1]["policy_version"] == got[STEPS - 1]["policy_version"] > 0
  for step in ref:
    for k, v in ref[step].items():
      if k.startswith(ROUNDOFF) and k not in EXACT_LEARN:
        assert _close(v, got[step][k]), (step, k, v, got[step][k])
      else:
        assert got[step][k] == v, (step, k, v, got[step][k])
  assert "eval/pass@1" in got[1] and "reward/mean" in got[0]


def test_process_0_writes_the_files_once(runs):
  _, _, two, out = runs
  with open(os.path.join(two, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(-1, STEPS + 1))  # one line per step, not one per process
  assert sorted(os.listdir(os.path.join(two, "eval"))) == sorted(
      f"{n}.{e}" for n in ("step_000000_initial", "step_000002", "final") for e in ("json", "md")
  )
  with open(os.path.join(two, "summary.json")) as f:
    assert json.load(f)["policy_version"] > 0
  assert out.count('"eval_final"') == 1  # the summary is printed by process 0 only
  assert "[0]" in out and "[1]" in out  # both processes ran, their lines prefixed


@contextlib.contextmanager
def _two_processes_past_their_first_checkpoint(ov):
  """Starts the two processes of `ov`'s run (output collected), yields (processes, output lines) once the first
  run checkpoint exists, and kills whatever is still running on the way out."""
  procs = launch_local.spawn([sys.executable, "-m", "minpro_jax.train", *cli_args(ov)[3:]], 2, 2, env=_env())
  lines: list[str] = []
  sink = types.SimpleNamespace(write=lines.append, flush=lambda: None)
  threads = launch_local.stream(procs, out=sink)
  try:
    t0 = time.time()
    while not checkpoint_steps(ov["workdir"]):
      assert all(p.poll() is None for p in procs), (
          "the run ended before its first checkpoint: " + "".join(lines)[-3000:]
      )
      assert time.time() - t0 < 500
      time.sleep(0.05)
    yield procs, lines
  finally:
    for p in procs:
      p.kill()
      p.wait()
    for t in threads:
      t.join(timeout=5)


def test_sigkill_both_processes_then_relaunch_matches(runs):
  tmp, _, two, _ = runs
  ov = _overrides(tmp, "killed")
  seed = random.randrange(1 << 30)
  with _two_processes_past_their_first_checkpoint(ov) as (procs, _):
    time.sleep(random.Random(seed).uniform(0.0, 4.0))  # a random moment after the first checkpoint
    for p in procs:
      p.kill()
  killed_at = checkpoint_steps(ov["workdir"])
  newest = os.path.join(ov["workdir"], "checkpoints", str(killed_at[-1]))
  with open(os.path.join(newest, "meta", "metadata")) as f:
    layout = json.load(f)["buffer"]  # the resume reads a delay buffer written per process
  assert layout["rows"] == 8 and list(layout["batches"]) == ["0"]  # delay 1: one waiting batch of 8 rows
  assert layout["batches"]["0"]["advantages"] == [[8], "<f4"]
  assert os.listdir(os.path.join(newest, "buffer", "ocdbt.process_1", "d"))  # process 1 wrote its rows
  r = subprocess.run(_launch_args(ov), env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, (seed, r.stdout[-3000:])
  assert metrics_records(ov["workdir"]) == metrics_records(two), f"seed {seed}, killed with checkpoints {killed_at}"


def test_sigterm_to_one_process_stops_both_after_the_same_step(runs):
  tmp, _, two, _ = runs
  ov = _overrides(tmp, "preempted")
  with _two_processes_past_their_first_checkpoint(ov) as (procs, lines):
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice that reached one host
    codes = [p.wait(timeout=300) for p in procs]
  out = "".join(lines)
  assert codes == [128 + signal.SIGTERM] * 2, out[-3000:]
  stopped = {int(m) for m in re.findall(r"stopped by signal 15 at global step (\d+)", out)}
  assert len(stopped) == 1, out[-3000:]  # both processes name the same step (process 1 logs its warning too)
  assert max(checkpoint_steps(ov["workdir"])) == stopped.pop()
  r = subprocess.run(_launch_args(ov), env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:]
  assert metrics_records(ov["workdir"]) == metrics_records(two)


def test_resume_with_another_process_count_fails_naming_it(runs):
  tmp, _, two, _ = runs
  copy = str(tmp / "recount")
  shutil.copytree(two, copy)
  ov = dict(_overrides(tmp, "recount"), **{"mesh.shape": "data=2,fsdp=2"})
  r = subprocess.run(cli_args(ov), env=_env(devices=4), capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "checkpointed by 2 process(es), this one runs on 1" in r.stderr


def _evaluate(workdir, out, num_processes):
  """`python -m minpro_jax.evaluate` of `workdir`'s best checkpoint into `out`: in one process with 4 devices, or in
  `num_processes` x 2 devices started by `launch_local` (the mesh is the run's, data=2,fsdp=2)."""
  args = ["--workdir", str(workdir), "--no-progress", f"--out={out}"]
  if num_processes == 1:
    argv, env = [sys.executable, "-m", "minpro_jax.evaluate", *args], _env(devices=4)
  else:
    argv = [sys.executable, "-m", "minpro_jax.launch_local", f"--num_processes={num_processes}"]
    argv, env = [*argv, "--devices_per_process=2", "--module=minpro_jax.evaluate", "--", *args], _env()
  return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_evaluate_in_two_processes_equals_one_and_resumes(runs):
  """`minpro_jax.evaluate` of a two-process run's checkpoint in two processes: the tables (every sample's answer and
  correctness, every score) equal the one-process evaluation's on the same mesh; process 0 alone writes and prints;
  a re-run keeps the finished benchmark's table (not sampled again) and writes the same tables."""
  tmp, _, two, _ = runs
  one_out, two_out = tmp / "eval_one", tmp / "eval_two"
  p1, p2 = _evaluate(two, one_out, 1), _evaluate(two, two_out, 2)
  out1, out2 = _finish(p1, 600), _finish(p2, 600)
  assert p1.returncode == 0, out1[-3000:]
  assert p2.returncode == 0, out2[-3000:]
  read = lambda d, name: json.loads((d / name).read_text())  # noqa: E731
  ref, got = read(one_out, "eval.json"), read(two_out, "eval.json")
  assert got == ref
  (name,) = ref["benchmarks"]  # the run's held-out set
  assert len(ref["samples"][name]) == 8 and ref["benchmarks"][name]["n"] == 2
  assert (
      sorted(os.listdir(two_out))
      == sorted(os.listdir(one_out))
      == sorted(["eval.json", "eval.md", f"{name}.json", "settings.json"])
  )
  assert out2.count("tables: ") == 1 and f"[0] tables: {two_out}/eval.md" in out2  # printed by process 0 only
  bench = two_out / f"{name}.json"
  written = bench.stat().st_mtime_ns
  (two_out / "eval.json").unlink()
  p = _evaluate(two, two_out, 2)
  out = _finish(p, 600)
  assert p.returncode == 0, out[-3000:]
  assert bench.stat().st_mtime_ns == written  # kept, not evaluated again
  assert read(two_out, "eval.json") == ref


def _worker(mode, out_dir, num_processes=2, grace_s=5, devices_per_process=2):
  args = [sys.executable, "-m", "minpro_jax.launch_local", f"--num_processes={num_processes}", f"--grace_s={grace_s}"]
  args += [f"--devices_per_process={devices_per_process}"]
  args += ["--module=tests.multihost_worker", "--", mode, str(out_dir)]
  return subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@LAUNCH_GROUP
def test_host_primitives_in_two_processes(tmp_path):
  p = _worker("primitives", tmp_path)
  out = _finish(p, 300)
  assert p.returncode == 0, out[-3000:]
  seen = [json.load(open(tmp_path / f"process_{i}.json")) for i in range(2)]
  rows = [[2.0 * (3 * r + c) for c in range(3)] for r in range(8)]
  for i, s in enumerate(seen):
    assert (s["process_index"], s["process_count"], s["devices"], s["local_devices"]) == (i, 2, 4, 2)
    assert s["fully_addressable"] is False and s["to_host"] == rows
    assert s["sum"] == [2, 1]
    assert s["gathered"] == [0, 10, 20, 30, 40, 50, 60]
    assert s["rewards"] == s["rewards_mine_only"] == [float(k % 2) for k in range(6)]  # graded in halves, gathered
    assert s["stats"]["correct"] == 3 and s["stats"]["graded"] == 6
    assert "processes [1]" in s["check_same_error"]
    assert "micro-batch of 2 samples does not split over the mesh's batch axes (mesh.shape='fsdp=-1' on 4 devices" in (
        s["micro_batch_error"] or ""
    )
    # per-process batches: each made its groups' rows only; the global values are the one-process ones
    assert s["hb_rows"] == [4 * i, 4 * i + 4] and s["hb_shards"] == [2, 2]
    assert s["hb_rewards"] == REWARDS.tolist() and s["hb_doubled"] == (2 * REWARDS).tolist()
    assert s["hb_local_doubled"] == (2 * REWARDS[4 * i : 4 * i + 4]).tolist()
    assert s["hb_advantages"] == np.asarray(group_advantages(jnp.asarray(REWARDS), jnp.arange(8) // 2)).tolist()
    assert s["hb_stats"]["reward"] == {"sum": 3.25, "count": 8, "min": 0.0, "max": 1.0, "mean": 3.25 / 8}
    assert s["hb_stats"]["length"] == {"sum": 3.0, "count": 1, "min": 3.0, "max": 3.0, "mean": 3.0}
    assert (
        "config.mesh.shape: the step's 8 rows do not split over the processes by whole groups" in s["hb_layout_error"]
    )
    assert "process 0's devices hold the rows [4, 8), it owns [0, 4)" in s["hb_layout_error"]
    assert s["odd_prompts_error"].startswith(
        "config.prompts_per_step: 3 prompts do not split into whole groups over the run's 2 processes"
    )
  # the same global batch on both; each process's share is disjoint and together they are the batch, in order
  assert seen[0]["batch_ids"] == seen[1]["batch_ids"]
  assert set(seen[0]["my_ids"]).isdisjoint(seen[1]["my_ids"])
  assert seen[0]["my_ids"] + seen[1]["my_ids"] == seen[0]["batch_ids"]


@LAUNCH_GROUP
def test_per_process_learner_inputs_and_buffer_in_two_processes(tmp_path):
  """Each process keeps its rows of a step's batch; the learner's global arrays are staged from them (each
  process's rows on its own devices); mini-batch j
  (4 rows, all owned by process j) is sliced on the devices and split over all four, so process 1 holds rows of
  process 0's mini-batch; the delay buffer is written and read back per process; dynamic sampling's filled batch
  is assembled from each process's rows of its rounds."""
  p = _worker("process_inputs", tmp_path)
  out = _finish(p, 300)
  assert p.returncode == 0, out[-3000:]
  tokens = np.arange(40).reshape(8, 5)
  for i in range(2):
    s = json.load(open(tmp_path / f"process_{i}.json"))
    assert s["own_first_tokens"] == tokens[4 * i : 4 * i + 4, 0].tolist()  # its own rows only
    assert s["staged_shards"] == [2, 2]  # its 4 rows over its 2 devices: nothing crossed a process
    assert s["staged_local_rows"] == s["own_first_tokens"]
    assert s["policy_version"] == [7] * 8 and s["real_tokens"] == 32  # the [N] vectors the metrics read
    assert s["mini_tokens"] == [tokens[:4].tolist(), tokens[4:].tolist()] and s["mini_sharded"] == [True, True]
    assert s["mini_local_rows"] == [tokens[2 * i : 2 * i + 2, 0].tolist(), tokens[4 + 2 * i : 6 + 2 * i, 0].tolist()]
    assert s["mini_sums"] == [6.0, 22.0] and s["gathered_equal"]
    assert s["order_error"] == "staging_sharding: the devices are not in process order (processes [1, 1, 0, 0])"
    assert s["restored_first_tokens"] == s["own_first_tokens"] and s["restored_equal"]
    assert "ocdbt.process_1" in s["buffer_files"]
    # dynamic sampling: each process's rows of the filled batch from every process's rows of the rounds
    assert s["dynamic"]["shape"] == [4, 5] and all(s["dynamic"]["equal"].values()), s["dynamic"]
  assert os.listdir(tmp_path / "run" / "checkpoints" / "0" / "buffer" / "ocdbt.process_1" / "d")  # process 1's rows


@LAUNCH_GROUP
def test_sampler_outputs_and_score_pass_per_process_in_two_processes(tmp_path):
  """`Sampler.generate(own_rows=True)` (continuous dense and paged, static) and `process_inputs.score` give each process only its
  4 rows (whole groups), equal to its rows of the all-gathered outputs; the log-probs to float round-off (another
  sharding of the same program). Packed, each process packs its own mini-batch: the staged packed rows equal
  `Learner.update_inputs` of each mini-batch, the score pass the chunked `Learner.score`."""
  p = _worker("sampled_rows", tmp_path)
  out = _finish(p, 300)
  assert p.returncode == 0, out[-3000:]
  for i in range(2):
    s = json.load(open(tmp_path / f"process_{i}.json"))
    assert s["rows"] == [4 * i, 4 * i + 4]
    for name in ("continuous", "paged", "static"):
      assert s[name]["len"] == 4 and s[name]["shapes"] == [[4, 6], [4, 64]], (name, s[name])
      assert s[name]["equal"], name
      assert s[name]["group_ids"] == [10 + 2 * i] * 2 + [11 + 2 * i] * 2
    assert s["score_shape"] == [4, 70] and s["score_max_diff"] < 1e-5, s
    # packed: each process packs its own mini-batch as one process would; no host gathers the batch
    assert s["packed_staged"] == "StagedBatch" and s["packed_rows"] == [8, 70], s
    assert s["packed_equal"] and s["packed_score_max_diff"] < 1e-5, s
    assert s["spanning"] == ["RolloutBatch", 8] and s["spanning_score_max_diff"] < 1e-5, s  # gathered, packed whole
    assert s["route_frac"] == s["route_frac_whole"] and 0 < s["route_frac"] < 1


@pytest.mark.xdist_group("multihost_one_device")
def test_one_device_per_process_trains_checkpoints_and_resumes(tmp_path):
  # With one device per process, the learner state's counters (optax's step counts, step, skipped) were put on the
  # mesh with `jax.device_put`, which made arrays orbax could not write: the run died at its first checkpoint.
  ov = tiny_overrides(tmp_path, total_steps=2, **{"mesh.shape": "data=2", "checkpoint.every": 1, "checkpoint.keep": 2})
  r = subprocess.run(_launch_args(ov, devices_per_process=1), env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:]
  assert checkpoint_steps(ov["workdir"]) == [0, 1]
  ov["total_steps"] = 3
  r = subprocess.run(_launch_args(ov, devices_per_process=1), env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:]
  assert "resumed from global step 1 (policy_version 2)" in r.stdout
  assert checkpoint_steps(ov["workdir"]) == [1, 2]
  assert sorted(metrics_records(ov["workdir"])) == [-1, 0, 1, 2, 3]  # the evaluations after SFT (-1) and at the end (3)


def test_one_device_per_process_layout_is_global_and_checked(tmp_path):
  p = _worker("layout", tmp_path, devices_per_process=1)
  out = _finish(p, 300)
  assert p.returncode == 0, out[-3000:]
  for i in range(2):
    s = json.load(open(tmp_path / f"process_{i}.json"))
    assert s["local_devices"] == 1 and s["w_kept"] and s["count_replicated"]
    assert s["placed_error"] is None and s["restored"] == {"w": [0.0, 1.0, 2.0, 3.0], "count": 5}
    assert s["one_device_error"].startswith("config.mesh.shape: leaf ['x'] of the tree is laid out on 1 device(s)")
    assert (s["raw_error"] is None) == s["raw_readable"]  # JAX 0.10.2: not readable, and the check says so
    assert s["raw_readable"] or "has shards that cannot be read" in s["raw_error"]


@LAUNCH_GROUP
def test_launch_local_ends_the_others_when_one_fails(tmp_path):
  t0 = time.time()
  p = _worker("fail", tmp_path)
  out = _finish(p, 120)
  assert p.returncode == 3, out
  assert "process 1 exited with status 3; ending the others" in out
  assert time.time() - t0 < 60  # process 0 (sleeping 120 s) was ended


@LAUNCH_GROUP
def test_launch_local_forwards_sigterm(tmp_path):
  p = _worker("sleep", tmp_path)
  t0 = time.time()
  while not all((tmp_path / f"process_{i}.ready").exists() for i in range(2)):
    assert p.poll() is None and time.time() - t0 < 60
    time.sleep(0.05)
  p.send_signal(signal.SIGTERM)
  out = _finish(p, 60)
  assert p.returncode == 128 + signal.SIGTERM, out
  assert [(tmp_path / f"process_{i}.signal").read_text() for i in range(2)] == [str(int(signal.SIGTERM))] * 2


@LAUNCH_GROUP
def test_launch_local_kills_processes_that_do_not_stop_on_sigterm(tmp_path):
  p = _worker("stubborn", tmp_path, grace_s=2)
  t0 = time.time()
  while not all((tmp_path / f"process_{i}.ready").exists() for i in range(2)):
    assert p.poll() is None and time.time() - t0 < 60
    time.sleep(0.05)
  t1 = time.time()
  p.send_signal(signal.SIGTERM)
  out = _finish(p, 60)
  assert p.returncode == 128 + signal.SIGKILL, out
  assert "still running 2 s after the signal; killing them" in out
  assert time.time() - t1 < 30


@LAUNCH_GROUP
def test_process_rows_split_evenly_and_cover_in_order():
  from minpro_jax.runtime.multihost import process_rows

  for n in range(0, 12):
    for count in range(1, 5):
      parts = [range(n)[process_rows(n, i, count)] for i in range(count)]
      assert [x for part in parts for x in part] == list(range(n))
      assert max(map(len, parts)) - min(map(len, parts)) <= 1
  with pytest.raises(ValueError, match="process index 2 not in"):
    process_rows(4, 2, 2)


@LAUNCH_GROUP
@pytest.mark.parametrize("dead", [1, 0])
def test_a_peer_that_dies_ends_the_survivor_within_seconds_with_one_line(tmp_path, dead):
  """SIGKILL of one process (the coordinator, process 0, too): the other ends within seconds with one line naming
  the process that ended, the newest checkpoint and the command that resumes, not after JAX's shutdown barrier
  (about 90 s, then a native stack dump)."""
  ov = _overrides(tmp_path, "peer") | {"total_steps": 40, "eval.every": 0}
  survivor = 1 - dead
  with _two_processes_past_their_first_checkpoint(ov) as (procs, lines):
    procs[dead].kill()
    t0 = time.time()
    code = procs[survivor].wait(timeout=300)
    took = time.time() - t0
    time.sleep(2.0)  # the streams' last lines (a watcher's line: within ~1 s of the abort)
  out = "".join(lines)
  print(f"process {survivor} ended {took:.1f} s after process {dead} was killed")  # the bound docs/multihost.md gives
  mine = [ln for ln in out.splitlines() if ln.startswith(f"[{survivor}] ")]
  errors = [ln for ln in mine if ln.startswith(f"[{survivor}] error: ")]
  if dead == 0 and code == -signal.SIGABRT:
    # the coordinator killed inside a collective: Gloo aborts the survivor natively before Python runs; its watcher
    # (`abort_line`) writes the line instead, after the native stack dump
    assert took < 30, (code, took, out[-3000:])
  else:
    assert code == 1 and took < 30, (code, took, out[-3000:])
    assert not any("Traceback" in ln for ln in mine), out[-3000:]
  assert len(errors) == 1, out[-3000:]
  assert re.search(
      rf"error: process {dead}( \(the coordinator\))? of the 2-process run ended \(.*\); process {survivor} stops too\. "
      r"the newest run checkpoint is .*/checkpoints/\d+; re-running the same command resumes from it with the same "
      "launch command on every host",
      errors[0],
  ), errors[0]
