"""Learning-rate decay triggered by a surge in response length (the LR-decay baseline of MIPU, arXiv 2606.29526).

Source: Zhang, Li et al., "Beyond Precision: Training-Inference Mismatch is an Optimization Problem and Simple LR
Scheduling Fixes It" (arXiv 2602.01826). Gradient noise and the sampler-learner mismatch grow together; a surge of
the mean response length comes before the collapse, so the learning rate is decayed once the length surges.

The rule, in global steps (one sampled batch each; steps counted from 1 here, as in verl):

  * baseline: the mean of the step-mean response lengths of the first `baseline_steps` steps;
  * trigger: the first later step T whose mean response length exceeds `surge_ratio` x baseline (it fires once);
  * decay: period P = max(1, int(period_factor * T)); the updates of the k-th step after T (k = 1, 2, ...) use
    learning_rate x max(min_ratio, factor ** ((k - 1) // P)): the full rate for P steps, then halved every P steps
    down to min_ratio of it.

Defaults (baseline 50 steps, ratio 3, period 1.8 T, factor 1/2, floor 0.1): a public re-implementation of the
paper in verl (`adaptive_step_decay`: surge_baseline_window=50, surge_threshold_multiplier=3.0,
decay_period = 1.8 * surge_step, halving, min_lr_ratio=0.1). Its notes credit the paper with the rule (threshold on
a baseline, 1.8 T, halving) and the appendix with the 0.1 floor; the window of 50 and the ratio 3 are its own.

Assumptions (the paper body was not readable here):
  * the halvings count from the surge step (that re-implementation's expected schedule: surge at 110, period
    198, first halving at step 309), not from the start of training;
  * the steps of the baseline window are never tested against it;
  * the multiplier scales the configured schedule (`config.optimizer.schedule`, warmup included), and all
    `num_updates_per_step` updates of a step share it; a step's updates use the trigger state before that
    step's length is observed (the trigger reacts from the next step on, as in verl).

The state is a few host-side numbers (`SurgeState`), saved in every run checkpoint (`trainer.RunProgress`), so a
resumed run decays at the same steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class LrDecayConfig:
  """The trigger and the decay (module docstring); units: global steps and tokens.

  Raises:
    ValueError: a field out of its range, naming `LrDecayConfig.<field>`.
  """

  baseline_steps: int = 50
  surge_ratio: float = 3.0
  period_factor: float = 1.8
  factor: float = 0.5
  min_ratio: float = 0.1

  def __post_init__(self):
    for name in ("surge_ratio", "period_factor", "factor", "min_ratio"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"LrDecayConfig.{name} must be a finite number, got {v!r}")
    checks = (
        ("baseline_steps", isinstance(self.baseline_steps, int) and self.baseline_steps >= 1, "must be an int >= 1"),
        ("surge_ratio", self.surge_ratio > 1, "must be > 1 (a surge is a length above the baseline)"),
        ("period_factor", self.period_factor > 0, "must be > 0"),
        ("factor", 0 < self.factor < 1, "must lie in (0, 1) (0.5 halves the learning rate)"),
        ("min_ratio", 0 < self.min_ratio <= 1, "must lie in (0, 1]"),
    )
    for name, ok, msg in checks:
      if not ok:
        raise ValueError(f"LrDecayConfig.{name} {msg}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SurgeState:
  """What the trigger has seen: `seen` steps observed, `length_sum` of the first min(seen, baseline_steps) step
  means, and `surge_step`, the 1-based step T that fired (0 = not yet)."""

  seen: int = 0
  length_sum: float = 0.0
  surge_step: int = 0

  def baseline(self, cfg: LrDecayConfig) -> float | None:
    """The baseline mean length, None while its window fills."""
    return self.length_sum / cfg.baseline_steps if self.seen >= cfg.baseline_steps else None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict[str, Any] | None) -> "SurgeState":
    return cls(**(d or {}))


def update(state: SurgeState, response_length: float, cfg: LrDecayConfig) -> SurgeState:
  """The state after observing the mean response length of the next global step (step `state.seen + 1`).

  Raises:
    ValueError: a non-finite `response_length`.
  """
  if not math.isfinite(response_length):
    raise ValueError(f"response length must be finite, got {response_length!r}")
  step = state.seen + 1
  if state.seen < cfg.baseline_steps:
    return dataclasses.replace(state, seen=step, length_sum=state.length_sum + float(response_length))
  fired = not state.surge_step and response_length > cfg.surge_ratio * state.baseline(cfg)
  return dataclasses.replace(state, seen=step, surge_step=step if fired else state.surge_step)


def decay_period(state: SurgeState, cfg: LrDecayConfig) -> int | None:
  """P = max(1, int(period_factor * T)) in global steps, None before the surge."""
  return max(1, int(cfg.period_factor * state.surge_step)) if state.surge_step else None


def multiplier(state: SurgeState, cfg: LrDecayConfig) -> float:
  """The learning-rate multiplier for the updates of the next global step (step `state.seen + 1`)."""
  if not state.surge_step:
    return 1.0
  k = state.seen + 1 - state.surge_step  # steps after the surge step, 1 for the first
  return max(cfg.min_ratio, cfg.factor ** ((k - 1) // decay_period(state, cfg)))


def observe(
    state: SurgeState, response_length: float, scale: float, cfg: LrDecayConfig
) -> tuple[SurgeState, dict[str, Any]]:
  """`update` with the step's metrics.jsonl entries: the multiplier its updates used (`scale`), whether its length
  fired the trigger, and once known the baseline length, the surge step and the period."""
  after = update(state, response_length, cfg)
  return after, step_metrics(state, after, scale, cfg)


def step_metrics(before: SurgeState, after: SurgeState, scale: float, cfg: LrDecayConfig) -> dict[str, Any]:
  """The metrics of `observe`."""
  out: dict[str, Any] = {"lr_decay/multiplier": scale, "lr_decay/triggered": int(after.surge_step != before.surge_step)}
  if after.baseline(cfg) is not None:
    out["lr_decay/baseline_length"] = after.baseline(cfg)
  if after.surge_step:
    out["lr_decay/surge_step"] = after.surge_step
    out["lr_decay/period"] = decay_period(after, cfg)
  return out
