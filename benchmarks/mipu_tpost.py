"""How large MIPU's validation draw must be for the Step-2 test to say anything: T_post, its standard error and
the directly measured J(mu') - J(pi') at equal weights, for several validation sizes and sampler precisions.

At the warm-start parameters (the default config's SFT checkpoint, before any RL update) the sampler (mu, at
`--precisions`) and the learner (pi, fp32) share their weights, so every difference between them is the precision
mismatch the test is meant to see. For each precision and validation size (prompts x samples per prompt) the
script draws `--draws` independent validation sets (different global steps seed them, as in a run), and reports:
the mean T_post, its empirical spread across draws, the mean of the per-draw standard error
(`mipu.t_post_standard_error`, validation groups as the units), |mean T_post| / SE (how many standard errors the
mismatch signal is: below ~2 the accept / reject decision is a coin flip), the ground truth J(mu) - J(pi) (the same
prompts and seed sampled at fp32; paired, so the two draws share their randomness) and the token K3 mismatch.

Run:  .venv/bin/python benchmarks/mipu_tpost.py [--draws 8] [--sizes 8x4,32x4,64x8,128x8] [--precisions fp8,bf16]
          [--setting default|mipu_study] [--out PATH]
`--setting mipu_study`: the MIPU study's setting (`configs/studies/mipu.py`, seed 1, its fp8 options).
Writes benchmarks/results/mipu_tpost.json. The SFT warm start is cached under cache/ (the first run trains it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax import nnx  # noqa: E402

from minpro_jax.config_lib import set_fields  # noqa: E402
from minpro_jax.config_lib.defaults import get_config  # noqa: E402
from minpro_jax.rl.aggregation import mismatch_metrics  # noqa: E402
from minpro_jax.run.trainer import Trainer  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mipu_tpost.json")


def study_setting(c, precision: str):
  """The MIPU study's setting (`configs/studies/mipu.py`: its fixed fields, seed 1, its fp8 options)."""
  from minpro_jax.config_lib.files import load_module

  study = load_module("configs/studies/mipu.py")

  g = study.get_grid()
  fields = {**g.fixed, "seed": 1}
  if precision == "fp8":
    fields.update(study.FP8)
  return set_fields(c, fields)


def measure(precision: str, sizes: list[tuple[int, int]], draws: int, workdir: str, setting: str) -> list[dict]:
  c = get_config()
  c.sampling.precision = precision
  if setting == "mipu_study":
    c = study_setting(c, precision)
  c.workdir = workdir
  c.mipu.rollback, c.mipu.ground_truth = True, True
  c.mipu.val_prompts, c.mipu.val_group_size = max(p for p, _ in sizes), max(g for _, g in sizes)
  tr = Trainer.from_config(c)
  state = tr.learner.init_state(nnx.split(tr.model)[1])
  rows = []
  for prompts, group in sizes:
    c.mipu.val_prompts, c.mipu.val_group_size = prompts, group
    t_post, se, j_gap, k3 = [], [], [], []
    t0 = time.time()
    for d in range(draws):
      _, m, vb = tr.mipu_step.check(state, 10_000 + d)
      mm = mismatch_metrics(vb.learner_logp, vb.behavior_logp, vb.response_mask)
      t_post.append(m["mipu/t_post"])
      se.append(m["mipu/t_post_se"])
      j_gap.append(m["mipu/j_gap"])
      k3.append(float(mm["mismatch_k3"]))
    t_post, se, j_gap = map(np.asarray, (t_post, se, j_gap))
    row = {
        "precision": precision,
        "val_prompts": prompts,
        "val_group_size": group,
        "samples": prompts * group,
        "draws": draws,
        "t_post_mean": float(t_post.mean()),
        "t_post_spread": float(t_post.std(ddof=1)),
        "t_post_se_mean": float(se.mean()),
        "signal_over_se": float(abs(t_post.mean()) / se.mean()),
        "j_gap_mean": float(j_gap.mean()),
        "j_gap_spread": float(j_gap.std(ddof=1)),
        "mismatch_k3": float(np.mean(k3)),
        "seconds_per_check": (time.time() - t0) / draws,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
  tr.close()
  return rows


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--draws", type=int, default=8)
  ap.add_argument("--sizes", default="8x4,32x4,64x8,128x8")
  ap.add_argument("--precisions", default="fp8,bf16")
  ap.add_argument("--setting", choices=("default", "mipu_study"), default="default")
  ap.add_argument("--out", default=OUT)
  a = ap.parse_args(argv)
  sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for precision in a.precisions.split(","):
      rows += measure(precision, sizes, a.draws, os.path.join(tmp, precision), a.setting)
  cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
  out = {
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "cpu": cpu or platform.processor(),
      "config": f"setting {a.setting} at the SFT warm start (no RL update), fp32 learner",
      "setting": a.setting,
      "rows": rows,
  }
  os.makedirs(os.path.dirname(a.out), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
