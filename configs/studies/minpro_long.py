# Issue 40: the staleness study on responses long enough for the methods to differ: eight-term chain_sum with a
# worked-step warm start (sft.target=worked: " 15+43=58 58+75=133 ... \boxed{154}", 43-84 tokens with the eos),
# so a response is ~60 tokens instead of ~6. Run it in stages, each in its own workdir (docs/study.md):
#
#   G=configs/studies/minpro_long.py
#   .venv/bin/python -m minpro_jax.study --grid=$G:stage0 --workdir=results/minpro_long_stage0     # lr, GRPO delay 0
#   .venv/bin/python -m minpro_jax.study --grid=$G:stage0b --workdir=results/minpro_long_stage0b   # 3 methods, delay 8
#   .venv/bin/python -m minpro_jax.study --grid=$G:stage1 --workdir=results/minpro_long            # 15 cells x 5 seeds
#   .venv/bin/python -m minpro_jax.study --grid=$G:rate --workdir=results/minpro_long_rate         # stage 1 at lr 1e-5
#   .venv/bin/python -m minpro_jax.study --grid=$G:lr --workdir=results/minpro_long_lr             # a rate per objective
#   .venv/bin/python -m minpro_jax.study --grid=$G:stage2 --workdir=results/minpro_long_stage2     # at those rates
#   (stage1:N = N seeds; add --dry-run to see the commands)
#
# Stage 0 (one seed): GRPO on-policy at each of STAGE0_RATES; keep the largest rate whose held-out pass@1 rises
# without a collapse (issue 40: MinPRO at lr 1e-4 collapsed within 4 learning steps at staleness 8-23 here). Stage
# 0b: MinPRO, GRPO and CISPO at delay 8 at that rate (does staleness separate them at all?). Stage 1: MinPRO, GRPO,
# CISPO, GSPO, M2PO at delays 2 and 8, MinPRO and GRPO at delay 0, MinPRO's prefix statistic prod / geomean / mean
# at delay 8: 15 cells x 5 seeds, every run on one CPU type so a seed's runs share their warm start. The rate check
# (after stage 1, which found MinPRO behind GRPO on-policy as well): MinPRO and GRPO at delays 0 and 8 at the next
# rate down, RATE_CHECK_RATE, seeds 0-2: does MinPRO's gap to GRPO close at a rate chosen for it rather than for GRPO?
#
# Stage 0 ran on 2026-12-03 (AMD EPYC, 2 shared cores; results/minpro_long_stage0), held-out pass@1 12.0 % after SFT:
# lr 1e-4 peak 5.0 % / final 1.2 % (collapsed), 3e-5 peak 20.8 % / final 19.2 %, 1e-5 peak 24.5 % / final 21.4 %.
# The rule chosen before the runs keeps the largest rate that learns: LEARNING_RATE = 3e-5 (1e-5 ended 2 points
# higher on this one seed, within the ~±3 points of an evaluation's sampling noise).
#
# Cost on a shared 2-core CPU (2026-12-03): the warm start, 600 SFT steps of 64 rows of 136 tokens, is ~26 min per
# seed (cached in cache/ and shared by every run of that seed); a run of 32 learning steps plus its 9 evaluations is
# 7-8 min: stage 0b about 25 min, stage 1 (75 runs) about 10 h, over several sittings (the runner skips finished
# runs).
"""The long-response staleness grid of issue 40 (numbers to tune are the constants below)."""

from minpro_jax.config_lib.files import load_module
from minpro_jax.study.grid import Grid

short = load_module("minpro_staleness.py", relative_to=__file__)  # the short staleness study

