"""A mean over seeds and its confidence interval, and how the summaries print one (docs/study.md).

Shared by the per-cell figures and paired differences (`aggregate`) and the difference-in-differences contrasts
(`contrasts`): one interval method for every number of a study.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LEVEL = 0.95
BOOTSTRAP_SEED = 0  # the bootstrap's resampling is seeded: the same files give the same summary


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean of n values and its confidence interval; `low`/`high` are None when n < 2 (no spread to estimate:
  one seed says nothing about another, so no interval is given rather than a zero-width one)."""

  mean: float
  low: float | None
  high: float | None
  n: int
  method: str

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def excludes(self, value: float = 0.0) -> bool:
    """Whether the interval lies wholly above or below `value` (False without an interval)."""
    return self.low is not None and (self.low > value or self.high < value)


def mean_ci(values: Sequence[float], level: float = LEVEL, method: str = "t", seed: int = BOOTSTRAP_SEED) -> Interval:
  """The mean of `values` and a two-sided `level` confidence interval for it.

  method "t" (the default): mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard deviation (ddof 1);
  exact when seed-to-seed variation is normal. The default, because at n = 3..5 seeds the bootstrap is
  anti-conservative (three values have only ten distinct resamples).
  method "bootstrap": `scipy.stats.bootstrap`, BCa, 9999 resamples with `numpy.random.default_rng(seed)`
  (deterministic); meant for >= ~10 values.
  Constant values give the zero-width interval [c, c] with either method.

  Args:
    values: the n per-seed values (finite).
    level: the confidence level, in (0, 1).
    method: "t" or "bootstrap".
    seed: the bootstrap's rng seed.

  Returns:
    An `Interval` (low = high = None when n == 1).

  Raises:
    ValueError: no values, a non-finite value, a level outside (0, 1), an unknown method.
  """
  x = np.asarray(values, np.float64).reshape(-1)
  if x.size == 0:
    raise ValueError("mean_ci: no values")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"mean_ci: values must be finite, got {x.tolist()}")
  if not 0 < level < 1:
    raise ValueError(f"mean_ci: level must lie in (0, 1), got {level}")
  if method not in ("t", "bootstrap"):
    raise ValueError(f"mean_ci: method {method!r}; choose 't' or 'bootstrap'")
  mean = float(x.mean())
  if x.size == 1:
    return Interval(mean, None, None, 1, method)
  if np.all(x == x[0]):
    return Interval(mean, mean, mean, int(x.size), method)
  from scipy import stats

  if method == "t":
    half = float(stats.t.ppf((1 + level) / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return Interval(mean, mean - half, mean + half, int(x.size), method)
  res = stats.bootstrap((x,), np.mean, confidence_level=level, method="BCa", rng=np.random.default_rng(seed))
  return Interval(mean, float(res.confidence_interval.low), float(res.confidence_interval.high), int(x.size), method)


def format_points(iv: Mapping[str, Any] | None, signed: bool = False) -> str:
  """ "26.4 [22.1, 30.7]" in percentage points; "26.4 (n=1)" without an interval."""
  if not iv:
    return "-"
  f = "{:+.1f}" if signed else "{:.1f}"
  m = f.format(100 * iv["mean"])
  if iv["low"] is None:
    return f"{m} (n=1)"
  return f"{m} [{f.format(100 * iv['low'])}, {f.format(100 * iv['high'])}]"
