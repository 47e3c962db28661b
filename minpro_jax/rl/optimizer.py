"""The learner's optimizer: AdamW with warmup, a decay schedule and global-norm clipping (optax), from one
frozen config record."""

import dataclasses
import math

import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup, then constant / cosine / linear decay, and global-norm clipping.

  Units: learning rates per update; `warmup_steps` and `decay_steps` in optimizer updates.

  Raises:
    ValueError: a field that is not finite or out of its range, naming `OptimizerConfig.<field>`.
  """

  learning_rate: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"  # constant | cosine | linear
  decay_steps: int = 0
  final_lr_ratio: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0

  def __post_init__(self):
    for name in ("learning_rate", "final_lr_ratio", "b1", "b2", "eps", "weight_decay", "max_grad_norm"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"OptimizerConfig.{name} must be a finite number, got {v!r}")
    checks = (
        ("learning_rate", self.learning_rate > 0, "must be > 0"),
        ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
        ("decay_steps", self.decay_steps >= 0, "must be >= 0"),
        ("final_lr_ratio", 0 <= self.final_lr_ratio <= 1, "must lie in [0, 1]"),
        ("b1", 0 <= self.b1 < 1, "must lie in [0, 1)"),
        ("b2", 0 <= self.b2 < 1, "must lie in [0, 1)"),
        ("eps", self.eps > 0, "must be > 0"),
        ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
        ("max_grad_norm", self.max_grad_norm >= 0, "must be >= 0 (0 = no clipping)"),
    )
    for name, ok, msg in checks:
      if not ok:
        raise ValueError(f"OptimizerConfig.{name} {msg}, got {getattr(self, name)!r}")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Learning-rate schedule of `cfg`. Raises ValueError for an unknown schedule name."""
  lr = cfg.learning_rate
  warm = (
      optax.linear_schedule(0.0, lr, max(cfg.warmup_steps, 1)) if cfg.warmup_steps > 0 else optax.constant_schedule(lr)
  )
  if cfg.schedule == "constant":
    after = optax.constant_schedule(lr)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(lr, max(cfg.decay_steps, 1), alpha=cfg.final_lr_ratio)
  elif cfg.schedule == "linear":
    after = optax.linear_schedule(lr, lr * cfg.final_lr_ratio, max(cfg.decay_steps, 1))
  else:
    raise ValueError(f"optimizer schedule {cfg.schedule!r} unknown; choose constant, cosine or linear")
  if cfg.warmup_steps <= 0:
    return after
  return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """optax chain: clip_by_global_norm(max_grad_norm) then AdamW(schedule)."""
  parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm and cfg.max_grad_norm > 0 else []
  parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
  return optax.chain(*parts)
