# Issue 38, part 2's rerun: the MIPU grid again (5 seeds) with the Step-2 statistic the power study found to have
# power, `mipu.statistic=delta_j`, against random rollback at the same rate (docs/mechanism.md).
#
#   G=configs/studies/mipu_delta_j.py
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/mipu_delta_j --dry-run   # the 15 commands
#   .venv/bin/python -m minpro_jax.study --grid=$G --workdir=results/mipu_delta_j             # run / resume
#
# The setting is the MIPU study's (configs/studies/mipu.py: the staleness setting at delay 0, GRPO, 32 global steps
# of 8 updates on 32 prompts x 8, the fp8 e5m2 sampler with per-tensor weight and activation scales). Variants:
#   grpo      GRPO at fp8, no rollback (the baseline)
#   mipu-dj   MIPU (Step 1 = token TIS, cap 2) with Step 2's test on delta_j = J(mu') - J(mu_k): the mean reward of
#             VAL_PROMPTS x VAL_GROUP_SIZE validation samples at the updated weights minus at the snapshot, on the
#             same prompts and sampler keys; keep the step's updates iff delta_j >= -GAP_TOLERANCE
#   random    Step 1 + rollback at random, at the rollback rate the same seed's mipu-dj run measured
# so mipu-dj against random asks whether the test picks *which* steps to undo better than chance at the same rate.
#
# Why n = 512 (64 prompts x 8): in the offline power study (results/mipu_power, T ~ 6) delta_j's AUC for "the update
# lowered J(mu)" is 0.62 [0.58, 0.66] at 128 samples, 0.72 [0.64, 0.79] at 512 and 0.82 [0.74, 0.91] at 2,048;
# t_post and delta_t stay at 0.5 at every n. 512 is the smallest n well above 0.5 (the rule) and costs two
# draws of 512 per step (4x a step's 256 training samples); 2,048 would cost 16x. c = 0: the rule whose rollback
# rate and precision the power study reports (44 % rollbacks at n = 128, of which 44 % lowered J against a 35 %
# base rate); delta_j is a paired difference with no standing gap, so c = 0 is "keep unless the reward fell".
#
# Cost (docs/mechanism.md, "The MIPU grid with delta_j"; a smoke run on 2026-12-05, AMD EPYC, 2 shared cores): a
# mipu-dj step costs about twice a GRPO step (its two 512-sample draws ~ one step's sampling and learning), so a
# mipu-dj run is ~6-8 min and the 15 runs about 1.3 h at load 4-6, plus ~5 min of SFT for each of seeds 4 and 5
# (seeds 1-3's warm starts are cached in cache/ by the MIPU study).
"""The MIPU rerun grid of issue 38 with the delta_j statistic (numbers to tune are the constants below)."""

from minpro_jax.config_lib.files import load_module
from minpro_jax.config_lib.mipu_variants import variant_overrides
from minpro_jax.study.grid import Grid

mipu_study = load_module("mipu.py", relative_to=__file__)  # the MIPU study's setting (FIXED fields, FP8 sampler)

SEEDS = (1, 2, 3, 4, 5)  # 1-3 share their warm starts (and grpo runs) with results/mipu

# ------------------------------------------------------------------ Step 2 with delta_j: TUNE THESE
STATISTIC = "delta_j"  # the power study's only statistic with an AUC well above 0.5 (docs/mechanism.md)
VAL_PROMPTS, VAL_GROUP_SIZE = 64, 8  # n = 512 validation samples per policy and check
GAP_TOLERANCE = 0.0  # c: keep the updates iff delta_j >= -c
# ------------------------------------------------------------------


def variants() -> dict[str, dict]:
  """name -> overrides: grpo, mipu-dj and random, all sampling at the MIPU study's `FP8`."""
  step2 = {"mipu.val_prompts": VAL_PROMPTS, "mipu.val_group_size": VAL_GROUP_SIZE}
  out = {}
  for name, v in (("grpo", "grpo"), ("mipu-dj", "mipu"), ("random", "random")):
    ov = {**variant_overrides(v), **mipu_study.FP8}
    ov.pop("loss.method")  # grpo: in the fixed fields
    if v == "mipu":
      ov.update({**step2, "mipu.statistic": STATISTIC, "mipu.gap_tolerance": GAP_TOLERANCE})
    if v == "random":
      ov.update(step2)  # unused by mode=random (it samples nothing), kept equal to mipu-dj's for the record
    out[name] = ov
  return out


def sibling_rate(cell) -> dict:
  """The random-rollback run rolls back at the measured rate of its seed's `mipu-dj` run (a sibling workdir)."""
  if cell["variant"] != "random":
    return {}
  return {"mipu.match_rate_of": f"variant-mipu-dj_seed-{cell['seed']}"}


def get_grid(arg=None) -> Grid:
  """arg: the number of seeds, 1..arg (default SEEDS)."""
  base = mipu_study.get_grid()
  return Grid(
      base=base.base,
      fixed=dict(base.fixed),
      variants=variants(),
      seeds=tuple(range(1, int(arg) + 1)) if arg else SEEDS,
      derived=sibling_rate,
      comparisons=(("variant", "random"), ("variant", "grpo")),
      description=(
          f"MIPU with Step 2 on {STATISTIC} at n = {VAL_PROMPTS * VAL_GROUP_SIZE} (c = {GAP_TOLERANCE}) against "
          "rate-matched random rollback and GRPO, fp8 sampler (per-tensor e5m2); the MIPU study's setting"
      ),
  )
