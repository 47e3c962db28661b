# Issue 40: MIPU on the long-response task (minpro_long.py: eight-term chain_sum, worked-step warm start, 128 new
# tokens), at delay 0 with an fp8 sampler. Two stages, each in its own workdir (docs/study.md):
#
#   G=configs/studies/mipu_long.py
#   .venv/bin/python -m minpro_jax.study --grid=$G:pilot --workdir=results/mipu_long_pilot   # GRPO fp32 vs fp8, 1 seed
#   .venv/bin/python -m minpro_jax.study --grid=$G:main --workdir=results/mipu_long          # 5 variants x 5 seeds
#   .venv/bin/python -m minpro_jax.study --grid=$G:random-dj --workdir=results/mipu_long_random_dj  # issue 55
#   (main:N = N seeds)
#
# The pilot runs GRPO with an fp32 sampler and with the FP8 candidate below (the short study's setting: per-tensor
# e5m2 weights and activations, which hurt GRPO there, docs/mipu.md); when the fp8 run's held-out curve falls
# below the fp32 one at this length, set FP8_CONFIRMED = True (or try another FP8 setting and pilot it again).
# The main grid: GRPO fp32, GRPO fp8, TIS, MIPU as the paper defines it (TIS + the T_post rollback with a fixed
# c = GAP_TOLERANCE) and the random rollback at the rate of the same seed's MIPU run; last, `mipu-dj`: MIPU with
# Step 2 on the statistic the mechanism study (issue 38, docs/mechanism.md) found to have power, delta_j at
# n = DJ_PROMPTS x VAL_GROUP_SIZE = 512 with c = 0 (as configs/studies/mipu_delta_j.py).
#
# The random-dj stage (issue 55) is the arm the main grid lacks: `mipu-dj` rolls back 44 % of its steps and `mipu`
# 83 %, so "delta_j learns faster than T_post" compares two rates. `random-dj` is Step 1 + a rollback at random at
# the rate of results/mipu_long's `mipu-dj` run of the same seed (read from its summary.json, `mipu.match_rate_of`
# = results/mipu_long/variant-mipu-dj_seed-<seed>, from the repository root where the study command runs). A seed's
# runs share the warm start of the main grid's on one CPU type (AMD EPYC there), so mipu-dj - random-dj pairs by
# seed across the two summaries. 5 runs, about 15-25 min each as the main grid's `random` runs.
#
# Both stages run at minpro_long.LEARNING_RATE, a PLACEHOLDER until minpro_long's stage 0 chooses it: they refuse
# to run until then, and the main grid also until FP8_CONFIRMED. Cost: like a minpro_long run at delay 0 plus
# MIPU's validation (16 x 8 samples) per step for mipu and random, 2 x 512 for mipu-dj: about 30 runs x 15-30 min,
# 9-11 h.
"""The long-response MIPU grid of issue 40 (numbers to tune are the constants below)."""

import os

from minpro_jax.config_lib.files import load_module
from minpro_jax.config_lib.mipu_variants import variant_overrides
from minpro_jax.study import results
from minpro_jax.study.grid import Grid

long = load_module("minpro_long.py", relative_to=__file__)  # the long staleness study's setting

STAGES = ("pilot", "main", "random-dj")
VARIANTS = ("grpo", "tis", "mipu", "random", "mipu-dj")  # "fp32" (GRPO, fp32 sampler) comes first
PILOT_SEEDS = (0,)
SEEDS = (0, 1, 2, 3, 4)  # as minpro_long's stage 1: a seed's runs share their warm start

# ------------------------------------------------------------------ the mismatch at this length: TUNE THESE
FP8 = {"sampling.fp8_weight_scale": "tensor", "sampling.fp8_format": "e5m2", "sampling.fp8_activations": "tensor"}
FP8_CONFIRMED = True  # the pilot (results/mipu_long_pilot): fp8 GRPO fell to 3.0 % from 9.2 %, fp32 rose to 19.2 %
VAL_PROMPTS, VAL_GROUP_SIZE = 16, 8  # 128 validation samples per check, as the short MIPU study
GAP_TOLERANCE = 1e-4  # c: keep the update iff T_post >= -c (the paper's setting)
DJ_PROMPTS = 64  # mipu-dj: 64 x 8 = 512 validation samples per policy and check, keep iff delta_j >= 0
# ------------------------------------------------------------------


