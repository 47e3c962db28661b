# Issue 21: MinPRO against GRPO, GSPO, CISPO and M2PO under growing staleness, and MinPRO's prefix statistic
# ablated at the largest delay; 3 seeds per cell, 95 % intervals (docs/study.md).
#
#   G=configs/studies/minpro_staleness.py
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/minpro_staleness --dry-run   # the 72 commands
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/minpro_staleness             # run / resume
#   .venv/bin/python -m minpro_jax.study --grid=$G:5 --workdir=runs/minpro_staleness_5seeds    # 5 seeds
#
# 5 methods x 4 delays + 4 prefix ablations = 24 cells x 3 seeds = 72 runs. Measured on this project's 2-core CPU
# while another job kept the load at 4-6 (2026-12-01): MinPRO at delay 16 (48 global steps) took 175 s of wall and
# 165 s of CPU with the compilation and SFT caches warm; the first run of a seed also trains that seed's tokenizer
# and SFT warm start (about 4 min, cached in cache/), the first run of each method compiles its learner (about
# 1 min, cached in cache/jax_compilation). About 3 hours for the grid. Results: docs/study.md.
#
# Why staleness matters here: each global step's batch is split into UPDATES_PER_STEP updates, so a sample used
# at delay d is d * UPDATES_PER_STEP .. d * UPDATES_PER_STEP + UPDATES_PER_STEP - 1 updates old (128..135 at delay
# 16), on a task the tiny model is far from solving (three-term chain_sum, 9.5 % held-out pass@1 after SFT). One
# seed of MinPRO at delay 0 rose from 9.5 % to 15.1 % (final 13.6 %); at delay 16 it rose to 14.4 % while the
# staleness was still ramping up, then fell back to 9.4 % at the full 128..135 (learner-behavior |log ratio| about
# 0.4-0.5 per token against 0.03 at delay 0).
"""The staleness study grid of issue 21 (numbers to tune are the constants below)."""

from minpro_jax.study.grid import Grid

METHODS = ("minpro", "grpo", "gspo", "cispo", "m2po")
DELAYS = (0, 2, 8, 16)
# MinPRO's prefix statistic (config.loss.prefix_statistic; its default "min" is the MinPRO cell itself). Note:
# "none" with MinPRO's default bounds is the CISPO objective exactly (minpro_jax/rl/objectives.py), so its runs
# repeat the cispo delay-16 cell (a determinism check at the cost of 3 runs).
PREFIX_ABLATIONS = ("mean", "geomean", "prod", "none")
SEEDS = (0, 1, 2)

# ------------------------------------------------------------------ the CPU-scale setting: TUNE THESE
UPDATES_PER_STEP = 8  # optimizer updates per global step (the default config: 4)
# global steps with updates; total_steps = LEARN_STEPS + delay, so every delay makes the same 256 updates. The
# staleness ramps up over the first `delay` of them (the buffer was filled by version 0), so at delay 16 the last
# LEARN_STEPS - 16 steps are at the full 128..135.
LEARN_STEPS = 32
LEARNING_RATE = 1e-4  # the default config's; 3e-4 collapsed MinPRO even at delay 0 (held-out 9.5 % -> 4 %)
PROMPTS_PER_STEP = 32  # x GROUP_SIZE = 256 samples per global step, 32 (4 groups) per update
GROUP_SIZE = 8
CHAIN_SUM = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2}  # config.data.task_config
EVAL_EVERY = 4  # global steps between held-out evaluations (plus step 0 and the end)
EVAL_PROBLEMS = 200  # held-out problems, EVAL_N samples each
EVAL_N = 4
# ------------------------------------------------------------------

FIXED = {
    "num_updates_per_step": UPDATES_PER_STEP,
    "prompts_per_step": PROMPTS_PER_STEP,
    "group_size": GROUP_SIZE,
    "optimizer.learning_rate": LEARNING_RATE,
    **{f"data.task_config.{k}": v for k, v in CHAIN_SUM.items()},
    "eval.every": EVAL_EVERY,
    "eval.num_problems": EVAL_PROBLEMS,
    "eval.n": EVAL_N,
    "checkpoint.every": 4,  # a stopped run loses at most 4 global steps
    "log.tensorboard": False,
    "log.plots": False,
}


def total_steps(cell) -> dict:
  """Every delay gets LEARN_STEPS global steps with updates (the first `delay` steps only fill the buffer)."""
  return {"total_steps": LEARN_STEPS + int(cell["delay"])}


def get_grid(arg=None) -> Grid:
  """arg: the number of seeds, 0..arg-1 (default SEEDS)."""
  seeds = tuple(range(int(arg))) if arg else SEEDS
  return Grid(
      base="configs/default.py",
      fixed=FIXED,
      axes={"loss.method": list(METHODS), "delay": list(DELAYS)},
      cells=[{"loss.method": "minpro", "delay": max(DELAYS), "loss.prefix_statistic": s} for s in PREFIX_ABLATIONS],
      seeds=seeds,
      derived=total_steps,
      comparisons=(("loss.method", "minpro"), ("loss.prefix_statistic", "min")),
      contrasts=(("loss.method", "grpo", "delay", 0),),  # what staleness adds to each method's gap to GRPO
      panel="delay",
      description=(
          f"MinPRO vs baselines under staleness: three-term chain_sum, {UPDATES_PER_STEP} updates per step, "
          f"lr {LEARNING_RATE}, {LEARN_STEPS} learning steps at every delay"
      ),
  )
