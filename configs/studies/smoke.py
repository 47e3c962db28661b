# A 2 x 2 grid of tiny runs (MinPRO and GRPO at delay 0 and 1), seconds each: the runner's end-to-end test.
#
#   python -m minpro_jax.study --grid=configs/studies/smoke.py --workdir=runs/smoke
#   python -m minpro_jax.study --grid=configs/studies/smoke.py:2 --workdir=runs/smoke2   # 2 seeds
#
# Expected on 2 CPU cores: about 20 s per run (mostly start-up and compilation); the numbers mean nothing (a
# 1-layer width-32 model, 5 SFT steps, 3 RL steps).
"""The smoke-test study grid (tests/test_study.py)."""

from minpro_jax.study.grid import Grid

TINY = {
    "total_steps": 3,
    "prompts_per_step": 4,
    "group_size": 2,
    "num_updates_per_step": 2,
    "micro_batch_size": 2,
    "data.size": 400,
    "data.max_prompt_tokens": 32,
    "sampling.max_new_tokens": 6,
    "sft.steps": 5,
    "sft.batch_size": 16,
    "sft.num_examples": 64,
    "eval.every": 2,
    "eval.num_problems": 8,
    "eval.n": 2,
    "eval.ks": (1, 2),
    "checkpoint.every": 1,
    "log.tensorboard": False,
    "log.plots": False,
    "model.overrides.hidden_size": 32,
    "model.overrides.intermediate_size": 64,
    "model.overrides.num_layers": 1,
    "model.overrides.num_heads": 2,
    "model.overrides.num_kv_heads": 1,
    "model.overrides.head_dim": 16,
}


def get_grid(arg=None) -> Grid:
  """arg: the number of seeds (default 1)."""
  seeds = tuple(range(int(arg))) if arg else (0,)
  return Grid(
      base="configs/default.py",
      fixed=TINY,
      axes={"loss.method": ["minpro", "grpo"], "delay": [0, 1]},
      seeds=seeds,
      comparisons=(("loss.method", "minpro"),),
      panel="delay",
      description="smoke grid: minpro and grpo at delay 0 and 1, tiny model (tests only)",
  )
