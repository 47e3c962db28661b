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

VARIANTS = ("grpo", "tis", "mis", "mis_sequence", "mis_geometric", "lr_decay", "step2", "mipu", "random")
MIS_BOUNDS = (0.5, 2.0)  # the usual mask (verl / slime); MIPU does not state its MIS threshold


def apply_variant(c, variant: str):
  """Sets `c`'s fields for `variant` (one of `VARIANTS`) and returns `c`. Raises ValueError naming the choices."""
  if variant not in VARIANTS:
    raise ValueError(f"MIPU variant {variant!r}; choose one of {VARIANTS}")
  c.sampling.precision = "fp8"
  c.loss.method = "grpo"
  if variant in ("tis", "mipu", "random"):
    c.loss.rollout_is, c.loss.tis_cap = "token", 2.0
  if variant.startswith("mis"):
    c.loss.rollout_mis = {"mis": "token", "mis_sequence": "sequence", "mis_geometric": "geometric"}[variant]
    c.loss.rollout_mis_bounds = MIS_BOUNDS
  if variant in ("step2", "mipu", "random"):
    c.mipu.rollback = True
  if variant == "random":
    c.mipu.mode = "random"
  if variant == "lr_decay":
    c.optimizer.lr_decay_on_length_surge = True
  return c
