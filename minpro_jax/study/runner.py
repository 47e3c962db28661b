"""Runs a study's training runs as subprocesses, several at once, and survives being stopped and restarted.

A run is `python -m minpro_jax.train ...` in `<study>/<run>`; its output goes to `<study>/<run>/study.log`.
A run whose `summary.json` exists (the trainer writes it last, after the final evaluation) for the same config is
done and skipped; any other run is (re)launched, and the trainer resumes it from its newest checkpoint. A failed
run is recorded and the others go on. SIGINT / SIGTERM stop launching runs and pass SIGTERM to the running ones,
which checkpoint after their current step and exit; a second signal kills them.

`<study>/study.json` stores the grid's expanded run list; a study workdir holding another grid's list is refused
(`check_study`) unless forced.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minpro_jax import pidlock
from minpro_jax.config_lib import files
from minpro_jax.config_lib.defaults import ISSUE_57_LOSS_FIELDS
from minpro_jax.errors import UserError
from minpro_jax.study.grid import Grid, Run

STUDY_FILE = "study.json"
RUN_LOG = "study.log"
# config fields that do not change a finished run's result: a summary.json differing only in them is still done
IGNORED_FIELDS = ("workdir", "log", "checkpoint")
# sampler execution modes and layouts that give the same responses token for token (tests/test_sampler_continuous.py,
# tests/test_inference_mesh.py): a run finished under another is not stale
SAME_SAMPLES_FIELDS = (
    "sampling.continuous",
    "sampling.decode_rows",
    "sampling.mesh",
    "sampling.kv_cache",  # and its pool (tests/test_paged_sampler.py, tests/test_sampler_setup.py)
    "sampling.page_size",
    "sampling.num_pages",
)
# Config fields added after studies were run, each with the value that keeps the behaviour from before it existed:
# a summary.json without the field ran with that value (a field missing here and from a summary.json differs).
ADDED_FIELDS = {
    "mipu.mode": "gap",
    "mipu.random_rate": None,
    "mipu.match_rate_of": "",
    "mipu.ground_truth": False,
    "optimizer.lr_decay_on_length_surge": False,
    "optimizer.lr_decay_baseline_steps": 50,
    "optimizer.lr_decay_surge_ratio": 3.0,
    "optimizer.lr_decay_period_factor": 1.8,
    "optimizer.lr_decay_factor": 0.5,
    "optimizer.lr_decay_min_ratio": 0.1,
    "sampling.fp8_weight_scale": "tensor",  # the defaults of minpro_jax.run_config.FP8_OPTIONS
    "sampling.fp8_format": "e4m3",
    "sampling.fp8_activations": "token",
    "loss.rollout_mis_bounds": None,
    "sft.target": "answer",
    "sampling.drop_equal_reward_groups": False,
    "sampling.max_sampling_rounds": 4,
    "reward.mask_truncated": False,
    "learner.row_tokens": 0,
    "sft.row_tokens": 0,
    "mipu.statistic": "t_post",
    "mipu.tolerance": "fixed",
    "mipu.calibration_draws": 8,
    "mipu.calibration_z": 2.0,
    "sampling.devices": 0,
    "sampling.overlap": True,
    "num_epochs": 1,  # issue 57: one pass over each released batch, the VCPO step off, the new loss fields unset
    "learner.ess_step": False,
    **{f"loss.{field}": None for field in ISSUE_57_LOSS_FIELDS},
}
# Defaults of the base config that changed after studies were run, each with its value before: a stored study.json
# whose fixed fields lack one ran with that value, so a grid that now pins it there is the same study (its runs'
# configs are the same). Pinning any other value, or unpinning, is another study.
MOVED_DEFAULTS = {
    "sampling.kv_cache": "dense",  # "auto" (paged with the continuous sampler) since 2026-12-06
}
_ABSENT = object()
_STOPPED_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL}


class StudyError(UserError, RuntimeError):
  """The study workdir does not fit the grid (another grid's runs); the message names it and the fix."""


class StudyFileError(StudyError):
  """The workdir's study.json does not read back (truncated, edited by hand); the message names the file, the
  field and the fix."""


# ------------------------------------------------------------------------------------------------ study.json
def study_record(grid_spec: str, grid: Grid, runs: Sequence[Run]) -> dict[str, Any]:
  """What `study.json` stores: the grid spec, base config, fixed overrides and the expanded runs (JSON)."""
  return json.loads(
      json.dumps(
          {
              "grid": grid_spec,
              "base": grid.base,
              "description": grid.description,
              "fixed": dict(grid.fixed),
              "variants": {k: dict(v) for k, v in grid.variants.items()},
              "comparisons": [list(c) for c in grid.comparisons],
              "panel": grid.panel,
              "runs": [r.to_json() for r in runs],
          }
      )
  )


def read_study(study_dir: str) -> dict[str, Any] | None:
  """`study_dir/study.json`, or None when there is none.

  Raises:
    StudyFileError: the file is no JSON object with a list of runs, or a run lacks a field (`read_study_runs`); the
      message names the file, the field and the fix.
  """
  record, bad = read_study_runs(study_dir)
  if bad:
    raise StudyFileError(f"{bad[0]}; {_STUDY_FIX}")
  return record


_STUDY_FIX = (
    "the file was truncated or edited by hand: restore it (e.g. from git), or run the study command with its --grid "
    "and --force to write it anew"
)


def read_study_runs(study_dir: str) -> tuple[dict[str, Any] | None, list[str]]:
  """(`study_dir/study.json` without the runs that do not read back, one phrase per run left out); (None, []) when
  there is no such file. For `--aggregate-only`, which reports what it can.

  Raises:
    StudyFileError: the file is not a JSON object with a list "runs" (naming the file and the fix).
  """
  path = os.path.join(study_dir, STUDY_FILE)
  if not os.path.isfile(path):
    return None, []
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise StudyFileError(f"{path}: not a readable study file ({type(e).__name__}: {e}); {_STUDY_FIX}") from None
  if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
    raise StudyFileError(f'{path}: holds no list "runs" (got {type(record).__name__}); {_STUDY_FIX}')
  good, bad = [], []
  for i, r in enumerate(record["runs"]):
    try:
      Run.from_json(r)
      good.append(r)
    except KeyError as e:
      bad.append(f"{path}: runs[{i}].{e.args[0]}: missing")
    except (TypeError, ValueError, AttributeError) as e:
      bad.append(f"{path}: runs[{i}]: not a run ({type(e).__name__}: {e})")
  return {**record, "runs": good}, bad


def study_differences(stored: Mapping[str, Any], record: Mapping[str, Any]) -> list[str]:
  """What differs between a stored `study.json` and this grid's record, one phrase each ([] = the same study). A
  fixed field the stored grid lacks that this one pins to its `MOVED_DEFAULTS` value is no difference."""
  out = []
  if files.canonical(stored.get("base") or "") != files.canonical(record["base"]):  # a moved path is the same
    out.append(f"base config {stored.get('base')!r} there, {record['base']!r} here")
  f0, f1 = stored.get("fixed", {}), record["fixed"]
  for k in sorted(set(f0) | set(f1)):
    pins_old_default = k not in f0 and k in f1 and MOVED_DEFAULTS.get(k, _ABSENT) == f1[k]
    if f0.get(k) != f1.get(k) and not pins_old_default:
      out.append(f"fixed {k}: {f0.get(k, '(unset)')!r} there, {f1.get(k, '(unset)')!r} here")
  v0, v1 = stored.get("variants", {}), record.get("variants", {})
  for k in sorted(set(v0) | set(v1)):
    if v0.get(k) != v1.get(k):
      out.append(f"variant {k}: {v0.get(k, '(none)')!r} there, {v1.get(k, '(none)')!r} here")
  r0 = {r["name"]: r for r in stored.get("runs", [])}
  r1 = {r["name"]: r for r in record["runs"]}
  only_there, only_here = [n for n in r0 if n not in r1], [n for n in r1 if n not in r0]
  if only_there:
    out.append(
        f"{len(only_there)} run(s) only there ({', '.join(only_there[:3])}{', ...' if len(only_there) > 3 else ''})"
    )
  if only_here:
    out.append(f"{len(only_here)} run(s) only here ({', '.join(only_here[:3])}{', ...' if len(only_here) > 3 else ''})")
  changed = [n for n in r1 if n in r0 and r0[n] != r1[n]]
  if changed:
    out.append(f"run(s) with other overrides: {', '.join(changed[:3])}")
  return out


def check_study(study_dir: str, record: Mapping[str, Any], force: bool = False) -> None:
  """Refuses a study workdir whose `study.json` holds another grid's runs (unless `force`).

  Raises:
    StudyError: naming the workdir, the stored grid and what differs; or a study.json that does not read back.
  """
  if force:
    return
  stored = read_study(study_dir)
  if stored is None:
    return
  diff = study_differences(stored, record)
  if diff:
    raise StudyError(
        f"--workdir={study_dir}: it holds the study of --grid={stored.get('grid')} with other runs ("
        + "; ".join(diff)
        + "); use another --workdir, or pass --force to replace its study.json (finished runs whose config "
        "changed are then relaunched, and the trainer refuses to resume a checkpoint of other settings)"
    )


LOCK_FILE = ".runner.lock"


def lock_study(study_dir: str):
  """Takes the study workdir's runner lock (an exclusive `flock` on `study_dir/.runner.lock`, released when this
  process exits), so that two runners never train one run at once; returns the open lock file (keep it).

  Raises:
    StudyError: another runner holds it (its pid named): wait for it to stop, or stop it first.
  """
  os.makedirs(study_dir, exist_ok=True)
  try:
    return pidlock.acquire(os.path.join(study_dir, LOCK_FILE))
  except pidlock.HeldError as e:
    raise StudyError(
        f"--workdir={study_dir}: another study runner (pid {e.holder}) is using it; wait until it has stopped "
        "(after a signal it first lets its runs checkpoint), then run this again"
    ) from None


def write_study(study_dir: str, record: Mapping[str, Any]) -> str:
  """Writes `record` to `study_dir/study.json` (atomically); returns the path."""
  os.makedirs(study_dir, exist_ok=True)
  path = os.path.join(study_dir, STUDY_FILE)
  tmp = path + f".tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=2)
    f.write("\n")
  os.replace(tmp, path)
  return path


# ------------------------------------------------------------------------------------------------ run status
def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _normalized(d: Mapping[str, Any]) -> dict[str, Any]:
  """The dotted fields of a config dict as JSON values, without `IGNORED_FIELDS`."""
  flat = _flat(json.loads(json.dumps(dict(d), default=str)))
  return {k: v for k, v in flat.items() if k.split(".")[0] not in IGNORED_FIELDS and k not in SAME_SAMPLES_FIELDS}


def config_differences(stored: Mapping[str, Any], want: Mapping[str, Any], set_by_grid=None) -> list[str]:
  """What differs between a finished run's config (`stored`, its summary.json) and the config the grid gives it
  now (`want`), one entry per dotted field, sorted (`IGNORED_FIELDS` left out; a field `stored` lacks counts
  with its `ADDED_FIELDS` value).

  Args:
    set_by_grid: the fields the grid sets for this run (its `--config.FIELD` overrides); None = report bare field
      names. With it, a field the grid does not set is a default of the base config that moved, reported as
      "default F changed from X to Y since this run finished"; one it sets as "F: X then, Y now".
  """
  a, b = _normalized(stored), _normalized(want)
  out = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k, ADDED_FIELDS.get(k, _ABSENT)), b.get(k, _ABSENT)
    if x == y:
      continue
    if set_by_grid is None:
      out.append(k)
      continue
    show = lambda v: "(absent)" if v is _ABSENT else repr(v)  # noqa: E731
    if any(k == f or k.startswith(f + ".") for f in set_by_grid):
      out.append(f"{k}: {show(x)} then, {show(y)} now")
    else:
      out.append(f"default {k} changed from {show(x)} to {show(y)} since this run finished")
  return out


