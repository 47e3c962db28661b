"""The step's rows beyond one program: which steps the trainer runs a part on, the evaluation's calls, several
calls' schedules as one, and the step row summing the parts (roofline, bound and forecast).

`minpro_jax.aot.budget` builds the parts' rows; these are the pieces that follow the trainer's own rules
(`Trainer.scoring`, `Trainer.evaluate`, `Trainer.generate_texts`) or add rows up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from minpro_jax.aot.forecast import record
from minpro_jax.aot.programs import STOP_ID
from minpro_jax.aot.schedule import Schedule
from minpro_jax.run import run_config, sampler_setup


def mean_schedule(scheds: list[Schedule]) -> Schedule:
  """The mean of several calls' schedules (one program run per call): counts averaged (floats), the peak pages the
  largest, the rest the first's; trip counts and costs are linear in them, so calls x the mean is the total."""
  if len(scheds) == 1:
    return scheds[0]
  first, out = scheds[0], {}
  for f in dataclasses.fields(first):
    vals = [getattr(s, f.name) for s in scheds]
    if f.name in ("buckets", "num_pages", "page_size", "unit", "groups"):
      out[f.name] = vals[0]
    elif f.name == "bucket_steps":
      out[f.name] = tuple(float(np.mean(v)) for v in zip(*vals))
    elif f.name == "peak_pages":
      out[f.name] = max(vals)
    else:
      out[f.name] = float(np.mean(vals))
  return dataclasses.replace(first, **out)


def add_forecast(row: dict, term: str, seconds, iterations: float) -> None:
  """Adds `seconds` ([3], a term the HLO cannot show) to a row's forecast record, under `term`."""
  f = row.get("forecast")
  if f is None:
    return
  levels = ("low", "central", "high")
  for i, lvl in enumerate(levels):
    f["seconds"][lvl] += float(seconds[i])
  f["terms"][term] = {lvl: float(seconds[i]) for i, lvl in enumerate(levels)}
  if iterations:
    f["seconds_per_iteration"] = {lvl: f["seconds"][lvl] / iterations for lvl in levels}


def sum_forecasts(rows: list[dict], iterations: float | None = None) -> dict | None:
  """One forecast record summing the rows' (None when any row has none: a part that does not fit, a CPU slice)."""
  fs = [r.get("forecast") for r in rows]
  if not fs or any(f is None for f in fs):
    return None
  levels = ("low", "central", "high")
  sec = np.array([sum(f["seconds"][lvl] for f in fs) for lvl in levels])
  terms: dict[str, np.ndarray] = {}
  for f in fs:
    for t, v in f["terms"].items():
      terms[t] = terms.get(t, np.zeros(3)) + np.array([v[lvl] for lvl in levels])
  return record(sec, terms, sum(f["ops"] for f in fs), sum(f["collectives"] for f in fs), iterations)


def step_row(rows: list[dict], has_rates: bool) -> dict[str, Any]:
  """The "step" row: the parts' rooflines and bounds summed (host time has neither), and their forecasts."""
  step = {"part": "step", "bound_seconds": 0.0, "seconds_overlapped": 0.0, "seconds_serial": 0.0}
  for r in rows:
    if r.get("sub") or r.get("host"):
      continue
    for k in ("bound_seconds", "seconds_overlapped", "seconds_serial"):
      step[k] = None if step[k] is None or r.get(k) is None else step[k] + r[k]
  if step["seconds_overlapped"] is not None and step["bound_seconds"] and has_rates:
    step["ratio"] = step["seconds_overlapped"] / step["bound_seconds"]
  step["forecast"] = sum_forecasts([r for r in rows if not r.get("sub")])
  return step


def score_every(c) -> int:
  """Every how many steps the trainer runs the score pass (`Trainer.scoring`): 1 when the loss reads the learner's
  log-probs (TIS/MIS), else `log.mismatch_every`."""
  return 1 if run_config.loss_config(c).reads_learner_logp else max(int(c.log.mismatch_every), 1)


def eval_calls(c) -> tuple[int, int]:
  """(requests per call, calls per evaluation) of the trainer's evaluation (`Trainer.evaluate`: generate calls of
  max(1, 256 // eval.n) prompts x eval.n samples over eval.num_problems problems, every call a full one)."""
  e = c.eval
  prompts = max(1, 256 // e.n)
  return prompts * e.n, -(-e.num_problems // prompts)


def eval_sampling(c):
  """The evaluation's `SamplingParams` (`Trainer.generate_texts`): eval's temperature and top-p, the training's
  response budget and stop ids."""
  e = c.eval
  return dataclasses.replace(sampler_setup.sampling_params(c, (STOP_ID,)), temperature=e.temperature,
                             top_k=None, top_p=e.top_p if e.top_p < 1.0 else None)  # fmt: skip
