"""Benchmark: the MinPRO prefix-min weight, forward and forward+backward of the loss.

Variants plug a different scan into the same weight pipeline (mask -> scan -> exclusive shift -> log-space clip
-> exp -> detached weight -> -mean(w * A * logp)):
  * ``assoc_scan``: ``objectives.prefix_log_factor`` (``jax.lax.associative_scan(jnp.minimum)``; one row = one response),
  * ``assoc_scan_segmented``: the same with ``segment_ids`` (packed-row operator on (reset flag, value) pairs),
  * ``cummin``: ``jax.lax.cummin``,
  * ``lax_scan``: a sequential ``jax.lax.scan`` over T carrying the running min,
  * ``cumsum_floor`` (baseline): ``jnp.cumsum`` of the same array in place of the min (memory-bound floor).
Usage: ``python benchmarks/prefix_scan.py [--reps N] [--shapes 8x2048,64x8192,16x20480]``. Prints JSON and writes
``benchmarks/results/prefix_scan.json``. Times are wall-clock seconds per call (min and median over reps, after a
warm-up compile), measured in the same run on the default JAX backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.rl.objectives import prefix_log_factor

LOG_HI = math.log1p(0.28)


def _excl(incl, fill):
  return jnp.concatenate([jnp.full_like(incl[:, :1], fill), incl[:, :-1]], axis=1)


def _scan_min_sequential(x):
  def step(carry, col):
    carry = jnp.minimum(carry, col)
    return carry, carry

  _, out = jax.lax.scan(step, jnp.full(x.shape[:1], jnp.inf, x.dtype), x.T)
  return out.T


def _log_factor(kind, lr, valid, seg):
  if kind == "assoc_scan":
    return prefix_log_factor(lr, valid, "min")
  if kind == "assoc_scan_segmented":
    return prefix_log_factor(lr, valid, "min", segment_ids=seg)
  x = jnp.where(valid, lr, jnp.inf if kind != "cumsum_floor" else 0.0)
  if kind == "cummin":
    excl = _excl(jax.lax.cummin(x, axis=1), jnp.inf)
  elif kind == "lax_scan":
    excl = _excl(_scan_min_sequential(x), jnp.inf)
  elif kind == "cumsum_floor":
    return jnp.where(valid, _excl(jnp.cumsum(x, axis=1), 0.0), 0.0)
  else:
    raise ValueError(kind)
  return jnp.where(valid & (excl < jnp.inf), excl, 0.0)


def make_fns(kind):
  def weight(logp, old, valid, seg):
    lr = jnp.where(valid, logp - old, 0.0)
    log_w = jnp.clip(_log_factor(kind, lr, valid, seg) + lr, -jnp.inf, LOG_HI)
    return jnp.where(valid, jnp.exp(log_w), 0.0)

  def loss(logp, old, adv, valid, seg):
    w = jax.lax.stop_gradient(weight(logp, old, valid, seg))
    return -jnp.sum(w * adv[:, None] * jnp.where(valid, logp, 0.0)) / jnp.maximum(jnp.sum(valid), 1)

  return jax.jit(weight), jax.jit(jax.value_and_grad(loss))


def _time(fn, args, reps):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times), statistics.median(times)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--shapes", default="8x2048,64x8192,16x20480")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prefix_scan.json"))
  args = ap.parse_args()
  kinds = ("assoc_scan", "assoc_scan_segmented", "cummin", "lax_scan", "cumsum_floor")
  fns = {k: make_fns(k) for k in kinds}
  results = []
  for shape in args.shapes.split(","):
    b, t = map(int, shape.split("x"))
    rng = np.random.default_rng(0)
    old = jnp.asarray(rng.uniform(-4, -0.01, (b, t)), jnp.float32)
    logp = old + jnp.asarray(rng.normal(0, 0.2, (b, t)), jnp.float32)
    lengths = rng.integers(t // 2, t + 1, b)
    valid = jnp.asarray(np.arange(t)[None] < lengths[:, None])
    seg = valid.astype(jnp.int32)
    adv = jnp.asarray(rng.normal(size=b), jnp.float32)
    ref_w = fns["lax_scan"][0](logp, old, valid, seg)
    row = {"B": b, "T": t}
    for kind in kinds:
      w_fn, vg_fn = fns[kind]
      if kind != "cumsum_floor":  # every min variant computes the same weights
        np.testing.assert_allclose(np.asarray(w_fn(logp, old, valid, seg)), np.asarray(ref_w), rtol=1e-6)
      reps = max(3, args.reps // 4) if kind == "lax_scan" else args.reps
      fwd = _time(w_fn, (logp, old, valid, seg), reps)
      fb = _time(vg_fn, (logp, old, adv, valid, seg), reps)
      row[kind] = {"fwd_s_min": fwd[0], "fwd_s_median": fwd[1], "fwd_bwd_s_min": fb[0], "fwd_bwd_s_median": fb[1]}
    base = row["cumsum_floor"]["fwd_bwd_s_min"]
    seq = row["lax_scan"]["fwd_bwd_s_min"]
    row["ratios_fwd_bwd_min"] = {
        f"{k}_over_cumsum": row[k]["fwd_bwd_s_min"] / base for k in kinds if k != "cumsum_floor"
    } | {f"lax_scan_over_{k}": seq / row[k]["fwd_bwd_s_min"] for k in ("assoc_scan", "assoc_scan_segmented", "cummin")}
    results.append(row)
  big = next((r for r in results if (r["B"], r["T"]) == (16, 20480)), None)
  targets = None
  if big is not None:
    rat = big["ratios_fwd_bwd_min"]
    targets = {
        "assoc_scan_within_1.5x_cumsum": rat["assoc_scan_over_cumsum"] <= 1.5,
        "assoc_scan_10x_faster_than_lax_scan": rat["lax_scan_over_assoc_scan"] >= 10,
        "segmented_within_1.5x_cumsum": rat["assoc_scan_segmented_over_cumsum"] <= 1.5,
        "segmented_10x_faster_than_lax_scan": rat["lax_scan_over_assoc_scan_segmented"] >= 10,
    }
  report = {
      "benchmark": "prefix_scan",
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()[:1]],
      "jax_version": jax.__version__,
      "host": platform.machine(),
      "cpu_count": os.cpu_count(),
      "load_avg": os.getloadavg(),
      "reps": args.reps,
      "baseline": "cumsum_floor",
      "targets_at_16x20480_fwd_bwd": targets,
      "results": results,
  }
  text = json.dumps(report, indent=2)
  print(text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
