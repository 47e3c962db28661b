"""Seconds per phase (sample / grade / score / learn) and tokens/s of the trainer's global step.

Runs the real `Trainer` for a few global steps of each config (delay 0 so every step learns; SFT and periodic
evaluation off, so only the RL step is timed) and reports the median over the steps after the first (which
compiles). The baseline named in the JSON is the sampling phase itself: `learn_over_sample` says how the
learner's time compares with generation in the same run.

  .venv/bin/python benchmarks/train_step.py                 # default + smollm2_135m
  .venv/bin/python benchmarks/train_step.py --configs default --steps 4

Writes benchmarks/results/train_step.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from minpro_jax.runtime.host_memory import keep_freed_host_memory  # noqa: E402


def _config(name: str):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def bench(name: str, steps: int) -> dict:
  from minpro_jax.run.metrics_log import read_metrics
  from minpro_jax.run.trainer import Trainer

  c = _config(name)
  work = tempfile.mkdtemp(prefix=f"bench_{name}_")
  c.workdir = os.path.join(work, "run")
  c.sft.cache_dir = os.path.join(REPO, "cache")  # reuse the default run's tokenizer/SFT caches when present
  c.sft.enabled = False
  c.total_steps = steps
  c.delay = 0
  c.eval.every = 0
  c.eval.num_problems = 4
  c.eval.n = 1
  c.eval.ks = (1,)
  c.checkpoint.every = 0
  c.log.plots = False
  c.log.progress = False
  c.log.tensorboard = False
  t0 = time.time()
  trainer = Trainer.from_config(c)
  setup = time.time() - t0
  trainer.run()
  recs = [r for r in read_metrics(c.workdir) if 0 <= r.get("step", -1) < steps]
  warm = recs[1:] or recs
  med = lambda k: statistics.median(r[k] for r in warm if r.get(k) is not None)  # noqa: E731
  out = {
      "config": name,
      "global_steps_timed": len(warm),
      "setup_s": setup,
      "samples_per_step": c.prompts_per_step * c.group_size,
      "updates_per_step": c.num_updates_per_step,
      "first_step_s (compile)": recs[0]["time/step"],
      "step_s": med("time/step"),
      "sample_s": med("time/sample"),
      "grade_s": med("time/grade"),
      "score_s": med("time/score"),
      "learn_s": med("time/learn"),
      "sample_tokens_per_s": med("throughput/sample_tokens_per_s"),
      "learn_tokens_per_s": med("throughput/learn_tokens_per_s"),
  }
  out["learn_over_sample"] = out["learn_s"] / out["sample_s"]
  return out


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", nargs="+", default=["default", "smollm2_135m"])
  ap.add_argument("--steps", type=int, default=4)
  args = ap.parse_args()
  keep_freed = keep_freed_host_memory()  # as the train entry point does
  results = {
      "benchmark": "train_step",
      "baseline": "the sampling phase of the same run (learn_over_sample)",
      "machine": {
          "nproc": os.cpu_count(),
          "platform": platform.platform(),
          "loadavg": os.getloadavg(),
          "host_memory_keep_freed": keep_freed,
          "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      },
      "runs": [bench(name, args.steps) for name in args.configs],
  }
  text = json.dumps(results, indent=2)
  print(text)
  os.makedirs(os.path.join(REPO, "benchmarks", "results"), exist_ok=True)
  with open(os.path.join(REPO, "benchmarks", "results", "train_step.json"), "w") as f:
    f.write(text + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
