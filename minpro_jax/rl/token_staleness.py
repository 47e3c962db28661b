"""Per-token staleness: how many optimizer updates separate the parameters that drew each response token from the
parameters that learn from it, and how many versions one response mixes.

Delay mode draws a whole response under one version (`RolloutBatch.policy_version`), so every token of it has the
row's staleness. With in-flight weight updates (`config.staleness.mode = "inflight"`, `minpro_jax.run.inflight_runner`)
a response started under version v continues under v + 1, v + 2, ...: `RolloutBatch.token_version` holds each
token's version. The metrics here read either, the same way, so the two modes are compared on one scale:

  staleness of token t = learn_version - version(t), learn_version = the parameters' version at the step's first
  update (updates 2..n of the step add j to every token alike, as the row metrics `staleness/*` count);
  spread of a response = max - min version over its tokens (0 in delay mode).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minpro_jax.rl.rollout import RolloutBatch


def token_versions(batch: RolloutBatch) -> np.ndarray:
  """[N, L] int64 version of every token: `token_version` where recorded, else the row's `policy_version`; -1 off
  `response_mask`."""
  if batch.token_version is not None:
    v = np.asarray(batch.token_version, np.int64)
  else:
    v = np.broadcast_to(np.asarray(batch.policy_version, np.int64)[:, None], batch.response_mask.shape)
  return np.where(batch.response_mask, v, -1)


def token_staleness_metrics(batch: RolloutBatch, learn_version: int) -> dict[str, Any]:
  """The step's per-token staleness metrics (module docstring) of `batch` learned from at `learn_version`.

  Returns:
    {"staleness/token_mean", "staleness/token_max", "staleness/token_histogram" ([k]: response tokens k updates
    stale), "staleness/spread_mean", "staleness/spread_max" (versions per response, max - min),
    "staleness/mixed_frac" (responses drawn by more than one version)}; zeros when the batch has no response token.

  Raises:
    ValueError: a token drawn by a version newer than `learn_version` (it cannot have been sampled yet).
  """
  mask = np.asarray(batch.response_mask, bool)
  v = token_versions(batch)
  stale = learn_version - v[mask]
  if stale.size and stale.min() < 0:
    raise ValueError(
        f"RolloutBatch.token_version: a token was drawn by version {int(v[mask].max())}, newer than the learner's "
        f"{learn_version}; versions must count the updates before the token was drawn"
    )
  rows = mask.any(axis=1)
  hi = np.where(mask, v, np.iinfo(np.int64).min).max(axis=1)
  lo = np.where(mask, v, np.iinfo(np.int64).max).min(axis=1)
  spread = (hi - lo)[rows]
  return {
      "staleness/token_mean": float(stale.mean()) if stale.size else 0.0,
      "staleness/token_max": int(stale.max()) if stale.size else 0,
      "staleness/token_histogram": np.bincount(stale).tolist() if stale.size else [],
      "staleness/spread_mean": float(spread.mean()) if spread.size else 0.0,
      "staleness/spread_max": int(spread.max()) if spread.size else 0,
      "staleness/mixed_frac": float((spread > 0).mean()) if spread.size else 0.0,
  }
