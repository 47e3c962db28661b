"""Tier A's reward structures and drifts matched by per-token drift (issue 55; docs/mechanism.md).

A reward structure is named ``c<k>i`` or ``c<k>d``: k correct tokens per position (1 <= k <= V/2), the same after
every previous token (``i``, the study's original toy: `DEFAULT_STRUCTURE` = c3i) or moving with it (``d``:
`fidelity_toy.correct_sets`). Two toys of different structure drift differently along the same number of Adam steps,
so they are compared at matched per-token drift: the drifts ``lag<x>`` (mu = the point of pi's Adam trajectory, at
most `MAX_LAG` steps back, whose exact per-token E_mu|log pi - log mu| is nearest x) and ``rnd<x>`` (mu = pi's logits
+ sigma N(0, 1), sigma found by bisection so that the same quantity is x). Each cell records the value it reached.
"""

from __future__ import annotations

import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.lab import fidelity_toy as ft

DEFAULT_STRUCTURE = "c3i"  # 3 of V = 6 tokens correct at every position, whatever came before (issue 38's toy)
MAX_LAG = 128  # the Adam trajectory's kept points
_STRUCTURE = re.compile(r"c([1-9][0-9]*)([id])")
_MATCHED = re.compile(r"(lag|rnd)([0-9]*\.?[0-9]+)")
SPLIT_METHODS = ("minpro:min", "minpro:prod", "cispo", "grpo")  # the weight-split table's rows


def parse_structure(label: str, vocab: int) -> tuple[int, bool]:
  """ "c1d" -> (1, True). Raises ValueError naming the form and the range of k (1 .. vocab // 2)."""
  m = _STRUCTURE.fullmatch(label)
  if not m or not 1 <= int(m.group(1)) <= vocab // 2:
    raise ValueError(f"a reward structure is c<k>i or c<k>d with 1 <= k <= {vocab // 2} (V = {vocab}), got {label!r}")
  return int(m.group(1)), m.group(2) == "d"


def matched_target(drift: str) -> tuple[str, float] | None:
  """ "lag0.05" -> ("lag", 0.05); "rnd0.1" -> ("rnd", 0.1); None for another drift."""
  m = _MATCHED.fullmatch(drift)
  return (m.group(1), float(m.group(2))) if m and float(m.group(2)) > 0 else None


def matched_lag(pi: jax.Array, thetas: list[jax.Array], target: float) -> tuple[int, float]:
  """(k, drift): the number of steps back along ``thetas`` (the trajectory, pi last) whose per-token drift
  `fidelity_toy.token_abs_log_ratio` is nearest ``target``, and that drift."""
  drift_of = jax.jit(ft.token_abs_log_ratio)
  drifts = np.array([float(drift_of(pi, th)) for th in thetas[::-1]])  # k = 0, 1, ...
  k = int(np.argmin(np.abs(drifts - target)))
  return k, float(drifts[k])


def matched_noise(pi: jax.Array, noise: jax.Array, target: float, iters: int = 40) -> tuple[float, float]:
  """(sigma, drift): the scale of ``noise`` (pi's shape) for which mu = pi + sigma * noise has per-token drift
  ``target`` (bisection on [0, 10]: the drift grows with sigma), and the drift reached."""
  drift_of = jax.jit(lambda s: ft.token_abs_log_ratio(pi, pi + s * noise))
  lo, hi = 0.0, 10.0
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if float(drift_of(mid)) < target else (lo, mid)
  sigma = 0.5 * (lo + hi)
  return sigma, float(drift_of(sigma))


def split_means(sums: np.ndarray, tokens: np.ndarray) -> tuple[dict[str, list], list[float]]:
  """Per method, the mean token weight over each part of `fidelity_toy.SPLIT` (None for a part without tokens),
  and each part's share of the tokens, from the summed ``sums`` [M, 3] and ``tokens`` [3]."""
  means = {
      name: [float(s / n) if n > 0 else None for s, n in zip(sums[i], tokens)] for i, name in enumerate(ft.METHOD_NAMES)
  }
  return means, (tokens / max(tokens.sum(), 1.0)).tolist()


def split_table(results: list[dict]) -> str:
  """Markdown: per (drift, T) the mean token weight on rewarded responses, on failed ones up to their first wrong
  token and after it, for `SPLIT_METHODS` (means over seeds; the tokens' shares in the last column)."""
  rows = defaultdict(list)
  for r in results:
    if "weight_split" in r:
      rows[(r["drift"], r["T"], "E0" if r["tolerance"] == 0 else "Ek")].append(r)
  if not rows:
    return "(no cell records the weight split)\n"
  head = (
      "| drift, T, tol | per-token abs log ratio | " + " | ".join(SPLIT_METHODS) + " | tokens: succ / to err / after |"
  )
  lines = [head, "|---" * (len(SPLIT_METHODS) + 3) + "|"]
  for (drift, horizon, tol), cells in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):

    def mean(f):
      vals = [f(c) for c in cells]
      vals = [v for v in vals if v is not None]
      return np.mean(vals) if vals else None

    cols = []
    for m in SPLIT_METHODS:
      parts = [mean(lambda c, i=i, m=m: c["weight_split"][m][i]) for i in range(3)]
      cols.append(" / ".join("–" if p is None else f"{p:.2f}" for p in parts))
    share = " / ".join(f"{mean(lambda c, i=i: c['split_token_share'][i]):.2f}" for i in range(3))
    lr = mean(lambda c: c["abs_log_ratio_token"])
    lines.append(f"| {drift}, T={horizon}, {tol} | {lr:.3f} | " + " | ".join(cols) + f" | {share} |")
  return "\n".join(lines) + "\n"


def noise_of(seed: int, shape) -> jax.Array:
  """The fixed N(0, 1) direction of the ``noise<sigma>`` and ``rnd<x>`` drifts of seed ``seed``."""
  return jax.random.normal(jax.random.PRNGKey(10**6 + seed), shape, jnp.float32)
