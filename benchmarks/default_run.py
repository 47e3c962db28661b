"""The README's result table against a run of the default config: `make train` as a new user runs it, its held-out
pass@1 after SFT, final and best printed beside the README's rows, with each difference flagged.

  .venv/bin/python benchmarks/default_run.py                      # run configs/default.py afresh (~5-10 min)
  .venv/bin/python benchmarks/default_run.py --workdir=runs/default   # read a finished run's metrics.jsonl
  .venv/bin/python benchmarks/default_run.py --tolerance=1.5      # points of pass@1 a figure may differ by

Without --workdir the default config runs in a new workdir with a cold SFT cache (both under --scratch, default a
temporary folder), as on a fresh clone. The README row compared is the one of this machine's CPU vendor (its first
column names AMD or Intel): XLA's CPU code differs by instruction set, so another CPU type gives other figures
(README "Results"). A difference above --tolerance (the ~1.5 points of sampling noise of 724 graded responses) is
flagged `DIFFERS`; then re-measure and update the README's row (date, CPU, commit). Exit status 0, or 1 when a
figure differs (so a change of the default can gate on it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ("after SFT", "final", "best")


def readme_rows(readme: str) -> dict[str, dict[str, float | None]]:
  """{first column: {"after SFT", "final", "best": pass@1 in %}} of the table under the README's `## Results`
  (a "best" of "= final" is the final figure; a cell without a percentage is None)."""
  section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or not re.search(r"\d %", line):
      continue
    values = [_percent(c) for c in cells[1:]]
    if values[2] is None and "= final" in cells[3]:
      values[2] = values[1]
    rows[cells[0]] = dict(zip(FIGURES, values))
  return rows


def _percent(cell: str) -> float | None:
  m = re.search(r"(-?\d+(?:\.\d+)?) %", cell)
  return float(m.group(1)) if m else None


def run_figures(records: list[dict]) -> dict[str, float | None]:
  """pass@1 in % after SFT (the record of step -1), final (the last record's evaluation) and best (the highest
  evaluation) of a run's metrics.jsonl records (`eval/avg_score`, a fraction)."""
  evals = [(r["step"], r["eval/avg_score"]) for r in records if isinstance(r.get("eval/avg_score"), (int, float))]
  if not evals:
    return dict.fromkeys(FIGURES)
  by_step = dict(evals)
  best = max(v for _, v in evals)
  return {
      "after SFT": 100 * by_step[-1] if -1 in by_step else None,
      "final": 100 * evals[-1][1],
      "best": 100 * best,
  }


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def matching_row(rows: dict[str, dict], cpu: str) -> str | None:
  """The README row of this CPU's vendor (AMD or Intel), or None."""
  vendor = "AMD" if "AMD" in cpu.upper() else "Intel" if "INTEL" in cpu.upper() else None
  return next((name for name in rows if vendor and vendor.lower() in name.lower()), None)


def table(ours: dict, rows: dict, match: str | None, tolerance: float) -> tuple[str, bool]:
  """The Markdown table of this run beside the README's rows, and whether a figure differs from the matching row
  by more than `tolerance` points."""
  fmt = lambda v: "-" if v is None else f"{v:.1f} %"  # noqa: E731
  names = list(rows)
  lines = [
      "| pass@1 | this run | " + " | ".join(names) + " | vs the same CPU type |",
      "|---|" + "---:|" * (len(names) + 2),
  ]
  differs = False
  for fig in FIGURES:
    note = "no README row of this CPU type"
    if match is not None:
      want, got = rows[match][fig], ours[fig]
      delta = None if want is None or got is None else round(got - want, 1) + 0.0  # 0.0, not -0.0
      if delta is None:
        note = "not measured"
      elif abs(delta) > tolerance:
        note, differs = f"DIFFERS by {delta:+.1f} points", True
      else:
        note = f"ok ({delta:+.1f})"
    lines.append(f"| {fig} | {fmt(ours[fig])} | " + " | ".join(fmt(rows[n][fig]) for n in names) + f" | {note} |")
  return "\n".join(lines), differs


def _records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise SystemExit(f"error: --workdir: {path} does not exist; give a finished run's workdir, or leave it out")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _run_default(scratch: str) -> str:
  workdir, cache = os.path.join(scratch, "default"), os.path.join(scratch, "cache")
  cmd = [sys.executable, "-m", "minpro_jax.train", "--config=configs/default.py", f"--config.workdir={workdir}"]
  cmd.append(f"--config.sft.cache_dir={cache}")  # a cold cache, as on a fresh clone
  print("running:", " ".join(cmd), flush=True)
  subprocess.run(cmd, cwd=REPO, check=True)
  return workdir


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", default="", help="a finished run of the default config (default: run one now)")
  ap.add_argument("--scratch", default="", help="where a new run goes (default: a temporary folder)")
  ap.add_argument("--tolerance", type=float, default=1.5, help="points of pass@1 a figure may differ by")
  args = ap.parse_args(argv)
  rows = readme_rows((REPO / "README.md").read_text())
  workdir = args.workdir or _run_default(args.scratch or tempfile.mkdtemp(prefix="minpro_default_"))
  ours = run_figures(_records(workdir))
  cpu = cpu_model()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
  print(f"{datetime.date.today()}, {cpu}, commit {commit.strip() or '?'}, run {workdir}")
  text, differs = table(ours, rows, matching_row(rows, cpu), args.tolerance)
  print(text)
  return 1 if differs else 0


if __name__ == "__main__":
  sys.exit(main())
