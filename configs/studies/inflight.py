# Issue 59: the objectives under in-flight weight updates (staleness.mode=inflight, docs/inflight.md) on the worked
# task of the long study (eight-term chain_sum, worked-step warm start, ~60-token responses), beside delay mode:
#
#   .venv/bin/python -m minpro_jax.study --grid=configs/studies/inflight.py --workdir=results/inflight
#   (inflight.py:N = N seeds, default 3; add --dry-run to see the commands)
#
# Cells: MinPRO, GRPO, CISPO and M2PO (token-level objectives: GSPO's sequence ratio is not defined on a response drawn
# by several versions, and the config check refuses it) under four staleness regimes (the grid's variants):
#   inflight-k8, inflight-k32  in-flight updates, the sampler one batch ahead of the learner (delay 1), its pool
#                              checked every 8 or 32 decode steps: a response started under version v continues under
#                              v + 8 once the learner has taken its 8 updates, keeping its KV (PipelineRL's choice);
#   delay-0, delay-1           delay mode at delays 0 and 1: per-token staleness 0 and 8 updates at a step's first
#                              update, which bracket the in-flight regimes' mean token staleness (each token is 0 or 8
#                              updates stale there: drawn before or after the swap). The dynamics table reports every
#                              cell's measured mean token staleness and version spread, so the reading can say where
#                              each in-flight cell sits between the two delay cells.
# The contrast (X - GRPO in regime r) - (X - GRPO at delay 0) is what each regime's staleness adds to an objective's
# gap to GRPO. Its reading says only what its intervals say (3 seeds).
#
# Learning rates: each objective's rate from issue 55's lr stage (minpro_long.CHOSEN_RATES); M2PO, a masked GRPO with
# no lr stage of its own, takes GRPO's (as the toolbox's clipped arms do). The grid refuses to run before that stage.
#
# Cost (measured 2026-12-07, AMD EPYC, 2 cores, at nice 19 beside another study): 4-6.5 min a run; alone about
# 2-4 min (the same task's delay-mode runs): 16 cells x 3 seeds = 48 runs, about 2-3 h.
"""The in-flight updates grid of issue 59 (the constants below are the design; the long study's setting is reused)."""

from minpro_jax.config_lib.files import load_module
from minpro_jax.study.grid import Grid

long = load_module("minpro_long.py", relative_to=__file__)  # the worked task, its rates and lengths

METHODS = ("minpro", "grpo", "cispo", "m2po")  # token-level objectives (GSPO refuses in-flight mode)
CADENCES = (8, 32)  # staleness.inflight_every: decode steps per segment
INFLIGHT_AHEAD = 1  # delay in in-flight mode: batches the sampler runs ahead of the learner
BRACKET_DELAYS = (0, 1)  # delay mode at per-token staleness 0 and UPDATES_PER_STEP updates
SEEDS = (0, 1, 2)
REFERENCE = "grpo"
INFLIGHT_KV = "keep"  # the stale-KV effect the asynchronous systems live with (docs/inflight.md measures it)

REGIMES = {
    **{
        f"inflight-k{k}": {
            "staleness.mode": "inflight",
            "staleness.inflight_every": k,
            "staleness.inflight_kv": INFLIGHT_KV,
            "delay": INFLIGHT_AHEAD,
        }
        for k in CADENCES
    },
    **{f"delay-{d}": {"staleness.mode": "delay", "delay": d} for d in BRACKET_DELAYS},
}

FIXED = {
    **long.FIXED,
    "sampling.kv_cache": "dense",  # the streaming pool's cache, for every regime: one sampler program throughout
}
RATE_OF = {"minpro": "minpro", "grpo": "grpo", "cispo": "cispo", "m2po": "grpo"}  # objective -> whose rate it takes


def derived(cell) -> dict:
  """Per cell: `long.LEARN_STEPS` global steps with updates in every regime (the first `delay` steps learn nothing)
  and the objective's learning rate from the lr stage (`minpro_long.stage2_rates`, which raises ValueError while it
  is the placeholder)."""
  rate = long.stage2_rates()[RATE_OF[cell["loss.method"]]]
  return {"total_steps": long.LEARN_STEPS + int(REGIMES[cell["variant"]]["delay"]), "optimizer.learning_rate": rate}


def get_grid(arg=None) -> Grid:
  """arg: optional seed count N (seeds 0..N-1; default SEEDS).

  Raises:
    ValueError: an arg that is not a positive integer.
  """
  if arg is not None and (not str(arg).isdigit() or int(arg) < 1):
    raise ValueError(f"pass a seed count: --grid=<file>:N with N >= 1, got {arg!r}")
  if set(RATE_OF) != set(METHODS):
    raise ValueError(f"inflight.RATE_OF must name whose rate each of {list(METHODS)} takes")
  return Grid(
      base="configs/default.py",
      fixed=FIXED,
      variants=REGIMES,
      axes={"loss.method": list(METHODS)},
      seeds=tuple(range(int(arg))) if arg else SEEDS,
      derived=derived,
      comparisons=(("loss.method", REFERENCE),),
      contrasts=(("loss.method", REFERENCE, "variant", f"delay-{BRACKET_DELAYS[0]}"),),
      panel="variant",
      description=(
          f"in-flight updates (cadences {CADENCES} decode steps, sampler {INFLIGHT_AHEAD} batch ahead, KV "
          f"{INFLIGHT_KV}) vs delay mode at delays {BRACKET_DELAYS}, {'/'.join(METHODS)}; long responses: eight-term "
          f"chain_sum, worked-step warm start, {long.MAX_NEW_TOKENS} new tokens"
      ),
  )