def variants(names=VARIANTS) -> dict[str, dict]:
  """name -> overrides: `fp32` (GRPO, fp32 sampler), then each of `names` sampling at `FP8`."""
  step2 = {"mipu.val_prompts": VAL_PROMPTS, "mipu.val_group_size": VAL_GROUP_SIZE, "mipu.gap_tolerance": GAP_TOLERANCE}
  out = {"fp32": {}}
  for v in names:
    ov = {**variant_overrides("mipu" if v == "mipu-dj" else v), **FP8}  # config_lib/mipu_variants.py
    ov.pop("loss.method")  # grpo: in the fixed fields
    if v in ("mipu", "random"):
      ov.update(step2)
    if v == "mipu-dj":
      ov.update({**step2, "mipu.val_prompts": DJ_PROMPTS, "mipu.statistic": "delta_j", "mipu.gap_tolerance": 0.0})
    out[v] = ov
  return out


def sibling_rate(cell) -> dict:
  """The random-rollback run rolls back at the measured rate of its seed's `mipu` run (a sibling workdir)."""
  if cell["variant"] != "random":
    return {}
  return {"mipu.match_rate_of": f"variant-mipu_seed-{cell['seed']}"}


def dj_rate(cell) -> dict:
  """The random-dj run rolls back at the measured rate of its seed's `mipu-dj` run in results/mipu_long (a path
  from the repository root, where the study command runs)."""
  return {"mipu.match_rate_of": os.path.join(results.committed("mipu_long"), f"variant-mipu-dj_seed-{cell['seed']}")}


def parse_arg(arg: str | None) -> tuple[str, int | None]:
  """ "main:3" -> ("main", 3); "pilot" -> ("pilot", None). Raises ValueError naming the choices."""
  stage, _, n = (arg or "").partition(":")
  if stage not in STAGES or (n and not n.isdigit()) or (n and int(n) < 1):
    raise ValueError(f"pass a stage: --grid=<file>:STAGE[:SEEDS] with STAGE one of {STAGES}, got {arg!r}")
  return stage, int(n) if n else None


def get_grid(arg=None) -> Grid:
  """arg: "pilot", "main" or "random-dj", optionally ":N" for seeds 0..N-1 (default PILOT_SEEDS / SEEDS)."""
  stage, n = parse_arg(arg)
  fixed = {
      **long.FIXED,
      "optimizer.learning_rate": long.chosen_rate(),
      "loss.method": "grpo",
      "delay": 0,
      "total_steps": long.LEARN_STEPS,
  }
  what = f"long responses (minpro_long's setting at delay 0, lr {long.LEARNING_RATE})"
  if stage == "pilot":
    return Grid(
        base="configs/default.py",
        fixed=fixed,
        variants=variants(("grpo",)),
        seeds=tuple(range(n)) if n else PILOT_SEEDS,
        comparisons=(("variant", "fp32"),),
        description=f"pilot: GRPO with an fp32 and an fp8 sampler ({FP8}); {what}",
    )
  if stage == "random-dj":
    random = variants(("random",))["random"]
    return Grid(
        base="configs/default.py",
        fixed=fixed,
        variants={
            "random-dj": {**random, "mipu.val_prompts": DJ_PROMPTS}
        },  # val_*: unused, as mipu-dj's for the record
        seeds=tuple(range(n)) if n else SEEDS,
        derived=dj_rate,
        description=(
            f"random rollback at the rate of results/mipu_long's mipu-dj run of the same seed (fp8 sampler {FP8}); {what}"
        ),
    )
  if not FP8_CONFIRMED:
    raise ValueError("mipu_long.FP8_CONFIRMED is still the placeholder False; run the pilot (--grid=...:pilot) first")
  return Grid(
      base="configs/default.py",
      fixed=fixed,
      variants=variants(),
      seeds=tuple(range(n)) if n else SEEDS,
      derived=sibling_rate,
      # against GRPO fp8 and fp32; Step 2 on top of Step 1 (tis), the test against a rollback at random at its rate,
      # and delta_j against T_post
      comparisons=(
          ("variant", "grpo"),
          ("variant", "fp32"),
          ("variant", "mipu", ("tis", "random")),
          ("variant", "mipu-dj", ("tis", "mipu")),
      ),
      description=f"MIPU's variants with an fp8 sampler ({FP8}) and GRPO with an fp32 sampler; {what}",
  )