STAGES = ("stage0", "stage0b", "stage1", "rate", "lr", "stage2")
STAGE0_RATES = (1e-4, 3e-5, 1e-5)  # GRPO on-policy; the largest that learns is LEARNING_RATE
STAGE0B_METHODS = ("minpro", "grpo", "cispo")
STAGE0B_DELAY = 8
METHODS = short.METHODS  # minpro, grpo, gspo, cispo, m2po
DELAYS = (2, 8)  # every method; delay 0 only for MinPRO and GRPO (ON_POLICY_METHODS)
ON_POLICY_METHODS = ("minpro", "grpo")
PREFIX_ABLATIONS = ("prod", "geomean", "mean")  # MinPRO's prefix statistic at the largest delay ("min" = MinPRO)
STAGE0_SEEDS = (0,)
RATE_CHECK_RATE = 1e-5  # the next rate of STAGE0_RATES below LEARNING_RATE
RATE_CHECK_DELAYS = (0, 8)
RATE_CHECK_SEEDS = (0, 1, 2)  # stage 1's seeds, so each run pairs with its stage-1 run at LEARNING_RATE
LR = "optimizer.learning_rate"
SEEDS = (0, 1, 2, 3, 4)

# Issue 55: a learning rate per objective (stage "lr"), then stage 2 at those rates. The rule, fixed before any run
# of stage "lr": for each objective, the rate of LR_RATES with the highest held-out AUC averaged over LR_SEEDS; a
# rate whose mean AUC is within LR_TIE_POINTS of that best is tied with it, and the smallest tied rate is chosen
# (a smaller step is the safer one when the data cannot tell them apart). `choose_rates` applies it to the lr
# study's summary.json; CHOSEN_RATES holds its answer once that study is complete (tests/test_study_grids.py
# checks the two agree), and stage 2 refuses to start before.
OBJECTIVES = {  # name -> the loss overrides of the objective; minpro-ppo is MinPRO with a trust region (issue 55)
    "minpro": {"loss.method": "minpro"},
    "minpro-ppo": {"loss.method": "minpro", "loss.surrogate": "ppo", "loss.eps_low": 0.2},  # GRPO's clip range
    "cispo": {"loss.method": "cispo"},
    "grpo": {"loss.method": "grpo"},
    "gspo": {"loss.method": "gspo"},
}
LR_RATES = (1e-5, 2e-5, 3e-5)
LR_SEEDS = (0, 1, 2)
LR_TIE_POINTS = 1.0  # held-out pass@1 points of mean AUC
# choose_rates(results/minpro_long_lr/summary.json "cells"): the lr stage's 45 runs (seeds 0-2, 2026-12-07, AMD EPYC,
# commit 535d297). Mean AUC at 1e-5 / 2e-5 / 3e-5: minpro 18.9 / 18.9 / 13.7, minpro-ppo 19.0 / 20.1 / 18.8, cispo
# 18.7 / 17.8 / 14.1, grpo 19.2 / 20.0 / 18.6, gspo 18.5 / 18.8 / 18.0 (every interval about +-15 points: the rule
# picks among rates the data cannot tell apart, as it was fixed to)
CHOSEN_RATES = {"minpro": 1e-5, "minpro-ppo": 2e-5, "cispo": 1e-5, "grpo": 1e-5, "gspo": 1e-5}
STAGE2_DELAYS = (0, 2, 8)
STAGE2_REFERENCE = "grpo"  # the staleness contrast (X - GRPO at delay d) - (X - GRPO at delay 0) per objective X

# ------------------------------------------------------------------ the long-response setting: TUNE THESE
LEARNING_RATE = 3e-5  # chosen by stage 0 from STAGE0_RATES (header); None would stop stages 0b and 1
UPDATES_PER_STEP = short.UPDATES_PER_STEP  # 8, as the short study: staleness d*8 .. d*8+7 updates at delay d
LEARN_STEPS = short.LEARN_STEPS  # 32 global steps with updates at every delay (256 updates)
PROMPTS_PER_STEP, GROUP_SIZE = short.PROMPTS_PER_STEP, short.GROUP_SIZE  # 32 x 8 samples per global step
CHAIN_SUM = {"min_terms": 8, "max_terms": 8, "min_digits": 1, "max_digits": 2}  # config.data.task_config
# Measured with the trained tokenizer (vocab 384) on 2,000 SFT problems of seed 0 (2026-12-03, AMD EPYC):
# prompts 39-47 tokens (with bos); worked targets 48-84 tokens boxed (median 62), 43-77 bare, with the eos; prompt
# + target 87-131 tokens. So: prompts to 48, SFT rows of 136 (no example dropped), 128 new tokens (the longest
# target fits with 44 to spare for a longer, wrong one).
MAX_PROMPT_TOKENS = 48
MAX_NEW_TOKENS = 128
SFT = {"sft.target": "worked", "sft.max_len": 136, "sft.steps": 600}  # batch 64, lr 2e-3, boxed_fraction 0.5
EVAL_EVERY = 4  # global steps between held-out evaluations (plus step 0 and the end)
EVAL_PROBLEMS = 200  # held-out problems, EVAL_N samples each
EVAL_N = 4
# ------------------------------------------------------------------

