"""Command line: `python -m minpro_jax.study --grid=<grid file[:arg]> --workdir=runs/<study> [--jobs=N] [--dry-run]
[--aggregate-only] [--only=<substring>] [--force] [--continue-at-head] [--debug]`.

Runs every run of the grid that is not done (each in `<workdir>/<run name>`, resumable), then writes the
aggregation into the workdir: `summary.json`, `summary.md` and the PNG plots (docs/study.md). Re-running the same
command after a stop skips the finished runs and resumes the others.

  --dry-run         print each run's status and command; write nothing.
  --aggregate-only  only (re)write the aggregation from the finished runs' files (`--grid` optional: without it
                    the run list comes from `<workdir>/study.json`; runs of a damaged study.json that do not read
                    back are left out, with a warning; with it, the grid's description, comparisons, contrasts and
                    panel are also written into study.json, as they change no run).
  --only=S          run only the runs whose name or label contains S (the aggregation still covers every run).
  --force           accept a workdir whose study.json holds another grid's runs (and replace it).
  --continue-at-head  run the unfinished runs of a study started at another commit with this code (study.json
                    records the launch and its commit); without it such a study is refused, naming its commit.
  --debug           show the traceback of a mistake instead of its one-line `error: ...`.
  --compilation-cache=DIR  JAX's persistent compilation cache for the runs (default cache/jax_compilation, beside
                    the SFT cache; '' = none): a grid's runs share most programs.

Exit status: 0 when every selected run is done, 1 when some failed, 2 for a mistake in the flags, the grid or the
workdir (one line `error: ...`), 128 + the signal when stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.path.expanduser("~"), ".cache", "minpro_jax_mpl"))

from minpro_jax.errors import UserError  # noqa: E402
from minpro_jax.study import aggregate, commands, grid, results, runner  # noqa: E402
from minpro_jax.study import plots as study_plots  # noqa: E402

EXIT_USER_ERROR = 2
DEFAULT_COMPILATION_CACHE = os.path.join("cache", "jax_compilation")  # beside the trainer's SFT cache


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m minpro_jax.study", description=__doc__.split("\n\n")[1])
  p.add_argument("--grid", help="grid file[:arg] (e.g. configs/studies/minpro_staleness.py)")
  p.add_argument(
      "--workdir", required=True, help="the study's directory, e.g. runs/my_study (committed ones: results/<study>)"
  )
  p.add_argument("--jobs", type=int, default=1, help="training runs at once (default 1)")
  p.add_argument("--dry-run", action="store_true", help="print the runs and their commands; run nothing")
  p.add_argument("--aggregate-only", action="store_true", help="only write the aggregation of the finished runs")
  p.add_argument("--only", default="", help="run only the runs whose name or label contains this")
  p.add_argument("--force", action="store_true", help="accept a workdir of another grid (replaces its study.json)")
  p.add_argument(
      "--continue-at-head",
      action="store_true",
      help="run the unfinished runs of a study started at another commit with this code (recorded in study.json)",
  )
  p.add_argument("--debug", action="store_true", help="show the traceback of a mistake in the flags or files")
  p.add_argument("--interval", choices=("t", "bootstrap"), default="t", help="the confidence interval (default t)")
  p.add_argument(
      "--compilation-cache",
      default=DEFAULT_COMPILATION_CACHE,
      help=f"JAX's persistent compilation cache for the runs (default {DEFAULT_COMPILATION_CACHE}; '' = none)",
  )
  return p


def child_env(compilation_cache: str) -> dict[str, str]:
  """The runs' environment: this one, plus JAX's persistent compilation cache in `compilation_cache` (unless
  empty or JAX_COMPILATION_CACHE_DIR is set already): the runs of a grid compile the same sampler, evaluation and
  SFT programs, and a cached program is the same executable, so the results do not change."""
  env = dict(os.environ)
  if compilation_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(compilation_cache)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  return env


def write_aggregation(study_dir: str, record: dict, interval: str = "t", plots: bool = True) -> list[str]:
  """Aggregates the runs of `record` (a study.json) in `study_dir`; writes summary.json/.md and (`plots`) the PNG
  plots; returns the paths written."""
  runs = [grid.Run.from_json(r) for r in record["runs"]]
  comparisons = [tuple(c) for c in record.get("comparisons", ())]
  contrasts = [tuple(c) for c in record.get("contrasts", ())]
  extra = {"grid": record.get("grid"), "description": record.get("description", ""), "base": record.get("base")}
  result = aggregate.aggregate(study_dir, runs, comparisons, method=interval, extra=extra, contrasts=contrasts)
  paths = aggregate.write_summary(study_dir, result)
  if plots and result["runs"]:
    paths += study_plots.write_plots(study_dir, result, runs, record.get("panel"))
  return paths


def _check_flags(args, study_dir: str) -> None:
  """Refuses, naming the flag, an empty --workdir (the runs would go into the current directory), a training run's
  workdir (its files beside the study's), and --jobs < 1, before anything is read or written."""
  if not args.workdir.strip():
    raise runner.StudyError("--workdir: empty; give the study's own directory, e.g. --workdir=runs/my_study")
  if os.path.exists(study_dir) and not os.path.isdir(study_dir):
    raise runner.StudyError(f"--workdir={args.workdir}: is a file, not a directory; give the study its own directory")
  is_run = all(os.path.exists(os.path.join(study_dir, f)) for f in ("config.json", "checkpoints"))
  if is_run and not os.path.exists(os.path.join(study_dir, runner.STUDY_FILE)):
    raise runner.StudyError(
        f"--workdir={args.workdir}: is the workdir of a training run (config.json, checkpoints/), not a study's; "
        "give the study its own directory, e.g. --workdir=runs/my_study"
    )
  if args.jobs < 1:
    raise runner.StudyError(f"--jobs={args.jobs}: must be >= 1 (training runs at once)")


# what a grid may change without changing its runs ("contrasts" is in a record only where the grid sets some)
REPORTING_FIELDS = ("description", "comparisons", "contrasts", "panel")


def _update_reporting_fields(study_dir: str, record: dict) -> None:
  """Copies the grid's `REPORTING_FIELDS` into the study's study.json (when there is one and they differ; a field
  the grid's record lacks is dropped), so that `--aggregate-only` without `--grid` and the committed-results test
  aggregate as this command does."""
  stored = runner.read_study(study_dir)
  if stored is None:
    return
  updated = {k: v for k, v in stored.items() if k not in REPORTING_FIELDS or k in record}
  updated.update({k: record[k] for k in REPORTING_FIELDS if k in record})
  if updated != stored:
    runner.write_study(study_dir, updated)
    changed = ", ".join(k for k in REPORTING_FIELDS if stored.get(k) != record.get(k))
    print(f"updated {runner.STUDY_FILE}: the grid's {changed}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
  """Runs the CLI; returns the exit status (see the module docstring)."""
  args = _parser().parse_args(argv)
  study_dir = os.path.abspath(results.resolve(args.workdir))  # runs/<study> of record: results/<study>
  try:
    _check_flags(args, study_dir)
    if args.aggregate_only and not args.grid:
      record, skipped = runner.read_study_runs(study_dir)
      if record is None:
        raise runner.StudyError(f"--workdir={args.workdir}: no {runner.STUDY_FILE} there; pass --grid as well")
      for why in skipped:  # report what can be reported: the runs that read back
        print(f"warning: {why}; that run is left out of the aggregation", file=sys.stderr)
      return _aggregate(study_dir, record, args.interval)
    if not args.grid:
      raise grid.GridError("--grid: required (a grid file such as configs/studies/smoke.py)")
    if not args.force and not args.aggregate_only:
      runner.read_study(study_dir)  # a damaged study.json is named before the runs' configs are validated
    g = grid.load_grid(args.grid)
    try:
      planned = commands.plan(g, study_dir, validate=not args.aggregate_only)
    except grid.GridError as e:  # name the grid file as well as its field
      raise grid.GridError(f"--grid={args.grid}: {e}") from e
    commit = runner.code_commit()
    base_config = None if args.aggregate_only else commands.resolved_base(g)
    record = runner.study_record(args.grid, g, [r for r, _, _ in planned], commit, base_config)
    try:
      runner.check_study(study_dir, record, force=args.force)
    except runner.StudyFileError as e:
      if not args.aggregate_only:
        raise
      print(f"warning: {e}; aggregating the runs of --grid={args.grid}", file=sys.stderr)
    else:
      if args.aggregate_only:
        _update_reporting_fields(study_dir, record)
    if args.aggregate_only:
      return _aggregate(study_dir, record, args.interval)
    selected = [p for p in planned if args.only in p[0].name or args.only in p[0].label]
    if not selected:
      raise grid.GridError(f"--only={args.only}: no run's name or label contains it (e.g. {planned[0][0].name})")
    status = {r.name: runner.run_status(os.path.join(study_dir, r.name)) for r, _, _ in selected}
    stored = None if args.force else runner.read_study(study_dir)
    left = [name for name, st in status.items() if st != "done"]
    if args.dry_run:
      return _dry_run(args, selected, status, len(planned), stored, commit)
    if not args.continue_at_head:
      runner.check_commit(study_dir, stored, commit, len(left))
    lock = runner.lock_study(study_dir)  # noqa: F841 - held until this process exits
    runner.write_study(study_dir, runner.record_launch(stored, record, commit, left))
  except UserError as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR

  env = child_env(args.compilation_cache)
  ex = runner.Executor(jobs=args.jobs, env=env, study_log=os.path.join(study_dir, runner.RUN_LOG))
  done = [r.name for r, _, _ in selected if status[r.name] == "done"]
  for name in done:
    ex.say(f"skip     {name} (finished)")
  jobs = [runner.Job(r.name, argv, os.path.join(study_dir, r.name)) for r, argv, _ in selected if r.name not in done]
  ex.say(f"study {args.workdir}: {len(selected)} run(s) selected, {len(done)} finished, {len(jobs)} to run")
  outcomes = ex.run(jobs)
  if ex.stop_signal is not None:
    left = [o.name for o in outcomes if o.status != "done"]
    ex.say(f"stopped by signal {ex.stop_signal}; {len(left)} run(s) left: re-run the same command to continue")
    return 128 + ex.stop_signal
  failed = [o for o in outcomes if o.status == "failed"]
  for o in failed:
    ex.say(f"FAILED   {o.name}: {o.message}")
  ex.say(
      f"{len(outcomes) - len(failed)} of {len(outcomes)} run(s) done" + (f", {len(failed)} failed" if failed else "")
  )
  code = _aggregate(study_dir, record, args.interval)
  return 1 if failed else code


def _aggregate(study_dir: str, record: dict, interval: str) -> int:
  try:
    paths = write_aggregation(study_dir, record, interval)
  except ValueError as e:
    print(f"error: aggregation: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  for p in paths:
    print(f"wrote {p}")
  return 0


def _dry_run(args, selected, status: dict, total: int, stored: dict | None, commit: str | None) -> int:
  counts = {s: list(status.values()).count(s) for s in ("done", "partial", "new")}
  print(f"study {args.workdir}: grid {args.grid}, {total} run(s), {len(selected)} selected")
  for run, argv, _ in selected:
    print(f"{status[run.name]:8s} {run.name}  [{run.label}]")
    print(f"         {shlex.join(argv)}")
  print(
      f"{counts['done']} done (skipped), {counts['partial']} partial (resumed), {counts['new']} new; dry run: "
      "nothing was written"
  )
  if stored is not None and not args.continue_at_head:
    try:
      runner.check_commit(args.workdir, stored, commit, counts["partial"] + counts["new"])
    except runner.StudyError as e:
      print(f"note: a real run would refuse: {e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