def run_status(run_dir: str, config: Any = None, set_by_grid=None) -> tuple[str, list[str]]:
  """(status, differences) of a run's workdir. status: "done" (summary.json of the same config: skipped),
  "stale" (summary.json of another config; `config_differences` lists what differs), "partial" (started, not
  finished: the trainer resumes it) or "new".

  Args:
    run_dir: the run's workdir.
    config: the run's expected config (a ConfigDict or dict); None = any summary.json counts as done.
    set_by_grid: the fields the grid sets for this run (see `config_differences`).
  """
  path = os.path.join(run_dir, "summary.json")
  if os.path.isfile(path):
    try:
      with open(path) as f:
        stored = json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
      return "partial", []  # unreadable: the trainer rewrites it when the run is resumed to its end
    if config is None:
      return "done", []
    want = config.to_dict() if hasattr(config, "to_dict") else config
    diff = config_differences(stored, want, set_by_grid)
    return ("stale", diff) if diff else ("done", [])
  started = os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) or os.path.isdir(
      os.path.join(run_dir, "checkpoints")
  )
  return ("partial" if started else "new"), []


def check_not_stale(study_dir: str, status: Mapping[str, tuple[str, list[str]]]) -> None:
  """Refuses to run when a run finished with another config: relaunching it would only repeat its final evaluation
  (the trainer resumes its last checkpoint, and does not check every field, e.g. the learning rate).

  Raises:
    StudyError: naming the runs, the fields that differ and the fix (delete the run directories).
  """
  stale = {name: diff for name, (st, diff) in status.items() if st == "stale"}
  moved = sorted({d for diff in stale.values() for d in diff if d.startswith("default ")})
  if stale and len(moved) == sum(map(len, stale.values())):  # only the base config's defaults moved
    fields = [m.split()[1] for m in moved]
    pins = ", ".join(dict.fromkeys(f"{m.split()[1]}={m.split(' from ')[1].split(' to ')[0]}" for m in moved))
    raise StudyError(
        f"--workdir={study_dir}: {len(stale)} finished run(s) ran with other defaults of the base config than "
        f"today's ({'; '.join(dict.fromkeys(m.replace(' since this run finished', '') for m in moved))}); the "
        f"grid did not change. To keep them, pin the old values in the grid's fixed overrides ({pins}) and re-run "
        "with --force (finished runs whose config then matches are skipped); to rerun them with the new "
        f"default{'s' if len(set(fields)) > 1 else ''}, delete those run directories"
    )
  if stale:
    shown = "; ".join(f"{n} ({', '.join(d[:4])}{', ...' if len(d) > 4 else ''})" for n, d in list(stale.items())[:3])
    raise StudyError(
        f"--workdir={study_dir}: {len(stale)} run(s) finished with another config than the grid gives: {shown}"
        f"{'; ...' if len(stale) > 3 else ''}. Delete those run directories to run them again with this grid, "
        "or restore the grid they ran with"
    )


