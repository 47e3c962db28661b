"""Runs a study's training runs as subprocesses, several at once, and survives being stopped and restarted.

A run is `python -m minpro_jax.train ...` in `<study>/<run>`; its output goes to `<study>/<run>/study.log`.
A run whose `summary.json` exists (the trainer writes it last, after the final evaluation) is done and skipped; any
other run is (re)launched, and the trainer resumes it from its newest checkpoint. A failed run is recorded and the
others go on. SIGINT / SIGTERM stop launching runs and pass SIGTERM to the running ones, which checkpoint after
their current step and exit; a second signal kills them.

A study is a record, frozen at its commit. `<study>/study.json` stores the grid (base, fixed overrides, variants,
the expanded runs), the code commit it was started at, the base config resolved at that commit, and every later
launch (`launches`: the commit each batch of runs was launched at). A finished run is never compared with today's
defaults: a field added to the config since, or a default moved, changes no committed study. A study workdir
holding another grid's runs is refused (`check_study`) unless forced; a study whose runs are not all finished and
whose commit is not the code's is refused too (`check_commit`): extend it from a checkout of its commit (the message
gives the `git worktree` command), or pass `--continue-at-head` to run the rest with today's code (the launch is
recorded with its commit).
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

from minpro_jax.config_lib import files
from minpro_jax.errors import UserError
from minpro_jax.runtime import pidlock
from minpro_jax.study.grid import Grid, Run

STUDY_FILE = "study.json"
RUN_LOG = "study.log"
_STOPPED_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL}


class StudyError(UserError, RuntimeError):
  """The study workdir does not fit the grid (another grid's runs); the message names it and the fix."""


class StudyFileError(StudyError):
  """The workdir's study.json does not read back (truncated, edited by hand); the message names the file, the
  field and the fix."""


# ------------------------------------------------------------------------------------------------ study.json
def study_record(
    grid_spec: str, grid: Grid, runs: Sequence[Run], commit: str | None = None, base_config: Mapping | None = None
) -> dict[str, Any]:
  """What `study.json` stores (JSON): the grid spec, base config, fixed overrides, variants, the expanded runs and
  reporting fields; `commit` (the code's, `code_commit`) and `base_config` (the base config resolved at that
  commit, as a dict) when given. A run's resolved config is `base_config` with the run's overrides."""
  out = {
      "grid": grid_spec,
      "base": grid.base,
      "description": grid.description,
      "fixed": dict(grid.fixed),
      "variants": {k: dict(v) for k, v in grid.variants.items()},
      "comparisons": [list(c) for c in grid.comparisons],
      "panel": grid.panel,
      "runs": [r.to_json() for r in runs],
  }
  if grid.contrasts:  # only where set: a study without contrasts keeps the study.json it had
    out["contrasts"] = [list(c) for c in grid.contrasts]
  if commit is not None:
    out["commit"] = commit
  if base_config is not None:
    out["base_config"] = dict(base_config)
  return json.loads(json.dumps(out, default=str))


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
  """What differs between a stored `study.json` and this grid's record, one phrase each ([] = the same study): the
  base config's path, the fixed overrides, the variants and the runs (the commit is `check_commit`'s)."""
  out = []
  if files.canonical(stored.get("base") or "") != files.canonical(record["base"]):  # a moved path is the same
    out.append(f"base config {stored.get('base')!r} there, {record['base']!r} here")
  f0, f1 = stored.get("fixed", {}), record["fixed"]
  for k in sorted(set(f0) | set(f1)):
    if f0.get(k) != f1.get(k):
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


# ------------------------------------------------------------------------------------------------ commit
def code_commit(repo: str = files.REPO) -> str | None:
  """The commit of the code in `repo` (`git rev-parse HEAD`), with "+dirty" when its tracked files under
  minpro_jax/ or configs/ differ from it; None outside a git checkout (e.g. an installed package)."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "minpro_jax", "configs"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def check_commit(study_dir: str, stored: Mapping[str, Any] | None, commit: str | None, left: int) -> None:
  """Refuses to launch `left` (> 0) runs of a study started at another commit than the code's `commit`: its
  finished runs ran with that commit's code and defaults, and the rest must too (or be launched knowingly with
  `--continue-at-head`, which records the launch's commit).

  Raises:
    StudyError: naming the study's commit, the code's, and the two ways on.
  """
  if stored is None or left == 0:
    return
  was = stored.get("commit")
  if was is not None and commit is not None and was == commit and not was.endswith("+dirty"):
    return
  if was is None and "base_config" in stored:  # started outside a git checkout: nothing to compare
    return
  since = (stored.get("launches") or [{}])[-1].get("commit", was)
  if since is not None and since == commit and not since.endswith("+dirty"):
    return  # continued at this commit before (--continue-at-head)
  where = f"commit {was}" if was else "a commit it did not record (a study from before 2026-12-07)"
  how = (
      f"git worktree add /tmp/study-{was[:8]} {was.removesuffix('+dirty')} and run this command there (with "
      f"--workdir={os.path.abspath(study_dir)})"
      if was
      else "a checkout of the commit that added its study.json (git log -- <workdir>/study.json)"
  )
  raise StudyError(
      f"--workdir={study_dir}: a study of {where}, with {left} run(s) left, and this code is at "
      f"{commit or 'no git commit'}. A study is a record of one code version: extend it from {how}; or pass "
      "--continue-at-head to run the rest with this code (study.json records the launch and its commit)"
  )


def record_launch(stored: Mapping[str, Any], record: Mapping[str, Any], commit: str | None, names: Sequence[str]):
  """`record` to write back to study.json when `names` are launched at `commit`: the stored study's commit and
  base config kept (a new study takes `record`'s), and the launch appended to `launches` when its commit is not
  the study's."""
  out = dict(record)
  if stored is not None:
    for k in ("commit", "base_config", "launches"):
      if k in stored:
        out[k] = stored[k]
      else:
        out.pop(k, None)
    if names and commit != stored.get("commit"):
      out["launches"] = [*stored.get("launches", []), {"commit": commit, "at": _now(), "runs": list(names)}]
  return out


def run_status(run_dir: str) -> str:
  """A run's status from its workdir: "done" (its summary.json exists: skipped), "partial" (started, not finished:
  the trainer resumes it) or "new"."""
  path = os.path.join(run_dir, "summary.json")
  if os.path.isfile(path):
    try:
      with open(path) as f:
        json.load(f)["config"]
      return "done"
    except (OSError, ValueError, KeyError, TypeError):
      return "partial"  # unreadable: the trainer rewrites it when the run is resumed to its end
  started = os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) or os.path.isdir(
      os.path.join(run_dir, "checkpoints")
  )
  return "partial" if started else "new"


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
