"""Benchmark: one learner update on packed rows (`learner.row_tokens`) against the same update unpacked.

A mini-batch of M samples with long-tailed lengths (prompts uniform in [P/4, P], responses log-normal, capped at R:
about 40 % of the unpacked token slots real, as issue 37 reports for the paper setting) goes through
`Learner.update` unpacked (baseline: one sample per row of P + R tokens) and packed into rows of P + R tokens.
The two alternate, after two warm-up updates each (the compiles), and the median seconds of each side are reported with
the padding fraction of the token slots each ran (`packing.pad_fraction`).

Usage: ``python benchmarks/packing.py [--reps 5] [--samples 32] [--micro 8] [--prompt 64] [--response 448]``. Prints
JSON and writes ``benchmarks/results/packing.json``. Times are wall-clock seconds of compiled updates on the default
backend, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.rl.rollout import RolloutBatch

MODEL = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)


def _batch(n: int, p: int, r: int, seed: int = 0) -> RolloutBatch:
  rng = np.random.default_rng(seed)
  length = p + r
  prompt = rng.integers(p // 4, p + 1, n)
  resp = np.clip(np.round(rng.lognormal(np.log(0.3 * r), 0.8, n)), 4, r).astype(int)
  cols = np.arange(length)
  real = (cols >= p - prompt[:, None]) & (cols < p + resp[:, None])
  mask = (cols >= p) & real
  return RolloutBatch(
      tokens=np.where(real, rng.integers(1, MODEL["vocab_size"], (n, length)), 0).astype(np.int32),
      segment_ids=real.astype(np.int32),
      positions=np.where(real, np.cumsum(real, 1) - 1, 0).astype(np.int32),
      response_mask=mask,
      behavior_logp=np.where(mask, -rng.exponential(2.0, (n, length)), 0).astype(np.float32),
      learner_logp=np.zeros((n, length), np.float32),
      advantages=rng.normal(size=n).astype(np.float32),
      rewards=np.zeros(n, np.float32),
      group_ids=np.arange(n, dtype=np.int64),
      policy_version=np.zeros(n, np.int64),
      response_lengths=resp.astype(np.int32),
      truncated=np.zeros(n, bool),
  )


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--samples", type=int, default=32)
  ap.add_argument("--micro", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--response", type=int, default=448)
  args = ap.parse_args()
  model = init_model(get_preset("tiny", **MODEL), seed=0)
  params = nnx.split(model)[1]
  batch = _batch(args.samples, args.prompt, args.response)
  width = args.prompt + args.response
  sides = {"unpacked": None, "packed": width}
  learners, states, times, pads = {}, {}, {}, {}
  load_start = os.getloadavg()
  for name, row_tokens in sides.items():
    learners[name] = Learner(
        model, LossConfig("minpro"), OptimizerConfig(), micro_batch_size=args.micro, row_tokens=row_tokens
    )
    states[name] = learners[name].init_state(jax.tree.map(jnp.copy, params))
    for _ in range(2):  # the update compiles twice: for init_state's layout, then for its own pinned output's
      states[name], m = learners[name].update(states[name], batch)
    jax.block_until_ready(states[name])
    pads[name], times[name] = float(m["pad_fraction"]), []
  for _ in range(args.reps):
    for name, learner in learners.items():
      t0 = time.perf_counter()
      states[name], _ = learner.update(states[name], batch)
      jax.block_until_ready(states[name])
      times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
  out = {
      "what": "one Learner.update (forward + backward + AdamW) of a mini-batch, packed vs unpacked rows",
      "baseline": "unpacked",
      "config": {**vars(args), "row_tokens": width, "model": MODEL},
      "real_token_fraction": float(batch.segment_ids.mean()),
      "pad_fraction": pads,
      "seconds_median": med,
      "seconds_all": times,
      "speedup": med["unpacked"] / med["packed"],
      "machine": {
          "nproc": os.cpu_count(),
          "cpu": cpu,
          "load_start": load_start,
          "load_end": os.getloadavg(),
          "jax": jax.__version__,
          "backend": jax.default_backend(),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "python": platform.python_version(),
      },
      "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
  }
  text = json.dumps(out, indent=1)
  print(text)
  os.makedirs("benchmarks/results", exist_ok=True)
  with open("benchmarks/results/packing.json", "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
