"""Training dynamics of a study's runs beyond the held-out curve (`minpro_jax.study.aggregate`), from `metrics.jsonl`.

Per run:
  steps_to_collapse  the first point of the learning curve (x: global steps with updates) that lies at least
                     `COLLAPSE_DROP` (5 points of pass@1) below the initial evaluation; None when none does.
  train_auc          the time-averaged training accuracy (`reward/accuracy` of the step's rollouts) over the
                     steps whose sampler had seen updates: the rollouts of global step s come from the parameters
                     after s - d steps with updates at delay d, so the train curve is [(s - d, accuracy) for
                     s >= d], on the learning curve's axis, and its AUC is `curve_auc` of it.
  abs_log_ratio_by_position / ess_frac_by_position / weight_by_position
                     per response-position bin (0-7, 8-15, 16-31, ... tokens), the mean over the run's steps of
                     the learner-behaviour |log pi_theta - log mu| at update time, of the weights' effective
                     sample size fraction (sum w)^2 / (n sum w^2), and of the weight w itself (the objective's
                     detached per-token weight: MinPRO's clipped prefix weight, CISPO's clipped ratio; the ratio
                     for GRPO and M2PO, the sequence ratio for GSPO) (`learn/*_by_position_bin`, logged by the
                     trainer since 2026-12-03); None for a bin no response reached or a run that predates them.
                     The ESS fraction is scale-free; the mean weight shows how much of a token's gradient is left.

  ess_token / ess_seq / ess_seq_is / grad_cosine
                     the mean over the run's steps of the per-update effective sample size fractions and gradient
                     cosine (`learn/ess/*`, `learn/grad_cosine`, logged since issue 57; `minpro_jax.rl.ess`); absent
                     for a run that predates them.

  token_staleness / version_spread / mixed_frac
                     the mean over the run's steps of the per-token staleness, the per-response version spread
                     (max - min version over its tokens) and the share of responses drawn by several versions
                     (`staleness/token_mean`, `staleness/spread_mean`, `staleness/mixed_frac`,
                     `minpro_jax.rl.token_staleness`): in-flight updates against delay mode on one scale.

Per cell: the count of seeds that collapsed and the mean steps to collapse of those; the by-position profiles are
averaged over the cell's seeds bin by bin, the per-update diagnostics over its seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

COLLAPSE_DROP = 0.05  # pass@1 fraction: 5 points below the initial evaluation
TRAIN_KEY = "reward/accuracy"
POSITION_KEYS = {
    "abs_log_ratio_by_position": "learn/abs_log_ratio_by_position_bin",
    "ess_frac_by_position": "learn/ess_frac_by_position_bin",
    "weight_by_position": "learn/weight_by_position_bin",
}
POSITION_LABELS = ("0-7", "8-15", "16-31", "32-63", "64-127", "128-255", "256-511", "512+")
# per-update diagnostics (issue 57; `minpro_jax.rl.ess`), each the mean over a run's steps of the step mean
UPDATE_KEYS = {
    "ess_token": "learn/ess/token_frac",
    "ess_seq": "learn/ess/seq_frac",
    "ess_seq_is": "learn/ess/seq_is_frac",
    "grad_cosine": "learn/grad_cosine",
}
# per-token staleness (issue 59; `minpro_jax.rl.token_staleness`), each the mean over a run's steps of the step's
STALENESS_KEYS = {
    "token_staleness": "staleness/token_mean",
    "version_spread": "staleness/spread_mean",
    "mixed_frac": "staleness/mixed_frac",
}


def curve_auc(curve: Sequence[tuple[int, float]]) -> float:
  """Trapezoid area under `curve` divided by its step span (the value itself for one point).

  Raises:
    ValueError: an empty curve, or steps not strictly increasing.
  """
  if not curve:
    raise ValueError("curve_auc: empty curve")
  steps = np.asarray([s for s, _ in curve], np.float64)
  ys = np.asarray([y for _, y in curve], np.float64)
  if np.any(np.diff(steps) <= 0):
    raise ValueError(f"curve_auc: steps must increase, got {steps.tolist()}")
  if len(curve) == 1:
    return float(ys[0])
  return float(np.trapezoid(ys, steps) / (steps[-1] - steps[0]))


def steps_to_collapse(learning: Sequence[Sequence[float]], drop: float = COLLAPSE_DROP) -> int | None:
  """The x of the first point after the initial one with y <= initial - drop, or None.

  Args:
    learning: the learning curve [(steps with updates, pass@1)], starting with (0, initial).
    drop: the fall, as a pass@1 fraction, that counts as a collapse.
  """
  if not learning:
    return None
  initial = learning[0][1]
  return next((int(x) for x, y in learning[1:] if y <= initial - drop + 1e-12), None)


def train_curve(records: Sequence[Mapping[str, Any]], delay: int) -> list[tuple[int, float]]:
  """[(s - delay, reward/accuracy of global step s)] for the steps s >= delay that logged it, by step."""
  out = {int(r["step"]) - delay: float(r[TRAIN_KEY]) for r in records if r.get(TRAIN_KEY) is not None}
  return sorted((x, y) for x, y in out.items() if x >= 0)


def position_profile(records: Sequence[Mapping[str, Any]], key: str) -> list[float | None] | None:
  """The mean over records of the per-bin list at `key` (bins without a value skipped); None if no record has it."""
  rows = [r[key] for r in records if r.get(key)]
  if not rows:
    return None
  arr = np.asarray([[np.nan if v is None else v for v in row] for row in rows], np.float64)
  seen = ~np.all(np.isnan(arr), axis=0)
  means = np.nansum(arr, axis=0) / np.maximum(np.sum(~np.isnan(arr), axis=0), 1)
  return [float(m) if s else None for m, s in zip(means, seen)]


def run_dynamics(records: Sequence[Mapping[str, Any]], learning: Sequence[Sequence[float]], delay: int) -> dict:
  """The per-run figures of the module docstring: {"steps_to_collapse", "train_auc" (None without training
  accuracy), "train_curve", and the by-position profiles of `POSITION_KEYS`}."""
  curve = train_curve(records, delay)
  out: dict[str, Any] = {
      "steps_to_collapse": steps_to_collapse(learning),
      "train_auc": curve_auc(curve) if curve else None,
      "train_curve": [[x, y] for x, y in curve],
  }
  for name, key in POSITION_KEYS.items():
    out[name] = position_profile(records, key)
  for name, key in {**UPDATE_KEYS, **STALENESS_KEYS}.items():  # only where logged: older runs' summaries stay
    values = [float(r[key]) for r in records if r.get(key) is not None]
    if values:
      out[name] = float(np.mean(values))
  return out


def cell_dynamics(per_run: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Over a cell's finished runs: {"collapsed": k, "steps_to_collapse_mean": mean over the k (None if k = 0),
  and each by-position profile averaged over the runs bin by bin (None where no run has it)}."""
  steps = [r["steps_to_collapse"] for r in per_run if r.get("steps_to_collapse") is not None]
  out: dict[str, Any] = {
      "collapsed": len(steps),
      "steps_to_collapse_mean": float(np.mean(steps)) if steps else None,
  }
  for name in POSITION_KEYS:
    profiles = [r.get(name) for r in per_run if r.get(name)]
    out[name] = position_profile([{name: p} for p in profiles], name) if profiles else None
  for name in (*UPDATE_KEYS, *STALENESS_KEYS):
    values = [r[name] for r in per_run if r.get(name) is not None]
    if values:
      out[name] = float(np.mean(values))
  return out


