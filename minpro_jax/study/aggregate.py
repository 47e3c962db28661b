"""A study's numbers, from each run's `summary.json` and `metrics.jsonl` alone.

The held-out curve of a run: the macro `eval/pass@1` (avg@n) of `metrics.jsonl` at each evaluation's policy step.
The evaluation logged at global step s (after its updates) is the policy of s + 1 global steps; the one after the
warm start is logged at step -1 (policy step 0) and the final one at total_steps, so an evaluation's policy step
is min(step + 1, total_steps).

With a delay d, no update happens before global step d, so every evaluation at policy steps 0..d is of the initial
policy: repeated draws of the same number, whose spread is only the evaluation's sampling noise. The learning
curve therefore starts at the initial evaluation and keeps the evaluations of updated policies only, on the
x-axis "global steps with updates" = policy step - d (which aligns the delays of a grid that gives each delay the
same number of update steps):

  learning curve  [(0, initial)] + [(p - d, pass@1) for each evaluation at policy step p > d].

Per run:
  initial       the evaluation after the warm start (policy step 0);
  best          the trainer's selected best evaluation (`summary.json` "best": the highest of all evaluations, the
                initial one and its repeats before the first update included, so it is biased up by the maximum
                of d / eval.every noise draws at delay d; also selected on the held-out set itself);
  peak          the highest evaluation of an updated policy (the initial value when there is none): the
                selected peak without the pre-update draws;
  final         the evaluation after the last step;
  auc           trapezoid area under the learning curve divided by its span: the time-averaged held-out pass@1
                over the update steps;
  largest_drop  the largest fall between consecutive points of the learning curve (0 when it never falls);
  fall_rate     the fraction of consecutive points of the learning curve where it falls (MIPU's "monotonic"
                claim: how often held-out J(mu) falls from one evaluation to the next);
  below_initial whether the learning curve ever falls below the initial value.
Where the runs log them (MIPU):
  rollback_rate the rolled-back share of the Step-2 checks (`summary.json` "mipu"); None without checks;
  k3_mean       the mean over steps of the sampler-learner K3 (`sampler_learner/mismatch_k3`);
  rollbacks     [[global step, 1 if rolled back]] per check (`mipu/accepted`), for the rate over steps.
And the training dynamics of `minpro_jax.study.dynamics` (steps to collapse, train-accuracy AUC, |log ratio| and
the weights' ESS by response position).

Per cell (over its seeds): the mean and a 95 % t-interval of each figure (`mean_ci`), and how many seeds fell
below their initial value. Paired differences (`paired_differences`): reference minus cell on the seeds both ran
from the same warm start, with the t-interval of the differences. The same seed gives the same tokenizer, warm
start and initial evaluation on one CPU type, but not across CPU types (XLA:CPU's code differs between Intel and
AMD machines), so a grid continued on another machine has, for one seed, runs from different warm starts: those
pairs are not paired (`warm_start`: the SFT's final loss, or the initial evaluation without SFT) and are counted
apart.

Contrasts (`contrasts.difference_in_differences`, a grid's `contrasts`): (cell - reference at d) - (cell - reference
at the base value of another field), per seed on the seeds whose four runs share a warm start, e.g. the part of
MinPRO's gap to GRPO that staleness adds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from minpro_jax.study.contrasts import contrasts_markdown, difference_in_differences
from minpro_jax.study.dynamics import cell_dynamics, curve_auc, dynamics_markdown, run_dynamics
from minpro_jax.study.grid import Run, short_names
from minpro_jax.study.intervals import LEVEL, Interval, format_points, mean_ci

METRICS = ("best", "peak", "final", "auc", "largest_drop", "fall_rate", "initial")  # per cell
PAIRED_METRICS = ("best", "peak", "final", "auc", "largest_drop")  # the initial value is the same on a shared seed
OPTIONAL_METRICS = ("rollback_rate", "k3_mean", "train_auc")  # per cell where every finished run of it has them
K3_KEY = "sampler_learner/mismatch_k3"
EVAL_KEY = "eval/pass@1"


# ------------------------------------------------------------------------------------------------ one run
def eval_curve(records: Sequence[Mapping[str, Any]], total_steps: int) -> list[tuple[int, float]]:
  """The held-out pass@1 curve [(policy step, pass@1)] of a run's `metrics.jsonl` records, by step.

  Raises:
    ValueError: two evaluations of one policy step (a metrics file of two runs).
  """
  out: dict[int, float] = {}
  for r in records:
    v = r.get(EVAL_KEY)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
      continue
    step = min(int(r["step"]) + 1, total_steps)
    if step in out:
      raise ValueError(f"metrics.jsonl: two evaluations at policy step {step}; the file mixes two runs")
    out[step] = float(v)
  return sorted(out.items())


def largest_drop(curve: Sequence[tuple[int, float]]) -> float:
  """max over consecutive evaluations of (earlier - later), at least 0 (0 for a curve that never falls)."""
  ys = [y for _, y in curve]
  return max([0.0] + [a - b for a, b in zip(ys, ys[1:])])


def fall_rate(curve: Sequence[tuple[int, float]]) -> float:
  """The fraction of consecutive points of `curve` where it strictly falls (0 for fewer than two points)."""
  ys = [y for _, y in curve]
  return sum(b < a for a, b in zip(ys, ys[1:])) / (len(ys) - 1) if len(ys) > 1 else 0.0


def falls_below(curve: Sequence[tuple[int, float]], initial: float) -> bool:
  """Whether a point of `curve` after its first is strictly below `initial`."""
  return any(y < initial for _, y in curve[1:])


def learning_curve(curve: Sequence[tuple[int, float]], delay: int) -> list[tuple[int, float]]:
  """[(0, initial)] + [(p - delay, y) for (p, y) in curve[1:] if p > delay]: the evaluations of updated policies,
  from the initial one (`curve[0]`, policy step 0), on the axis "global steps with updates".

  Raises:
    ValueError: an empty curve, or one that does not start at policy step 0.
  """
  if not curve or curve[0][0] != 0:
    raise ValueError(f"learning_curve: the curve must start at policy step 0, got {list(curve)[:1]}")
  return [(0, curve[0][1])] + [(p - delay, y) for p, y in curve[1:] if p > delay]


def run_metrics(summary: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """The per-run figures of the module docstring, from a finished run's `summary.json` and `metrics.jsonl`.

  Returns:
    {"initial", "best", "best_step", "peak", "final", "auc", "largest_drop", "fall_rate", "below_initial",
    "delay", "rollback_rate", "k3_mean", "rollbacks", "curve": [[policy step, pass@1]],
    "learning_curve": [[steps with updates, pass@1]]} (rollback_rate / k3_mean None where not logged).

  Raises:
    ValueError: the curve lacks the step-0 or the final evaluation, or it disagrees with `summary.json` (its
      initial, final or best value): the two files are of different runs.
  """
  total = int(summary["config"]["total_steps"])
  delay = int(summary["config"].get("delay", 0))
  curve = eval_curve(records, total)
  if not curve or curve[0][0] != 0 or curve[-1][0] != total:
    raise ValueError(
        f"metrics.jsonl: the held-out curve must run from policy step 0 to total_steps={total}, got steps "
        f"{[s for s, _ in curve]}"
    )
  initial, final = summary["eval_after_sft"]["pass@1"], summary["eval_final"]["pass@1"]
  best, best_step = summary["best"]["score"], summary["best"]["step"]
  by_step = dict(curve)
  for what, want, got in (
      ("eval_after_sft", initial, curve[0][1]),
      ("eval_final", final, curve[-1][1]),
      ("best", best, by_step.get(best_step)),
  ):
    if got is None or not math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-12):
      raise ValueError(f"summary.json {what} pass@1 {want} differs from metrics.jsonl's {got}: files of two runs")
  learning = learning_curve(curve, delay)
  checks = summary.get("mipu", {}).get("checks") or 0
  k3 = [float(r[K3_KEY]) for r in records if r.get(K3_KEY) is not None]
  return {
      "warm_start": warm_start(summary),
      "initial": float(initial),
      "best": float(best),
      "best_step": int(best_step),
      "peak": max(y for _, y in learning[1:]) if len(learning) > 1 else float(initial),
      "final": float(final),
      "auc": curve_auc(learning),
      "largest_drop": largest_drop(learning),
      "fall_rate": fall_rate(learning),
      "below_initial": falls_below(learning, initial),
      "delay": delay,
      "rollback_rate": summary["mipu"]["rollbacks"] / checks if checks else None,
      "k3_mean": float(np.mean(k3)) if k3 else None,
      "rollbacks": [[int(r["step"]), int(not r["mipu/accepted"])] for r in records if "mipu/accepted" in r],
      "curve": [[s, y] for s, y in curve],
      "learning_curve": [[s, y] for s, y in learning],
      **run_dynamics(records, learning, delay),
  }


def warm_start(summary: Mapping[str, Any]) -> list[Any]:
  """What identifies a run's starting policy: [the SFT's final loss], or [None, the initial evaluation's pass@1]
  for a run without SFT. Two runs of one seed start from the same policy iff these agree (the file does not store
  the weights). The SFT loss alone where there is one: runs whose samplers differ (an fp8 and an fp32 sampler)
  evaluate the same starting policy differently."""
  loss = summary.get("sft", {}).get("final_loss")
  return [loss] if loss is not None else [None, summary["eval_after_sft"]["pass@1"]]


def load_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
  """(summary, metrics records) of a finished run, or None when `run_dir/summary.json` does not exist yet.

  Raises:
    ValueError: naming `run_dir` when a file is missing or not JSON.
  """
  path = os.path.join(run_dir, "summary.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError) as e:
    raise ValueError(f"{run_dir}: cannot read its summary.json and metrics.jsonl ({type(e).__name__}: {e})") from e
  return summary, records


# ------------------------------------------------------------------------------------------------ cells
def cell_label(cell: Sequence[tuple[str, Any]], drop: Sequence[str] = ()) -> str:
  """ "method=grpo, delay=8" (short field names; fields in `drop` left out)."""
  short = short_names([f for f, _ in cell])
  return ", ".join(f"{short[f]}={v}" for f, v in cell if f not in drop)


def _cells(runs: Sequence[Run]) -> dict[str, tuple[tuple[str, Any], ...]]:
  return {r.cell_name: r.cell for r in runs}


def cell_stats(
    per_run: Mapping[str, Mapping[str, Any]], runs: Sequence[Run], method: str = "t"
) -> list[dict[str, Any]]:
  """Per cell (in run order): its seeds with results, those missing, each figure's `Interval` over the seeds, and
  the count below their initial value.

  Args:
    per_run: run name -> `run_metrics` (finished runs only).
    runs: every run of the study.
    method: `mean_ci`'s method.
  """
  out = []
  for name, cell in _cells(runs).items():
    mine = [r for r in runs if r.cell_name == name]
    done = [r for r in mine if r.name in per_run]
    entry: dict[str, Any] = {
        "cell": name,
        "label": cell_label(cell),
        "overrides": dict(cell),
        "seeds": [r.seed for r in done],
        "missing_seeds": [r.seed for r in mine if r.name not in per_run],
        "metrics": {},
    }
    if done:
      for m in METRICS:
        entry["metrics"][m] = mean_ci([per_run[r.name][m] for r in done], method=method).to_json()
      for m in OPTIONAL_METRICS:
        values = [per_run[r.name].get(m) for r in done]
        if all(v is not None for v in values):
          entry["metrics"][m] = mean_ci(values, method=method).to_json()
      entry["below_initial"] = sum(bool(per_run[r.name]["below_initial"]) for r in done)
      entry["dynamics"] = cell_dynamics([per_run[r.name] for r in done])
    out.append(entry)
  return out


def _partner(cell: tuple[tuple[str, Any], ...], field: str, ref: Any, cells: Mapping[str, tuple]) -> str | None:
  """The cell with `field` set to `ref` (or without `field`) and otherwise equal to `cell`."""
  rest = {k: v for k, v in cell if k != field}
  for name, other in cells.items():
    d = dict(other)
    if d.get(field, ref) == ref and {k: v for k, v in d.items() if k != field} == rest:
      return name
  return None


def paired_differences(
    per_run: Mapping[str, Mapping[str, Any]],
    runs: Sequence[Run],
    comparisons: Sequence[Sequence[Any]],
    method: str = "t",
) -> list[dict[str, Any]]:
  """For each (field, ref) and each cell whose `field` is set to a value other than `ref` (and, for a (field, ref,
  values) triple, to one of `values`): reference - cell per seed (on the seeds both finished from the same warm
  start), and the `Interval` of those differences per figure.

  The reference cell has the same overrides but `field` = `ref` (or `field` unset: e.g. the prefix ablation
  `loss.prefix_statistic=mean` pairs with the MinPRO cell that leaves it at its default "min"). Cells without a
  reference cell, or without a seed in common with it, are left out.

  Returns:
    [{"field", "reference", "reference_cell", "cell", "label", "seeds", "unpaired_seeds" (both finished, different
    warm starts), "metrics": {figure: Interval json}}].
  """
  cells = _cells(runs)
  by_cell_seed = {(r.cell_name, r.seed): r.name for r in runs}
  out = []
  for field, ref, *only in comparisons:
    for name, cell in cells.items():
      d = dict(cell)
      if field not in d or d[field] == ref or (only and d[field] not in only[0]):
        continue
      ref_name = _partner(cell, field, ref, cells)
      if ref_name is None:
        continue
      both = [
          s
          for (c, s), run in by_cell_seed.items()
          if c == name and run in per_run and by_cell_seed.get((ref_name, s)) in per_run
      ]
      start = {s: [per_run[by_cell_seed[(c, s)]]["warm_start"] for c in (name, ref_name)] for s in both}
      same = lambda s: start[s][0] == start[s][1]  # noqa: E731
      seeds = [s for s in both if same(s)]
      if not seeds:
        continue
      metrics = {}
      for m in PAIRED_METRICS:
        diffs = [per_run[by_cell_seed[(ref_name, s)]][m] - per_run[by_cell_seed[(name, s)]][m] for s in seeds]
        metrics[m] = mean_ci(diffs, method=method).to_json()
      short = short_names([field])[field]
      others = cell_label(cell, drop=(field,))
      out.append(
          {
              "field": field,
              "reference": ref,
              "reference_cell": ref_name,
              "cell": name,
              "label": f"{short}: {ref} - {d[field]}" + (f" ({others})" if others else ""),
              "seeds": seeds,
              "unpaired_seeds": [s for s in both if not same(s)],
              "metrics": metrics,
          }
      )
  return out


def aggregate(
    study_dir: str,
    runs: Sequence[Run],
    comparisons: Sequence[Sequence[Any]] = (),
    method: str = "t",
    extra: Mapping[str, Any] | None = None,
    contrasts: Sequence[Sequence[Any]] = (),
) -> dict[str, Any]:
  """The study's summary from the run directories `study_dir/<run.name>` (unfinished runs are listed, not used).

  Returns:
    {"level", "interval_method", "runs": {name: run_metrics}, "unfinished": [names], "cells": `cell_stats`,
    "paired": `paired_differences`, **extra}, and "contrasts" (`contrasts.difference_in_differences`) when
    `contrasts` names any.

  Raises:
    ValueError: naming the run whose summary.json and metrics.jsonl disagree (`run_metrics`).
  """
  per_run, unfinished = {}, []
  for r in runs:
    loaded = load_run(os.path.join(study_dir, r.name))
    if loaded is None:
      unfinished.append(r.name)
      continue
    try:
      per_run[r.name] = run_metrics(*loaded)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{os.path.join(study_dir, r.name)}: {e}") from e
  return {
      **(extra or {}),
      "level": LEVEL,
      "interval_method": method,
      "runs": per_run,
      "unfinished": unfinished,
      "cells": cell_stats(per_run, runs, method),
      "paired": paired_differences(per_run, runs, comparisons, method),
      **({"contrasts": difference_in_differences(per_run, runs, contrasts, method)} if contrasts else {}),
  }


# ------------------------------------------------------------------------------------------------ markdown
def to_markdown(result: Mapping[str, Any]) -> str:
  """The summary as Markdown: the cell tables, the contrasts and the paired differences (percentage points, 95 %
  intervals)."""
  lvl = round(100 * result["level"])
  lines = []
  if result.get("description"):
    lines += [result["description"], ""]
  lines += [
      f"Held-out pass@1 in %, mean over seeds [{lvl} % {result['interval_method']}-interval]. best: the trainer's "
      "selection (pre-update evaluations included); peak: the best evaluation of an updated policy; AUC: "
      "time-averaged over the update steps; drop: the largest fall between consecutive evaluations; falls: the "
      "share of consecutive evaluations that fall.",
      "",
      "| cell | seeds | initial | best | peak | final | AUC | largest drop | falls | below initial |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for c in result["cells"]:
    m = c["metrics"]
    n = len(c["seeds"])
    miss = f" (+{len(c['missing_seeds'])} unfinished)" if c["missing_seeds"] else ""
    below = f"{c['below_initial']}/{n}" if n else "-"
    lines.append(
        f"| {c['label']} | {n}{miss} | "
        + " | ".join(
            format_points(m.get(k)) for k in ("initial", "best", "peak", "final", "auc", "largest_drop", "fall_rate")
        )
        + f" | {below} |"
    )
  mipu_cells = [c for c in result["cells"] if any(k in c["metrics"] for k in ("rollback_rate", "k3_mean"))]
  if any("rollback_rate" in c["metrics"] for c in mipu_cells):
    lines += [
        "",
        f"Sampler-learner mismatch and Step-2 rollbacks (mean over seeds [{lvl} % interval]).",
        "",
        "| cell | K3 (mean over steps) | rollback rate, % |",
        "|---|---:|---:|",
    ]
    for c in mipu_cells:
      k3, rate = c["metrics"].get("k3_mean"), c["metrics"].get("rollback_rate")
      k3_text = "-" if not k3 else f"{k3['mean']:.2e}"
      lines.append(f"| {c['label']} | {k3_text} | {format_points(rate)} |")
  lines += dynamics_markdown(result["cells"], lvl)
  lines += contrasts_markdown(result.get("contrasts"), lvl)
  if result["paired"]:
    lines += [
        "",
        f"Paired differences, reference - cell, on the seeds both ran from the same warm start (points; [{lvl} % "
        "interval]; * = the interval excludes 0; +k: seeds both ran from different warm starts, left out).",
        "",
        "| comparison | seeds | best | peak | final | AUC | largest drop |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["paired"]:
      cols = []
      for k in PAIRED_METRICS:
        iv = p["metrics"][k]
        star = " *" if Interval(**iv).excludes(0.0) else ""
        cols.append(format_points(iv, signed=True) + star)
      unpaired = f" (+{len(p['unpaired_seeds'])})" if p.get("unpaired_seeds") else ""
      lines.append(f"| {p['label']} | {len(p['seeds'])}{unpaired} | " + " | ".join(cols) + " |")
  if result["unfinished"]:
    lines += ["", f"Unfinished runs ({len(result['unfinished'])}): " + ", ".join(result["unfinished"])]
  return "\n".join(lines) + "\n"


def write_summary(study_dir: str, result: Mapping[str, Any]) -> list[str]:
  """Writes `study_dir/summary.json` and `study_dir/summary.md`; returns their paths."""
  paths = [os.path.join(study_dir, "summary.json"), os.path.join(study_dir, "summary.md")]
  for path, text in zip(paths, (json.dumps(result, indent=2) + "\n", to_markdown(result))):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  return paths
