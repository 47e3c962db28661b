"""Kill-and-resume equality through the CLI in subprocesses: after SIGKILL mid-run, re-running the same command
continues bit-exactly (metrics of the steps after the restored step equal an uninterrupted run's); SIGTERM saves
a checkpoint and exits with 128 + 15."""

import signal
import subprocess
import time

import pytest
from train_helpers import checkpoint_steps, cli_args, cli_env, metrics_records, tiny_overrides

pytestmark = pytest.mark.slow

STEPS = 6


def _overrides(tmp_path, name):
  return tiny_overrides(
      tmp_path,
      workdir=str(tmp_path / name),
      total_steps=STEPS,
      delay=2,
      **{"checkpoint.every": 1, "checkpoint.keep": 2, "loss.entropy_coef": 0.05, "optimizer.learning_rate": 1e-2},
  )


def _run(args, timeout=400):
  r = subprocess.run(args, capture_output=True, text=True, env=cli_env(), timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def _start_and_signal(args, workdir, sig, when_step):
  p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env())
  t0 = time.time()
  try:
    while not any(s >= when_step for s in checkpoint_steps(workdir)):
      assert p.poll() is None, "run finished before it could be interrupted"
      assert time.time() - t0 < 400
      time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  return p.returncode, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("resume")
  ov = _overrides(tmp, "A")
  _run(cli_args(ov))
  return tmp, metrics_records(ov["workdir"])


def _assert_equal_after(ref, got, restored_step):
  later = [s for s in ref if s > restored_step]
  assert later and later[-1] == STEPS  # includes the final evaluation record
  for s in later:
    assert got[s] == ref[s], f"step {s} differs after resuming from {restored_step}"


def test_sigkill_then_resume_is_bitwise_equal(reference):
  tmp, ref = reference
  ov = _overrides(tmp, "B")
  rc, _ = _start_and_signal(cli_args(ov), ov["workdir"], signal.SIGKILL, when_step=2)
  assert rc == -signal.SIGKILL
  restored = max(checkpoint_steps(ov["workdir"]))
  assert restored < STEPS - 1
  _run(cli_args(ov))
  got = metrics_records(ov["workdir"])
  assert sorted(got) == sorted(ref)
  _assert_equal_after(ref, got, restored)
  assert ref[STEPS - 1]["policy_version"] == (STEPS - 2) * 2


def test_sigterm_checkpoints_exits_143_and_resumes(reference):
  tmp, ref = reference
  ov = _overrides(tmp, "C") | {"log.progress": True}
  rc, err = _start_and_signal(cli_args(ov), ov["workdir"], signal.SIGTERM, when_step=1)
  assert rc == 128 + signal.SIGTERM, err[-2000:]
  stopped = max(checkpoint_steps(ov["workdir"]))
  # the bar ends "RL stopped" at the steps done, and the message has a line of its own, naming the steps left
  lines = err.replace("\r", "\n").splitlines()
  assert any(x.startswith("RL stopped: ") and f"| {stopped + 1}/{STEPS} [" in x for x in lines), err[-2000:]
  want = (
      f"stopped by signal 15 at global step {stopped} (checkpointed); re-run the same command for steps {stopped + 1}"
  )
  assert any(x.startswith("20") and want in x for x in lines), err[-2000:]
  recs = metrics_records(ov["workdir"])
  assert max(recs) == stopped  # the checkpoint covers every logged step: nothing is lost
  _run(cli_args(ov))
  _assert_equal_after(ref, metrics_records(ov["workdir"]), stopped)


def test_metrics_deleted_before_the_resume_come_back_from_the_checkpoint(reference):
  """metrics.jsonl deleted between a stop and its resume: the rows up to the checkpoint (the after-SFT evaluation
  included) come back from it, the later ones are recomputed, and the run ends with the reference's records."""
  tmp, ref = reference
  ov = _overrides(tmp, "D")
  rc, err = _start_and_signal(cli_args(ov), ov["workdir"], signal.SIGTERM, when_step=1)
  assert rc == 128 + signal.SIGTERM, err[-2000:]
  stopped = max(checkpoint_steps(ov["workdir"]))
  before = metrics_records(ov["workdir"], ignored=())
  (tmp / "D" / "metrics.jsonl").unlink()
  r = _run(cli_args(ov))
  assert f"lacked the rows of {stopped + 2} step(s) up to the checkpoint of step {stopped}" in r.stderr
  got = metrics_records(ov["workdir"], ignored=())
  assert sorted(got) == sorted(ref) and all(got[s] == before[s] for s in range(-1, stopped + 1))
  _assert_equal_after(ref, metrics_records(ov["workdir"]), stopped)
