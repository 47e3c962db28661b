"""The variants MIPU (arXiv 2606.29526) compares, as edits of a config: its baselines, its ablations and the method.

  grpo       the baseline: GRPO, no mismatch correction
  tis        Step 1 only: token TIS against the sampler, w = min(pi_k / mu_k, 2)
  mis        MIS (token level, ratios kept in [0.5, 2]); mis_sequence / mis_geometric: sequence / geometric mean
  lr_decay   the LR-decay baseline (arXiv 2602.01826): the learning rate decays when the response length surges
  step2      Step 2 only: the post-update T_post test with rollback, no TIS
  mipu       Step 1 + Step 2 (the method)
  random     the random-rollback ablation: Step 1 + rollback with probability mipu.random_rate, or the rate of the
             finished run mipu.match_rate_of (one of the two must be given on the command line)

Every variant samples at `sampling.precision = "fp8"` (MIPU's setting); the caller's config sets the rest.
"""

from __future__ import annotations

from typing import Any

from minpro_jax.config_lib import set_fields

VARIANTS = ("grpo", "tis", "mis", "mis_sequence", "mis_geometric", "lr_decay", "step2", "mipu", "random")
MIS_BOUNDS = (0.5, 2.0)  # the usual mask (verl / slime); MIPU does not state its MIS threshold


def variant_overrides(variant: str) -> dict[str, Any]:
  """The dotted config fields `variant` (one of `VARIANTS`) sets -> their values (a study grid's variant).

  Raises:
    ValueError: an unknown variant, naming the choices.
  """
  if variant not in VARIANTS:
    raise ValueError(f"MIPU variant {variant!r}; choose one of {VARIANTS}")
  out: dict[str, Any] = {"sampling.precision": "fp8", "loss.method": "grpo"}
  if variant in ("tis", "mipu", "random"):
    out.update({"loss.rollout_is": "token", "loss.tis_cap": 2.0})
  if variant.startswith("mis"):
    level = {"mis": "token", "mis_sequence": "sequence", "mis_geometric": "geometric"}[variant]
    out.update({"loss.rollout_mis": level, "loss.rollout_mis_bounds": MIS_BOUNDS})
  if variant in ("step2", "mipu", "random"):
    out["mipu.rollback"] = True
  if variant == "random":
    out["mipu.mode"] = "random"
  if variant == "lr_decay":
    out["optimizer.lr_decay_on_length_surge"] = True
  return out


def apply_variant(c, variant: str):
  """Sets `c`'s fields for `variant` (one of `VARIANTS`) and returns `c`. Raises ValueError naming the choices."""
  return set_fields(c, variant_overrides(variant))