FIXED = {
    "num_updates_per_step": UPDATES_PER_STEP,
    "prompts_per_step": PROMPTS_PER_STEP,
    "group_size": GROUP_SIZE,
    **{f"data.task_config.{k}": v for k, v in CHAIN_SUM.items()},
    "data.max_prompt_tokens": MAX_PROMPT_TOKENS,
    "sampling.max_new_tokens": MAX_NEW_TOKENS,
    **SFT,
    "eval.every": EVAL_EVERY,
    "eval.num_problems": EVAL_PROBLEMS,
    "eval.n": EVAL_N,
    "checkpoint.every": 4,  # a stopped run loses at most 4 global steps
    "log.tensorboard": False,
    "log.plots": False,
}


def total_steps(cell) -> dict:
  """Every delay gets LEARN_STEPS global steps with updates (the first `delay` steps only fill the buffer)."""
  return {"total_steps": LEARN_STEPS + int(cell.get("delay", 0))}


def chosen_rate() -> float:
  """LEARNING_RATE, once stage 0 has set it. Raises ValueError (the runner's GridError) while it is the placeholder."""
  if LEARNING_RATE is None:
    raise ValueError(
        "minpro_long.LEARNING_RATE is still the placeholder None; run stage 0 (--grid=...minpro_long.py:stage0), "
        f"then set it in the grid file to the largest of {STAGE0_RATES} that learned"
    )
  return float(LEARNING_RATE)


def choose_rates(cells: list) -> dict:
  """The rule above applied to the lr study: objective -> its rate.

  Args:
    cells: the lr study's per-cell records, `summary.json` "cells" (each {"cell": "variant-<objective>_learning_rate-
      <rate>", "metrics": {"auc": {"mean": ..., "n": ...}, ...}, ...}).
  Raises:
    ValueError: a cell of the grid is missing or has fewer than len(LR_SEEDS) finished seeds.
  """
  by_name = {c["cell"]: c.get("metrics", {}) for c in cells}
  out = {}
  for objective in OBJECTIVES:
    auc = {}
    for rate in LR_RATES:
      name = f"variant-{objective}_learning_rate-{rate}"
      cell = by_name.get(name, {}).get("auc") or {}
      if cell.get("n", 0) < len(LR_SEEDS) or cell.get("mean") is None:
        raise ValueError(f"the lr study lacks seeds of {name}: run it to its end before choosing the rates")
      auc[rate] = float(cell["mean"])
    best = max(auc.values())
    out[objective] = min(r for r, a in auc.items() if a >= best - LR_TIE_POINTS / 100)
  return out


def stage2_rates() -> dict:
  """CHOSEN_RATES, once the lr study has set it. Raises ValueError while it is the placeholder."""
  if CHOSEN_RATES is None:
    raise ValueError(
        "minpro_long.CHOSEN_RATES is still the placeholder None; run the lr stage (--grid=...minpro_long.py:lr) to "
        "its end, then set it to choose_rates() of its summary.json"
    )
  return dict(CHOSEN_RATES)


def parse_arg(arg: str | None) -> tuple[str, int | None]:
  """ "stage1:3" -> ("stage1", 3); "stage0" -> ("stage0", None). Raises ValueError naming the choices."""
  stage, _, n = (arg or "").partition(":")
  if stage not in STAGES or (n and not n.isdigit()) or (n and int(n) < 1):
    raise ValueError(f"pass a stage: --grid=<file>:STAGE[:SEEDS] with STAGE one of {STAGES}, got {arg!r}")
  return stage, int(n) if n else None


