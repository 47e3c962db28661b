"""What a researcher watches: `metrics.jsonl` per global step, TensorBoard events, PNG plots and `summary.json`.

TensorBoard files are written with `tensorboardX` (no TensorFlow needed) when it is importable.
On resume, lines of `metrics.jsonl` after the restored step are dropped first, so the file always
describes one consistent run. Every run checkpoint also holds the rows up to its step (`MetricsWriter.rows_upto`,
in its meta), and a resume puts back those the file lost (deleted, or truncated, between a stop and its resume or
while the run went on), so the after-SFT evaluation and every step's row survive with the checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _jsonable(v: Any):
  if isinstance(v, dict):
    return {k: _jsonable(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_jsonable(x) for x in v]
  if isinstance(v, np.ndarray):
    return _jsonable(v.tolist())
  if isinstance(v, (np.floating, float)):
    f = float(v)
    return f if math.isfinite(f) else None
  if isinstance(v, (np.integer, np.bool_)):
    return v.item()
  return v


class MetricsWriter:
  """Appends one JSON object per global step to `workdir/metrics.jsonl` (and TensorBoard scalars).

  Args:
    workdir: run directory.
    resume_step: if given, existing lines with "step" > resume_step are removed (they will be recomputed).
    keep_final_eval: a finished run continued to more global steps: its final evaluation (the record of step
      resume_step + 1 holding only `eval/` entries, of the policy after global step resume_step) is kept, moved
      into the record of global step resume_step, where a periodic evaluation of that policy goes.
    tensorboard: write TensorBoard event files to `workdir/tb` when tensorboardX is installed.
    enabled: False makes every call a no-op (the processes of a multi-process run other than process 0).
    restored_rows: the rows the resumed checkpoint holds (`rows_upto` of its step); those of a step <= resume_step
      the file lacks are put back, with a warning.
  """

  def __init__(
      self,
      workdir: str,
      resume_step: int | None = None,
      tensorboard: bool = True,
      enabled: bool = True,
      keep_final_eval: bool = False,
      restored_rows: list[dict[str, Any]] | None = None,
  ):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    self.rows: list[dict[str, Any]] = []  # every record of the file, as written: what a checkpoint keeps
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is not None and (restored_rows or not os.path.exists(self.path)):
      self._put_back(restored_rows or [], resume_step)
    if os.path.exists(self.path):
      records, bad = _read_lines(self.path)
      if bad:  # a line cut by a kill, or a damaged byte: kept aside, named, and the run goes on
        aside = self.path + ".unreadable"
        with open(aside, "ab") as f:
          f.writelines(raw if raw.endswith(b"\n") else raw + b"\n" for _, raw in bad)
        logger.warning(
            "%s: line(s) %s are not JSON records (a write cut by a kill, or a damaged byte); moved them to %s. "
            "Steps after the restored checkpoint are recomputed; earlier ones keep no metrics line",
            self.path,
            ", ".join(str(n) for n, _ in bad[:10]) + (", ..." if len(bad) > 10 else ""),
            aside,
        )
      kept = [r for r in records if resume_step is not None and r["step"] <= resume_step]
      if keep_final_eval and resume_step is not None:
        _move_final_eval(kept, records, resume_step)
      self.rows = kept
      keep = [json.dumps(r) + "\n" for r in kept]
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        f.writelines(keep)
      os.replace(tmp, self.path)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:
        self._tb = None

  def _put_back(self, restored: list[dict[str, Any]], resume_step: int) -> None:
    """Appends to the file the rows of `restored` (step <= resume_step) whose step it has no record of."""
    have = {r["step"] for r in (_read_lines(self.path)[0] if os.path.exists(self.path) else [])}
    lost = [r for r in restored if isinstance(r, dict) and r.get("step", resume_step + 1) <= resume_step]
    lost = [r for r in lost if r["step"] not in have]
    if not restored:
      logger.warning(
          "%s is missing and the checkpoint of step %d holds no metrics rows (written before they were kept): "
          "the rows up to that step are lost",
          self.path,
          resume_step,
      )
      return
    if not lost:
      return
    logger.warning(
        "%s lacked the rows of %d step(s) up to the checkpoint of step %d (deleted or cut); put back from the "
        "checkpoint",
        self.path,
        len(lost),
        resume_step,
    )
    records = sorted(
        [*(_read_lines(self.path)[0] if os.path.exists(self.path) else []), *lost], key=lambda r: r["step"]
    )
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, self.path)

  def rows_upto(self, step: int) -> list[dict[str, Any]]:
    """The rows of global steps <= `step` (the after-SFT evaluation is step -1): what the checkpoint of `step`
    keeps, so that a resume can put back rows the file lost."""
    return [r for r in self.rows if r["step"] <= step]

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    rec = {"step": int(step), **_jsonable(metrics)}
    self.rows.append(rec)
    with open(self.path, "a") as f:
      f.write(json.dumps(rec) + "\n")
      f.flush()
      os.fsync(f.fileno())
    if self._tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
          self._tb.add_scalar(k.replace("@", "_at_"), v, step)
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _is_eval_only(record: dict[str, Any]) -> bool:
  return len(record) > 1 and all(k == "step" or k.startswith("eval/") for k in record)


def _move_final_eval(kept: list[dict[str, Any]], records: list[dict[str, Any]], step: int) -> None:
  """Moves the final evaluation of a run that ended after global step `step` (the eval-only record of step + 1) into
  the kept record of `step` (see `MetricsWriter`), when that record holds no evaluation yet."""
  final = [r for r in records if r["step"] == step + 1 and _is_eval_only(r)]
  last = [r for r in kept if r["step"] == step]
  if final and last and not any(k.startswith("eval/") for k in last[-1]):
    last[-1].update({k: v for k, v in final[-1].items() if k != "step"})


def _read_lines(path: str) -> tuple[list[dict[str, Any]], list[tuple[int, bytes]]]:
  """The records of a metrics.jsonl file (JSON objects with an integer "step"), and the other non-empty lines as
  (1-based line number, raw bytes)."""
  records, bad = [], []
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        rec = json.loads(raw.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError):
        rec = None
      if isinstance(rec, dict) and isinstance(rec.get("step"), int):
        records.append(rec)
      else:
        bad.append((n, raw))
  return records, bad


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of `workdir/metrics.jsonl` (lines that are not a JSON record with a "step" are skipped)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return _read_lines(path)[0]


def plot_run(workdir: str) -> list[str]:
  """Writes PNG plots (reward/accuracy, staleness, ESS and gradient cosine, weight by position, eval) from
  metrics.jsonl; returns paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recs = read_metrics(workdir)
  if not recs:
    return []
  out = []

  def series(key):
    pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else None

  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (
      ("reward/mean", "train reward"),
      ("reward/accuracy", "train accuracy"),
      ("eval/avg_score", "held-out pass@1"),
  ):
    s = series(key)
    if s:
      ax.plot(*s, label=label, marker="." if key.startswith("eval") else None)
  ax.set_xlabel("global step")
  ax.legend()
  ax.set_title("reward and accuracy")
  out.append(_save(fig, workdir, "reward.png"))

  fig, ax = plt.subplots(figsize=(6, 4))
  for key in ("staleness/min", "staleness/mean", "staleness/max"):
    s = series(key)
    if s:
      ax.plot(*s, label=key)
  ax.set_xlabel("global step")
  ax.set_ylabel("updates between sampling and use")
  ax.legend()
  out.append(_save(fig, workdir, "staleness.png"))

  diagnostics = (
      ("learn/ess/token_frac", "ESS / n, token weights"),
      ("learn/ess/seq_frac", "ESS / B, sequence weights"),
      ("learn/ess/seq_is_frac", "ESS / B, sequence ratios (VCPO)"),
      ("learn/grad_cosine", "cosine of consecutive gradients"),
  )
  drawn = [(series(key), label) for key, label in diagnostics]
  if any(s for s, _ in drawn):
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, label in drawn:
      if s:
        ax.plot(*s, label=label)
    ax.set_xlabel("global step")
    ax.set_ylabel("mean over the step's updates")
    ax.legend()
    ax.set_title("effective sample size and gradient alignment")
    out.append(_save(fig, workdir, "ess.png"))

  bins = [r["learn/weight_by_position_bin"] for r in recs if r.get("learn/weight_by_position_bin")]
  if bins:
    arr = np.asarray([[np.nan if x is None else x for x in b] for b in bins], np.float64)
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = ["0-7", "8-15", "16-31", "32-63", "64-127", "128-255", "256-511", "512+"][: arr.shape[1]]
    with np.errstate(all="ignore"), warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # bins no response reached are all-NaN
      mean = np.nanmean(arr, axis=0)
    ax.plot(labels, mean, marker="o", label="mean over run")
    ax.plot(labels, arr[-1], marker="x", label="last step")
    ax.set_xlabel("response token position")
    ax.set_ylabel("mean per-token weight")
    ax.legend()
    out.append(_save(fig, workdir, "weight_by_position.png"))
  return out


def _save(fig, workdir: str, name: str) -> str:
  """Writes `fig` to `workdir/name` as PNG, closes it, and returns the path."""
  import matplotlib.pyplot as plt

  path = os.path.join(workdir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def write_summary(workdir: str, summary: dict[str, Any]) -> str:
  """Writes `summary` to `workdir/summary.json` (numpy values as Python scalars, non-finite floats as null)."""
  path = os.path.join(workdir, "summary.json")
  with open(path, "w") as f:
    json.dump(_jsonable(summary), f, indent=2)
  return path
