"""`RunProgress`: what a run has done besides its arrays (best evaluation, MIPU counters, the LR-decay trigger), saved
as JSON in every run checkpoint (`minpro_jax.run.trainer`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RunProgress:
  """What a run has done besides its arrays; saved whole (JSON) in every run checkpoint.

  Attributes:
    best_score: the highest held-out pass@1 so far (macro average), None before the first evaluation.
    best_step: the policy step (global steps done) of `best_score`; 0 is the evaluation after the warm start.
    sft_eval: the macro scores of the evaluation after the warm start, None until it ran.
    sft_info: what the warm start did (`run_setup.warm_start`).
    mipu_checks / mipu_rollbacks: MIPU Step-2 tests run / updates rolled back.
    mipu_ground_truth: [T_post, J(mu') - J(pi')] of each check with `mipu.ground_truth` (`minpro_jax.run.mipu_step`).
    mipu_tolerance: the c of `mipu.tolerance=calibrated`, once measured at the first check (None before).
    lr_decay: the length-surge trigger's `lr_decay.SurgeState` (as JSON).
  """

  best_score: float | None = None
  best_step: int | None = None
  sft_eval: dict[str, float] | None = None
  sft_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  mipu_checks: int = 0
  mipu_rollbacks: int = 0
  mipu_ground_truth: list[list[float]] = dataclasses.field(default_factory=list)
  mipu_tolerance: float | None = None
  lr_decay: dict[str, Any] = dataclasses.field(default_factory=dict)

  def improves(self, score: float | None) -> bool:
    """Whether `score` beats the best so far (the first evaluation always does; ties keep the earlier one)."""
    return self.best_score is None or (score is not None and score > self.best_score)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "RunProgress":
    return cls(**d)