# ------------------------------------------------------------------------------------------------ execution
@dataclasses.dataclass(frozen=True)
class Job:
  """One subprocess: `argv` run in the current directory, its output appended to `run_dir/study.log`."""

  name: str
  argv: Sequence[str]
  run_dir: str


@dataclasses.dataclass
class Outcome:
  """How a job ended: status "done" | "failed" | "stopped" | "not started", exit code, seconds, one-line reason."""

  name: str
  status: str
  returncode: int | None = None
  seconds: float = 0.0
  message: str = ""


def _load_prctl():
  try:
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl
  except (OSError, AttributeError):
    return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None  # resolved here, not in the forked child


def _die_with_parent() -> None:
  # the child gets SIGTERM if the runner dies (even by SIGKILL), so no orphan trains on unseen
  _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _last_error(log_path: str) -> str:
  """The log's last "error:" line, else its last non-empty line."""
  try:
    with open(log_path, errors="replace") as f:
      lines = [ln.strip() for ln in f.readlines()[-200:] if ln.strip() and not ln.startswith("=== ")]
  except OSError:
    return ""
  errs = [ln for ln in lines if ln.startswith("error:")]
  return (errs or lines or [""])[-1][:400]


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


class Executor:
  """Runs jobs, at most `jobs` at once, until all ended or a signal stopped them.

  Args:
    jobs: the number of subprocesses at once (>= 1).
    env: the subprocesses' environment (default: this process's).
    log: called with each progress line (default: print to stdout).
    study_log: a file that gets the same lines, timestamped (None = none).
    poll_s: seconds between polls of the running subprocesses.
  """

  def __init__(
      self,
      jobs: int = 1,
      env: Mapping[str, str] | None = None,
      log: Callable[[str], None] | None = None,
      study_log: str | None = None,
      poll_s: float = 0.2,
  ):
    if jobs < 1:
      raise StudyError(f"--jobs={jobs}: must be >= 1")
    self.jobs, self.env, self.poll_s = jobs, dict(env) if env is not None else None, poll_s
    self._log, self.study_log = log or (lambda s: print(s, flush=True)), study_log
    self.stop_signal: int | None = None
    self._signals = 0

  def say(self, line: str) -> None:
    self._log(line)
    if self.study_log:
      with open(self.study_log, "a") as f:
        f.write(f"{_now()} {line}\n")

  def _handler(self, signum, frame) -> None:
    del frame
    self._signals += 1
    self.stop_signal = self.stop_signal or signum

  def run(self, jobs: Sequence[Job]) -> list[Outcome]:
    """Runs `jobs` in order; returns their outcomes in order ("not started" for those a signal kept back).

    SIGINT / SIGTERM while it runs: no job starts any more and the running ones get SIGTERM (they checkpoint and
    exit); a second signal SIGKILLs them. `stop_signal` then holds the first signal.
    """
    previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
    pending = list(jobs)
    active: dict[str, tuple[subprocess.Popen, Any, float, Job]] = {}
    outcomes: dict[str, Outcome] = {}
    forwarded = killed = False
    try:
      while pending or active:
        if self.stop_signal is not None and not forwarded:
          forwarded = True
          self.say(f"signal {self.stop_signal}: stopping {len(active)} running run(s) (they checkpoint first)")
          for p, *_ in active.values():
            _send(p, signal.SIGTERM)
        if self._signals >= 2 and not killed:
          killed = True
          self.say("second signal: killing the running runs")
          for p, *_ in active.values():
            _send(p, signal.SIGKILL)
        while pending and len(active) < self.jobs and self.stop_signal is None:
          job = pending.pop(0)
          active[job.name] = self._start(job)
        for name, (p, logf, t0, job) in list(active.items()):
          rc = p.poll()
          if rc is None:
            continue
          logf.write(f"=== {_now()} exit {rc} after {time.time() - t0:.0f} s\n")
          logf.close()
          del active[name]
          outcomes[name] = self._outcome(job, rc, time.time() - t0, stopping=self.stop_signal is not None)
          o = outcomes[name]
          self.say(f"{o.status:8s} {name} (exit {rc}, {o.seconds:.0f} s){': ' + o.message if o.message else ''}")
        if self.stop_signal is not None and not active:
          break
        time.sleep(self.poll_s)
    finally:
      for p, logf, _, _ in active.values():  # an exception in this loop: leave no child behind
        _send(p, signal.SIGKILL)
        p.wait()
        logf.close()
      for s, h in previous.items():
        signal.signal(s, h)
    return [outcomes.get(j.name) or Outcome(j.name, "not started") for j in jobs]

  def _start(self, job: Job):
    os.makedirs(job.run_dir, exist_ok=True)
    logf = open(os.path.join(job.run_dir, RUN_LOG), "a")
    logf.write(f"=== {_now()} launch: {shlex.join(job.argv)}\n")
    logf.flush()
    kw = {"preexec_fn": _die_with_parent} if _PRCTL is not None else {}
    p = subprocess.Popen(
        list(job.argv), stdout=logf, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, **kw
    )
    self.say(f"launch   {job.name} (pid {p.pid})")
    return p, logf, time.time(), job

  def _outcome(self, job: Job, rc: int, seconds: float, stopping: bool) -> Outcome:
    log = os.path.join(job.run_dir, RUN_LOG)
    if rc == 0 and os.path.isfile(os.path.join(job.run_dir, "summary.json")):
      return Outcome(job.name, "done", rc, seconds)
    if stopping and rc in _STOPPED_CODES:
      return Outcome(job.name, "stopped", rc, seconds, "checkpointed; a restart resumes it")
    if rc == 0:
      return Outcome(job.name, "failed", rc, seconds, f"exited 0 without writing summary.json; see {log}")
    return Outcome(job.name, "failed", rc, seconds, f"{_last_error(log)} (see {log})")


def _send(p: subprocess.Popen, sig: int) -> None:
  try:
    p.send_signal(sig)
  except ProcessLookupError:
    pass
