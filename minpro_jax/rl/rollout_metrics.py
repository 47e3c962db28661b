"""A step's rollout metrics from each process's own rows: per-row statistics, one small all-gather, no global batch.

Each process reduces its rows of the step's batch ([n, R] or [n, L] arrays) to a few numbers per row; the [N, k]
table of every row is all-gathered (`multihost.gather_rows`, N x k float64: 4,096 x 11 at the 30B-A3B paper
batch, 350 KiB) and the metrics are computed from it the same way on every process. So they do not depend on the
process count, and a process never needs another's [N, R] arrays (docs/multihost.md, "Per-host batches").

Equal to the former whole-batch formulas, bit for bit, for every per-sample metric (rewards, accuracy, lengths and
their quantiles, truncation, zero advantages, token counts). Token means (`response/entropy`, the sampler-learner
mismatch) sum per row first, then over rows: they differ from a flat float32 sum over [N, R] by float32 round-off.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from minpro_jax.models.moe import route_mismatch
from minpro_jax.rl.aggregation import LOG_RATIO_CLAMP, k3
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime import multihost, row_layout
from minpro_jax.sampling.batch import GenerationBatch

# the per-row columns gathered from every process
_SAMPLE_COLUMNS = ("reward", "length", "truncated", "entropy_sum", "zero_advantage")
_MISMATCH_COLUMNS = ("tokens", "abs_sum", "k1_sum", "k3_sum", "max_abs")


def sample_metrics(gen: GenerationBatch, batch: RolloutBatch, rows: slice, num_rows: int) -> dict[str, Any]:
  """The step's sample metrics (`reward/*` from the rewards, `response/*`, `advantage/zero_frac`) and its response
  token count under "tokens", over all `num_rows` rows of every process.

  Args:
    gen, batch: the step's sampler output and rollout batch, of every row or of this process's rows only; this
      process reads only their rows `rows`.
    rows: this process's rows of `gen` and `batch` (its `row_layout.process_group_rows`, or
      `multihost.process_rows(num_rows)`: the same contiguous even split; slice(None) when they hold only those).
    num_rows: the global row count N.

  Every process must call it at the same point (one all-gather in a multi-process run).
  """
  mask = np.asarray(gen.response_mask[rows])
  entropy = np.zeros(mask.shape, np.float32) if gen.entropy is None else np.asarray(gen.entropy[rows], np.float32)
  mine = np.stack(
      [
          batch.rewards[rows].astype(np.float64),
          gen.lengths[rows].astype(np.float64),
          gen.truncated[rows].astype(np.float64),
          (entropy * mask).sum(-1, dtype=np.float32).astype(np.float64),
          (batch.advantages[rows] == 0).astype(np.float64),
      ],
      -1,
  )
  table = dict(zip(_SAMPLE_COLUMNS, multihost.gather_rows(mine, num_rows).T))
  rewards = table["reward"].astype(np.float32)  # exact: float32 values round-trip through float64
  lengths = table["length"].astype(np.int32)
  n_tok = max(int(lengths.sum()), 1)
  return {
      "reward/mean": float(rewards.mean()),
      "reward/accuracy": float((rewards >= 1.0).mean()),
      "response/length_mean": float(lengths.mean()),
      "response/length_max": int(lengths.max()),
      # deciles of this step's lengths: `python -m minpro_jax.aot --budget --lengths=metrics.jsonl` draws from them
      "response/length_quantiles": np.quantile(lengths, np.linspace(0, 1, 11)).round(1).tolist(),
      "response/truncated_frac": float(table["truncated"].astype(bool).mean()),
      "response/entropy": float(table["entropy_sum"].astype(np.float32).sum() / n_tok),
      "advantage/zero_frac": float(table["zero_advantage"].mean()),
      "tokens": n_tok,
  }


def mismatch_metrics(batch: RolloutBatch, rows: slice, num_rows: int) -> dict[str, float]:
  """`aggregation.mismatch_metrics` of `batch.learner_logp` against `batch.behavior_logp` over every process's
  response tokens, from this process's rows `rows` (as `sample_metrics`): mean |delta|, max |delta|, the k1 and k3
  estimates, delta = learner - behavior (clamped to +-20 before k3), as floats named as there."""
  valid = jnp.asarray(batch.response_mask[rows]).astype(bool)
  a = jnp.where(valid, jnp.asarray(batch.learner_logp[rows]), 0.0).astype(jnp.float32)
  b = jnp.where(valid, jnp.asarray(batch.behavior_logp[rows]), 0.0).astype(jnp.float32)
  delta = jnp.where(valid, a - b, 0.0)
  per_row = jnp.stack(
      [
          valid.sum(-1).astype(jnp.float32),
          jnp.abs(delta).sum(-1),
          (-delta).sum(-1),
          jnp.where(valid, k3(jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0).sum(-1),
          jnp.abs(delta).max(-1, initial=0.0),
      ],
      -1,
  )
  table = dict(zip(_MISMATCH_COLUMNS, multihost.gather_rows(np.asarray(per_row, np.float64), num_rows).T))
  tokens = max(float(table["tokens"].sum()), 1.0)
  mean = lambda col: float(table[col].astype(np.float32).sum() / np.float32(tokens))  # noqa: E731
  return {
      "mismatch_abs_mean": mean("abs_sum"),
      "mismatch_max_abs": float(table["max_abs"].max(initial=0.0)),
      "mismatch_k1": mean("k1_sum"),
      "mismatch_k3": mean("k3_sum"),
  }


def route_mismatch_frac(own_routes, recorded_routes, per_process: bool) -> float:
  """`moe.route_mismatch`'s fraction of the recorded routes the learner's router picks other experts for: over
  these rows, or with `per_process` over every process's rows (each passes its own; their counts are summed with
  `row_layout.batch_stats`, so the fraction equals one process's). Collective with `per_process` in a
  multi-process run."""
  frac, count = route_mismatch(own_routes, recorded_routes)
  if not per_process:
    return frac
  stats = row_layout.batch_stats({"differ": np.asarray([round(frac * count)]), "recorded": np.asarray([count])})
  total = stats["recorded"]["sum"]
  return stats["differ"]["sum"] / total if total else 0.0
