"""Difference-in-differences contrasts of a study's cells (issue 55): how much of a method's gap to a reference
does a factor (staleness) add?

A grid's contrast (field, reference, across, base), e.g. ("loss.method", "grpo", "delay", 0), reports for every
cell X whose `field` is not `reference` and whose `across` is not `base`, when the three partner cells exist (X's
overrides with `field` = reference; with `across` = base; with both), per seed

    (X - reference, at across = d) - (X - reference, at across = base)

on the seeds whose four runs finished from one warm start, and the interval of those values (`mean_ci`, the
study's t or bootstrap method), for the figures `CONTRAST_METRICS`. In the staleness grids this is (MinPRO - GRPO at
delay d) - (MinPRO - GRPO at delay 0): the part of MinPRO's gap to GRPO that staleness adds, which is what the
MinPRO paper claims about, with the seed's and the on-policy gap's shares removed. The sign is cell minus
reference (negative: X falls further behind the reference as `across` leaves `base`), the opposite of the paired
differences' reference minus cell. A partner cell may leave a field unset where it is at the reference or base
value (as the paired differences' reference cells may).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minpro_jax.study.grid import Run, short_names
from minpro_jax.study.intervals import Interval, format_points, mean_ci

CONTRAST_METRICS = ("peak", "final", "auc")  # `best` is biased up by the pre-update draws at a delay d > 0
_HEADERS = {"peak": "peak", "final": "final", "auc": "AUC"}


def _partner(cell: tuple[tuple[str, Any], ...], changes: Mapping[str, Any], cells: Mapping[str, tuple]) -> str | None:
  """The name of the cell equal to `cell` except for `changes` (field -> value; a cell without the field matches)."""
  rest = {k: v for k, v in cell if k not in changes}
  for name, other in cells.items():
    d = dict(other)
    if all(d.get(f, v) == v for f, v in changes.items()) and {k: v for k, v in d.items() if k not in changes} == rest:
      return name
  return None


def difference_in_differences(
    per_run: Mapping[str, Mapping[str, Any]],
    runs: Sequence[Run],
    contrasts: Sequence[Sequence[Any]],
    method: str = "t",
) -> list[dict[str, Any]]:
  """The contrasts of the module docstring.

  Args:
    per_run: run name -> `aggregate.run_metrics` (finished runs only; each has "warm_start" and the figures).
    runs: every run of the study.
    contrasts: (field, reference, across, base) tuples (`Grid.contrasts`).
    method: `mean_ci`'s method.

  Returns:
    [{"field", "reference", "across", "base", "cell", "cells" ([X at d, reference at d, X at base, reference at
    base]), "label", "seeds", "unpaired_seeds" (all four finished, not from one warm start), "metrics": {figure:
    Interval json}}], in run order per contrast; cells without their three partners or without a seed whose four
    runs share a warm start are left out.
  """
  cells = {r.cell_name: r.cell for r in runs}
  run_of = {(r.cell_name, r.seed): r.name for r in runs}
  seeds = list(dict.fromkeys(r.seed for r in runs))
  out = []
  for field, ref, across, base in contrasts:
    short = short_names([field, across])
    for name, cell in cells.items():
      d = dict(cell)
      if d.get(field, ref) == ref or d.get(across, base) == base:
        continue
      four = [
          name,
          _partner(cell, {field: ref}, cells),
          _partner(cell, {across: base}, cells),
          _partner(cell, {field: ref, across: base}, cells),
      ]
      if None in four:
        continue
      done = [s for s in seeds if all(run_of.get((c, s)) in per_run for c in four)]
      starts = {s: [per_run[run_of[(c, s)]]["warm_start"] for c in four] for s in done}
      paired = [s for s in done if all(w == starts[s][0] for w in starts[s])]
      if not paired:
        continue
      metrics = {}
      for m in CONTRAST_METRICS:
        x_d, ref_d, x_0, ref_0 = ([per_run[run_of[(c, s)]][m] for s in paired] for c in four)
        values = [(a - b) - (c - e) for a, b, c, e in zip(x_d, ref_d, x_0, ref_0)]
        metrics[m] = mean_ci(values, method=method).to_json()
      others = ", ".join(f"{short_names(list(d))[k]}={v}" for k, v in cell if k not in (field, across))
      out.append(
          {
              "field": field,
              "reference": ref,
              "across": across,
              "base": base,
              "cell": name,
              "cells": four,
              "label": f"{short[field]}: ({d[field]} - {ref}) at {short[across]}={d[across]} - at "
              f"{short[across]}={base}" + (f" ({others})" if others else ""),
              "seeds": paired,
              "unpaired_seeds": [s for s in done if s not in paired],
              "metrics": metrics,
          }
      )
  return out


def contrasts_markdown(contrasts: Sequence[Mapping[str, Any]] | None, level_pct: int) -> list[str]:
  """The contrasts' table as Markdown lines (percentage points), or [] when there are none."""
  if not contrasts:
    return []
  lines = [
      "",
      "Contrasts (difference in differences): (cell - reference at across = d) - (cell - reference at across = base), "
      f"seed by seed on the seeds whose four runs share a warm start (points; [{level_pct} % interval]; * = the "
      "interval excludes 0; +k: seeds whose four runs are not from one warm start, left out).",
      "",
      "| contrast | seeds | " + " | ".join(_HEADERS[m] for m in CONTRAST_METRICS) + " |",
      "|---|---:|" + "---:|" * len(CONTRAST_METRICS),
  ]
  for c in contrasts:
    cols = []
    for m in CONTRAST_METRICS:
      iv = c["metrics"][m]
      cols.append(format_points(iv, signed=True) + (" *" if Interval(**iv).excludes(0.0) else ""))
    unpaired = f" (+{len(c['unpaired_seeds'])})" if c["unpaired_seeds"] else ""
    lines.append(f"| {c['label']} | {len(c['seeds'])}{unpaired} | " + " | ".join(cols) + " |")
  return lines
