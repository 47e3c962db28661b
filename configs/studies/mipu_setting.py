# Issue 22, first step: find a CPU-scale setting in which the fp8 sampler's mismatch visibly hurts plain GRPO.
# GRPO at delay 0 on the staleness study's setting (minpro_staleness.py: three-term chain_sum, 8 updates per step,
# 32 prompts x 8), with the sampler at fp32 (no mismatch: its fp32 / lr 1e-4 run repeats that study's
# method-grpo_delay-0 run bit for bit), at fp8 as vLLM serves it by default (per-tensor weight and activation
# scales, e4m3) and at the coarser e5m2; two learning rates. Reading: docs/mipu.md.
#
#   .venv/bin/python -m minpro_jax.study --grid=configs/studies/mipu_setting.py --workdir=results/mipu_setting
"""The grid that looks for a setting where the fp8 mismatch hurts GRPO (issue 22)."""

from minpro_jax.config_lib.files import load_module
from minpro_jax.study.grid import Grid

staleness = load_module("minpro_staleness.py", relative_to=__file__)

SAMPLERS = {
    "fp32": {},
    "fp8": {"sampling.precision": "fp8", "sampling.fp8_activations": "tensor"},
    "fp8e5m2": {"sampling.precision": "fp8", "sampling.fp8_activations": "tensor", "sampling.fp8_format": "e5m2"},
}
LEARNING_RATES = (1e-4, 3e-4)
SEEDS = (1,)  # warm starts trained on this machine's CPU (aggregate.warm_start pairs only equal ones)


def get_grid(arg=None) -> Grid:
  """arg: the number of seeds, 1..arg (default SEEDS)."""
  fixed = {k: v for k, v in staleness.FIXED.items() if k != "optimizer.learning_rate"}
  return Grid(
      base="configs/default.py",
      fixed={**fixed, "loss.method": "grpo", "delay": 0, "total_steps": staleness.LEARN_STEPS},
      variants=SAMPLERS,
      axes={"optimizer.learning_rate": list(LEARNING_RATES)},
      seeds=tuple(range(1, int(arg) + 1)) if arg else SEEDS,
      comparisons=(("variant", "fp32"),),
      panel="optimizer.learning_rate",
      description="GRPO with an fp32 / fp8 / fp8-e5m2 sampler at two learning rates (staleness-study setting, delay 0)",
  )