def get_grid(arg=None) -> Grid:
  """arg: one of STAGES, optionally ":N" for seeds 0..N-1 (default one seed for the stage-0 grids, SEEDS for stages
  1 and 2, RATE_CHECK_SEEDS for the rate check, LR_SEEDS for the lr stage)."""
  stage, n = parse_arg(arg)
  description = (
      f"long responses: eight-term chain_sum, worked-step warm start, {MAX_NEW_TOKENS} new tokens, "
      f"{UPDATES_PER_STEP} updates per step, {LEARN_STEPS} learning steps at every delay"
  )
  if stage == "stage0":
    return Grid(
        base="configs/default.py",
        fixed={**FIXED, "loss.method": "grpo", "delay": 0, "total_steps": LEARN_STEPS},
        axes={LR: list(STAGE0_RATES)},
        seeds=tuple(range(n)) if n else STAGE0_SEEDS,
        panel=None,
        description=f"stage 0, GRPO on-policy at lr {STAGE0_RATES}; {description}",
    )
  if stage == "lr":
    return Grid(
        base="configs/default.py",
        fixed={**FIXED, "delay": 0, "total_steps": LEARN_STEPS},
        variants=OBJECTIVES,
        axes={LR: list(LR_RATES)},
        seeds=tuple(range(n)) if n else LR_SEEDS,
        description=f"a learning rate per objective, on-policy at lr {LR_RATES}; {description}",
    )
  if stage == "stage2":
    rates = stage2_rates()
    return Grid(
        base="configs/default.py",
        fixed=FIXED,
        variants={k: {**v, LR: rates[k]} for k, v in OBJECTIVES.items()},
        axes={"delay": list(STAGE2_DELAYS)},
        seeds=tuple(range(n)) if n else SEEDS,
        derived=total_steps,
        comparisons=(("variant", STAGE2_REFERENCE),),
        contrasts=(("variant", STAGE2_REFERENCE, "delay", 0),),  # the primary estimand (issue 55)
        panel="delay",
        description=f"stage 2, each objective at its own rate ({rates}) under staleness; {description}",
    )
  fixed = {**FIXED, LR: chosen_rate()}
  if stage == "stage0b":
    return Grid(
        base="configs/default.py",
        fixed={**fixed, "delay": STAGE0B_DELAY, "total_steps": LEARN_STEPS + STAGE0B_DELAY},
        axes={"loss.method": list(STAGE0B_METHODS)},
        seeds=tuple(range(n)) if n else STAGE0_SEEDS,
        comparisons=(("loss.method", "minpro"),),
        description=f"stage 0b, {'/'.join(STAGE0B_METHODS)} at delay {STAGE0B_DELAY}, lr {fixed[LR]}; {description}",
    )
  if stage == "rate":
    return Grid(
        base="configs/default.py",
        fixed={**fixed, LR: RATE_CHECK_RATE},
        axes={"loss.method": list(ON_POLICY_METHODS), "delay": list(RATE_CHECK_DELAYS)},
        seeds=tuple(range(n)) if n else RATE_CHECK_SEEDS,
        derived=total_steps,
        comparisons=(("loss.method", "minpro"),),
        panel="delay",
        description=f"rate check, MinPRO and GRPO at lr {RATE_CHECK_RATE} (stage 1: {fixed[LR]}); {description}",
    )
  on_policy = [{"loss.method": m, "delay": 0} for m in ON_POLICY_METHODS]
  prefix = [{"loss.method": "minpro", "delay": max(DELAYS), "loss.prefix_statistic": s} for s in PREFIX_ABLATIONS]
  return Grid(
      base="configs/default.py",
      fixed=fixed,
      axes={"loss.method": list(METHODS), "delay": list(DELAYS)},
      cells=on_policy + prefix,
      seeds=tuple(range(n)) if n else SEEDS,
      derived=total_steps,
      comparisons=(("loss.method", "minpro"), ("loss.prefix_statistic", "min")),
      contrasts=(("loss.method", STAGE2_REFERENCE, "delay", 0),),  # (X - GRPO at delay d) - (X - GRPO at delay 0)
      panel="delay",
      description=f"stage 1, MinPRO vs baselines under staleness, lr {fixed[LR]}; {description}",
  )