def dynamics_markdown(cells: Sequence[Mapping[str, Any]], level: int) -> list[str]:
  """Markdown lines: one table of train AUC, collapses, |log ratio| and ESS by position per cell, and one of the
  mean weight by position (each left out when no cell has its figures)."""
  rows = [c for c in cells if c.get("dynamics")]
  if not rows:
    return []
  used = _used_bins(rows, ("abs_log_ratio_by_position", "ess_frac_by_position"))
  head = ["cell", "train AUC", "collapsed (steps)"]
  head += [f"abs log ratio {POSITION_LABELS[i]}" for i in used] + [f"ESS {POSITION_LABELS[i]}" for i in used]
  lines = _table_head(
      f"Training dynamics (mean over seeds [{level} % interval]). train AUC: time-averaged training accuracy, %; "
      f"collapsed: seeds whose held-out pass@1 fell {round(100 * COLLAPSE_DROP)} points below the initial (mean steps "
      "with updates to that point); abs log ratio: the learner-behaviour |log ratio| per token at update time, and "
      "ESS: the weights' effective sample size / tokens, by response position (mean over steps and seeds).",
      head,
  )
  for c in rows:
    d, m = c["dynamics"], c["metrics"]
    iv = m.get("train_auc")
    auc = (
        "-"
        if not iv
        else (
            f"{100 * iv['mean']:.1f}"
            + ("" if iv["low"] is None else f" [{100 * iv['low']:.1f}, {100 * iv['high']:.1f}]")
        )
    )
    col = f"{d['collapsed']}/{len(c['seeds'])}" + (
        f" ({d['steps_to_collapse_mean']:.1f})" if d["steps_to_collapse_mean"] is not None else ""
    )
    cols = [c["label"], auc, col]
    for name, fmt in (("abs_log_ratio_by_position", "{:.3f}"), ("ess_frac_by_position", "{:.2f}")):
      cols += _profile_cells(d.get(name), used, fmt)
    lines.append("| " + " | ".join(cols) + " |")
  diagnosed = [c for c in rows if any(c["dynamics"].get(n) is not None for n in UPDATE_KEYS)]
  if diagnosed:
    lines += _table_head(
        "Per-update diagnostics (mean over steps and seeds): the effective sample size fraction (sum w)^2 / (n sum "
        "w^2) of the objective's token weights, of its sequence weights (each response's mean weight), and of the "
        "sequence likelihood ratios exp(sum_t log pi_theta - log mu) (VCPO's), and the cosine between consecutive "
        "updates' gradients (GAC's collapse signature: high under staleness).",
        ["cell", "ESS tokens", "ESS sequences", "ESS sequence ratios", "gradient cosine"],
    )
    for c in diagnosed:
      d = c["dynamics"]
      cols = ["-" if d.get(n) is None else f"{d[n]:.3f}" for n in UPDATE_KEYS]
      lines.append("| " + " | ".join([c["label"], *cols]) + " |")
  versioned = [c for c in rows if any(c["dynamics"].get(n) is not None for n in STALENESS_KEYS)]
  if versioned:
    lines += _table_head(
        "Per-token staleness (mean over steps and seeds): updates between the version that drew a response token "
        "and the step's first update, the spread of versions within a response (max - min; 0 in delay mode) and "
        "the share of responses drawn by more than one version (in-flight updates).",
        ["cell", "token staleness", "version spread", "mixed responses"],
    )
    for c in versioned:
      d = c["dynamics"]
      cols = ["-" if d.get(n) is None else f"{d[n]:.3f}" for n in STALENESS_KEYS]
      lines.append("| " + " | ".join([c["label"], *cols]) + " |")
  weighted = [c for c in rows if c["dynamics"].get("weight_by_position")]
  if weighted:
    used = _used_bins(weighted, ("weight_by_position",))
    lines += _table_head(
        "Mean per-token weight by response position (mean over steps and seeds): the objective's detached weight "
        "on the token's gradient (MinPRO: the clipped prefix weight; CISPO: the clipped ratio), or the ratio for "
        "GRPO and M2PO and the sequence ratio for GSPO, whose clip drops a token's gradient instead.",
        ["cell"] + [f"weight {POSITION_LABELS[i]}" for i in used],
    )
    for c in weighted:
      lines.append("| " + " | ".join([c["label"], *_profile_cells(c["dynamics"]["weight_by_position"], used)]) + " |")
  return lines


def _table_head(caption: str, head: Sequence[str]) -> list[str]:
  """A markdown table's caption paragraph, header and alignment row (first column left, the others right)."""
  return ["", caption, "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]


def _used_bins(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[int]:
  """The position bins where some row's profile `names` has a value."""
  profiles = [p for c in rows for n in names if (p := c["dynamics"].get(n))]
  bins = max((len(p) for p in profiles), default=0)
  return [i for i in range(bins) if any(i < len(p) and p[i] is not None for p in profiles)]


def _profile_cells(profile: Sequence[float | None] | None, used: Sequence[int], fmt: str = "{:.2f}") -> list[str]:
  """The table cells of a by-position profile at bins `used` ("-" where it has no value)."""
  return ["-" if not profile or i >= len(profile) or profile[i] is None else fmt.format(profile[i]) for i in used]
