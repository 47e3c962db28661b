"""Per-token staleness: how many optimizer updates separate the parameters that drew each response token from the
parameters that learn from it, and how many versions one response mixes.

Delay mode draws a whole response under one version (`RolloutBatch.policy_version`), so every token of it has the
row's staleness. With in-flight weight updates (`config.staleness.mode = "inflight"`, `minpro_jax.run.inflight_runner`)
a response started under version v continues under v + 1, v + 2, ...: `RolloutBatch.token_version` holds each
token's version. The metrics here read either, the same way, so the two modes are compared on one scale:

  staleness of token t = learn_version - version(t), learn_version = the parameters' version at the step's first
  update (updates 2..n of the step add j to every token alike, as the row metrics `staleness/*` count);
  spread of a response = max - min version over its tokens (0 in delay mode).

In a multi-process run each process holds its rows only: `version_counts` summarizes them (tokens per version,
spread per row), `gather_version_counts` adds the processes' summaries (two small all-gathers) and
`staleness_from_counts` gives the metrics of the whole batch from it, equal to `token_staleness_metrics` of the whole
batch bit for bit (integer counts; the means are exact sums over a count).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from jax.experimental import multihost_utils

from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime import multihost


class VersionCounts(NamedTuple):
  """What the per-token staleness metrics read of a batch's rows.

  Attributes:
    tokens: [V] int64, the response tokens drawn by version v = -1 .. V - 2 (at index v + 1; -1: unversioned).
    spreads: [rows] int64, max - min version of each row's response tokens, -1 for a row without any.
  """

  tokens: np.ndarray
  spreads: np.ndarray


def token_versions(batch: RolloutBatch) -> np.ndarray:
  """[N, L] int64 version of every token: `token_version` where recorded, else the row's `policy_version`; -1 off
  `response_mask`."""
  if batch.token_version is not None:
    v = np.asarray(batch.token_version, np.int64)
  else:
    v = np.broadcast_to(np.asarray(batch.policy_version, np.int64)[:, None], batch.response_mask.shape)
  return np.where(batch.response_mask, v, -1)


def version_counts(batch: RolloutBatch) -> VersionCounts:
  """The `VersionCounts` of `batch`'s rows (this process's rows in a multi-process run).

  Raises:
    ValueError: a response token with a version below -1.
  """
  mask = np.asarray(batch.response_mask, bool)
  v = token_versions(batch)
  if mask.any() and v[mask].min() < -1:
    raise ValueError("RolloutBatch.token_version: a response token has a version below -1 (unversioned)")
  hi = np.where(mask, v, np.iinfo(np.int64).min).max(axis=1)
  lo = np.where(mask, v, np.iinfo(np.int64).max).min(axis=1)
  spreads = np.where(mask.any(axis=1), hi - lo, -1).astype(np.int64)
  return VersionCounts(np.bincount(v[mask] + 1).astype(np.int64), spreads)


def gather_version_counts(local: VersionCounts, num_rows: int) -> VersionCounts:
  """The `VersionCounts` of every process's rows (`local`: this process's `multihost.process_rows(num_rows)` rows):
  the token counts summed, the spreads in row order. `local` in a one-process run. Collective: every process calls
  it at the same point."""
  if multihost.process_count() == 1:
    return local
  every = np.asarray(multihost_utils.process_allgather(np.asarray([local.tokens.size], np.int64), tiled=False))
  tokens = np.zeros(int(every.max()), np.int64)
  tokens[: local.tokens.size] = local.tokens
  return VersionCounts(multihost.sum_over_processes(tokens), multihost.gather_rows(local.spreads, num_rows))


def staleness_from_counts(counts: VersionCounts, learn_version: int) -> dict[str, Any]:
  """`token_staleness_metrics` of the batch `counts` summarizes (`version_counts`, `gather_version_counts`)."""
  tokens = np.trim_zeros(np.asarray(counts.tokens, np.int64), "b")
  if tokens.size > learn_version + 2:
    raise ValueError(
        f"RolloutBatch.token_version: a token was drawn by version {tokens.size - 2}, newer than the learner's "
        f"{learn_version}; versions must count the updates before the token was drawn"
    )
  present = np.flatnonzero(tokens)  # version + 1
  hist = np.zeros(learn_version + 1 - int(present.min()) + 1 if present.size else 0, np.int64)
  hist[learn_version + 1 - present] = tokens[present]  # staleness k = learn_version - version
  n = int(hist.sum())
  spread = np.asarray(counts.spreads, np.int64)
  spread = spread[spread >= 0]
  return {
      "staleness/token_mean": float(np.dot(np.arange(hist.size), hist)) / n if n else 0.0,
      "staleness/token_max": hist.size - 1 if n else 0,
      "staleness/token_histogram": hist.tolist(),
      "staleness/spread_mean": float(spread.sum()) / spread.size if spread.size else 0.0,
      "staleness/spread_max": int(spread.max()) if spread.size else 0,
      "staleness/mixed_frac": float((spread > 0).sum()) / spread.size if spread.size else 0.0,
  }


def token_staleness_metrics(batch: RolloutBatch, learn_version: int) -> dict[str, Any]:
  """The step's per-token staleness metrics (module docstring) of `batch` learned from at `learn_version`.

  Returns:
    {"staleness/token_mean", "staleness/token_max", "staleness/token_histogram" ([k]: response tokens k updates
    stale), "staleness/spread_mean", "staleness/spread_max" (versions per response, max - min),
    "staleness/mixed_frac" (responses drawn by more than one version)}; zeros when the batch has no response token.

  Raises:
    ValueError: a token drawn by a version newer than `learn_version` (it cannot have been sampled yet).
  """
  return staleness_from_counts(version_counts(batch), learn_version)
