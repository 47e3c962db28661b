# Issue 57: the off-policy toolbox of 2026 on the long-response task of issue 40 (eight-term chain_sum with a
# worked-step warm start, ~60-token responses; configs/studies/minpro_long.py): DPPO (Binary-TV mask), decoupled
# PPO (pi_prox scored at each step's first update) and VCPO's step (GRPO with each update's step x sqrt(ESS / B))
# beside MinPRO and GRPO, on-policy and at delay 8; 5 arms x 2 delays x 3 seeds = 30 runs, each logging per update
# the ESS of its weights and the cosine of consecutive gradients (docs/learner.md). Run it in its own workdir
# (docs/study.md):
#
#   G=configs/studies/toolbox.py
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/toolbox --dry-run   # the 30 commands
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/toolbox             # run / resume
#   (--grid=$G:N = seeds 0..N-1)
#
# Cost, from the long study's runs on a shared 2-core AMD EPYC (2026-12-03): ~26 min per seed for the warm start
# (cached in cache/ and shared with minpro_long's runs of that seed) and 7-8 min per run of 32 learning steps with
# its 9 evaluations; decoupled PPO adds a forward pass over each released batch (the long study's score pass took
# 12-17 % of a step). About 4 h for the grid, estimated; measured 2026-12-07 (same CPU type, warm starts cached by
# the lr stage): 1.7-4 min a run, 81 min for the 30 runs (results/toolbox, docs/study.md).
"""The toolbox grid of issue 57 (the numbers to tune are the constants below)."""

from minpro_jax.config_lib.files import load_module
from minpro_jax.study.grid import Grid

long = load_module("minpro_long.py", relative_to=__file__)  # the long-response setting and its fixed fields

ARMS = {  # name -> the overrides of the arm
    "minpro": {"loss.method": "minpro"},
    "grpo": {"loss.method": "grpo"},
    "dppo": {"loss.method": "dppo"},  # the paper's thresholds 0.15 / 0.15, ratio cap 10
    "decoupled-ppo": {"loss.method": "decoupled_ppo", "loss.proximal": "score"},  # C = 2, GRPO's clip range
    "grpo-vcpo": {"loss.method": "grpo", "learner.ess_step": True},  # VCPO's step (not its baseline)
}
# The learning rate of each arm: the rate issue 55's rule chose for its objective (minpro_long.CHOSEN_RATES, from
# the lr stage). DPPO and decoupled PPO are clipped / masked objectives with GRPO's trust region and no lr stage of
# their own, and VCPO's arm is GRPO with another step: all three take GRPO's rate. The grid refuses to run until the
# lr stage has set CHOSEN_RATES (on its first seed, 3e-5 collapsed MinPRO, so no placeholder rate is safe).
RATE_OF = {"minpro": "minpro", "grpo": "grpo", "dppo": "grpo", "decoupled-ppo": "grpo", "grpo-vcpo": "grpo"}


def learning_rates() -> dict:
  """{arm: learning rate} from minpro_long.CHOSEN_RATES. Raises ValueError while it is the placeholder."""
  chosen = long.stage2_rates()
  return {arm: chosen[objective] for arm, objective in RATE_OF.items()}


DELAYS = (0, 8)
SEEDS = (0, 1, 2)
REFERENCE = "grpo"  # each arm's paired difference with GRPO at the same delay and seed
LR = "optimizer.learning_rate"


def get_grid(arg=None) -> Grid:
  """arg: None (SEEDS), or "N" for seeds 0..N-1.

  Raises:
    ValueError: an arg that is not a positive integer, or the lr stage's rates not set yet (the runner's GridError).
  """
  if arg is not None and (not str(arg).isdigit() or int(arg) < 1):
    raise ValueError(f"pass the number of seeds: --grid=<file>:N with N >= 1, got {arg!r}")
  if set(RATE_OF) != set(ARMS):
    raise ValueError(f"toolbox.RATE_OF must name an objective for every arm of {sorted(ARMS)}")
  rates = learning_rates()
  return Grid(
      base="configs/default.py",
      fixed=long.FIXED,
      variants={name: {**overrides, LR: rates[name]} for name, overrides in ARMS.items()},
      axes={"delay": list(DELAYS)},
      seeds=tuple(range(int(arg))) if arg else SEEDS,
      derived=long.total_steps,  # LEARN_STEPS global steps with updates at every delay
      comparisons=(("variant", REFERENCE),),
      panel="delay",
      description=(
          f"issue 57's toolbox: DPPO, decoupled PPO and VCPO's step beside MinPRO and GRPO at delays {DELAYS}; "
          f"eight-term chain_sum, worked-step warm start, {long.MAX_NEW_TOKENS} new tokens, "
          f"{long.UPDATES_PER_STEP} updates per step, {long.LEARN_STEPS} learning steps at every delay"
      ),
  )
