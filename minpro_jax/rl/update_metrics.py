"""One metrics record from the optimizer updates of a global step."""

from __future__ import annotations

from typing import Any

import numpy as np


def combine_update_metrics(ups: list[dict[str, Any]]) -> dict[str, Any]:
  """The metrics of a step's updates as one record: max of *_max, min of *_min, sums of counts, means of the rest.

  By response-position bin (None for bins no response reached), token-weighted over the updates: the mean weight,
  the mean learner-behaviour |log ratio|, and the weights' effective sample size as a fraction of the bin's tokens,
  ESS / n = (sum w)^2 / (n sum w^2) (Kish's effective sample size;
  1: equal weights). The learner's entropy, K3, token and sequence-ratio ESS and gradient cosine are also listed
  update by update (`*_by_update`; None for a non-finite value: the step's first cosine); `learn/grad_cosine` is the mean
  over the step's other updates (None with one update)."""
  out: dict[str, Any] = {}
  per_bin = {}
  if "tokens_by_position_bin" in ups[0]:
    cnt = np.asarray([u["tokens_by_position_bin"] for u in ups], np.float64)
    tot = cnt.sum(0)
    for k in ("weight_by_position_bin", "weight_sq_by_position_bin", "abs_log_ratio_by_position_bin"):
      if k in ups[0]:
        per_bin[k] = (np.asarray([u[k] for u in ups], np.float64) * cnt).sum(0) / np.maximum(tot, 1)
    as_list = lambda x: [float(v) if t > 0 else None for v, t in zip(x, tot)]  # noqa: E731
    for k in ("weight_by_position_bin", "abs_log_ratio_by_position_bin"):
      if k in per_bin:
        out[f"learn/{k}"] = as_list(per_bin[k])
    if "weight_sq_by_position_bin" in per_bin:
      with np.errstate(all="ignore"):
        ess = per_bin["weight_by_position_bin"] ** 2 / per_bin["weight_sq_by_position_bin"]
      out["learn/ess_frac_by_position_bin"] = as_list(np.where(np.isfinite(ess), ess, 0.0))
  for k in ups[0]:
    if k in per_bin or k == "tokens_by_position_bin":
      continue
    vals = np.asarray([u[k] for u in ups], np.float64)
    if k.endswith("_max"):
      out[f"learn/{k}"] = float(vals.max())
    elif k.endswith("_min"):
      out[f"learn/{k}"] = float(vals.min())
    elif k == "update_skipped":
      out["learn/skipped_updates"] = int(vals.sum())
      out["learn/updates"] = len(ups)
    elif k == "grad_cosine":  # NaN for the step's first update (no previous gradient): the mean of the others
      seen = vals[np.isfinite(vals)]
      out[f"learn/{k}"] = float(seen.mean()) if seen.size else None
    else:
      out[f"learn/{k}"] = float(vals.mean())
  # how they move over the step's updates (staleness grows)
  for k in ("entropy_mean", "learner_behavior/k3", "ess/token_frac", "ess/seq_is_frac", "grad_cosine"):
    if k in ups[0]:
      out[f"learn/{k}_by_update"] = [float(u[k]) if np.isfinite(u[k]) else None for u in ups]
  return out
