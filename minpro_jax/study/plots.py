"""A study's PNG plots (matplotlib, Agg), from the result of `aggregate.aggregate`.

curves.png        held-out pass@1 vs global steps with updates (the learning curve, `aggregate.learning_curve`): per
                  cell the mean over seeds and a band of the 95 % t-interval at each evaluation (no band with one
                  seed); one panel per value of the grid's `panel` field.
bar_<figure>.png  per cell the mean of a figure (peak, final, auc) with interval whiskers (none with one seed).
paired.png        the paired differences of the peak held-out pass@1 with their intervals, and 0 marked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from minpro_jax.study.aggregate import cell_label, mean_ci
from minpro_jax.study.grid import Run

BAR_FIGURES = ("peak", "final", "auc")


def _plt():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=100, bbox_inches="tight")  # long tick labels are not cut off
  _plt().close(fig)
  return path


def _panels(runs: Sequence[Run], panel: str | None) -> dict[Any, list[str]]:
  """panel value -> the cell names in it, in run order (one panel None when `panel` is None)."""
  out: dict[Any, list[str]] = {}
  for r in runs:
    key = dict(r.cell).get(panel) if panel else None
    names = out.setdefault(key, [])
    if r.cell_name not in names:
      names.append(r.cell_name)
  return out


def mean_band(
    curves: Sequence[Sequence[Sequence[float]]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
  """(steps, mean, low, high) over the seeds' curves [[step, value], ...], on the steps all of them evaluated;
  low/high are None with fewer than two curves."""
  common = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
  vals = np.asarray([[dict((s, y) for s, y in c)[st] for st in common] for c in curves], np.float64)
  ivs = [mean_ci(vals[:, j]) for j in range(len(common))]
  mean = np.asarray([iv.mean for iv in ivs])
  if len(curves) < 2:
    return np.asarray(common), mean, None, None
  return np.asarray(common), mean, np.asarray([iv.low for iv in ivs]), np.asarray([iv.high for iv in ivs])


def plot_curves(result: Mapping[str, Any], runs: Sequence[Run], panel: str | None, path: str) -> str | None:
  """Writes curves.png (see the module docstring) to `path`; None when no run finished."""
  plt = _plt()
  panels = {k: v for k, v in _panels(runs, panel).items() if any(_cell_curves(result, runs, n) for n in v)}
  if not panels:
    return None
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False, sharey=True)
  cells = {r.cell_name: r.cell for r in runs}
  for ax, (key, names) in zip(axes[0], panels.items()):
    for name in names:
      curves = _cell_curves(result, runs, name)
      if not curves:
        continue
      steps, mean, low, high = mean_band(curves)
      label = cell_label(cells[name], drop=(panel,) if panel else ()) or name
      (line,) = ax.plot(steps, 100 * mean, marker=".", label=f"{label} (n={len(curves)})")
      if low is not None:
        ax.fill_between(steps, 100 * low, 100 * high, color=line.get_color(), alpha=0.15)
    ax.set_title(f"{panel.rsplit('.', 1)[-1]}={key}" if panel else "held-out pass@1")
    ax.set_xlabel("global steps with updates (policy step - delay)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel("held-out pass@1 (%)")
  return _save(fig, path)


def _cell_curves(result: Mapping[str, Any], runs: Sequence[Run], cell_name: str) -> list:
  out = result["runs"]
  return [out[r.name]["learning_curve"] for r in runs if r.cell_name == cell_name and r.name in out]


def plot_bars(result: Mapping[str, Any], figure: str, path: str) -> str | None:
  """Writes a bar chart of `figure` per cell with its interval as whiskers; None when no cell has a result."""
  plt = _plt()
  cells = [c for c in result["cells"] if figure in c["metrics"]]
  if not cells:
    return None
  ivs = [c["metrics"][figure] for c in cells]
  mean = np.asarray([iv["mean"] for iv in ivs]) * 100
  err = (
      np.asarray(
          [
              [iv["mean"] - iv["low"], iv["high"] - iv["mean"]] if iv["low"] is not None else [np.nan, np.nan]
              for iv in ivs
          ]
      ).T
      * 100
  )
  fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(cells) + 2), 4.2))
  x = np.arange(len(cells))
  ax.bar(x, mean, color="tab:blue", alpha=0.7)
  ax.errorbar(x, mean, yerr=err, fmt="none", ecolor="black", capsize=3)
  ax.set_xticks(x, [c["label"] for c in cells], rotation=70, ha="right", fontsize=7)
  ax.set_ylabel(f"held-out pass@1 {figure} (%)")
  ax.set_title(f"{figure}: mean over seeds, {round(100 * result['level'])} % {result['interval_method']}-interval")
  ax.grid(axis="y", alpha=0.3)
  return _save(fig, path)


def plot_paired(result: Mapping[str, Any], path: str, figure: str = "peak") -> str | None:
  """Writes the paired differences of `figure` as a forest plot; None without paired differences."""
  plt = _plt()
  pairs = result["paired"]
  if not pairs:
    return None
  fig, ax = plt.subplots(figsize=(6.5, 0.3 * len(pairs) + 1.5))
  y = np.arange(len(pairs))[::-1]
  for yi, p in zip(y, pairs):
    iv = p["metrics"][figure]
    ax.plot([100 * iv["mean"]], [yi], "o", color="tab:blue")
    if iv["low"] is not None:
      ax.plot([100 * iv["low"], 100 * iv["high"]], [yi, yi], color="tab:blue")
  ax.axvline(0, color="black", lw=0.8)
  ax.set_yticks(y, [f"{p['label']} (n={len(p['seeds'])})" for p in pairs], fontsize=7)
  ax.set_xlabel(f"reference - cell, held-out pass@1 {figure} (points)")
  ax.grid(axis="x", alpha=0.3)
  return _save(fig, path)


def write_plots(study_dir: str, result: Mapping[str, Any], runs: Sequence[Run], panel: str | None) -> list[str]:
  """Writes every plot of the module docstring that has data into `study_dir`; returns their paths."""
  out = [plot_curves(result, runs, panel, os.path.join(study_dir, "curves.png"))]
  out += [plot_bars(result, f, os.path.join(study_dir, f"bar_{f}.png")) for f in BAR_FIGURES]
  out.append(plot_paired(result, os.path.join(study_dir, "paired.png")))
  return [p for p in out if p]
