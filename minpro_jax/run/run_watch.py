"""What must not pass silently in a run's per-step metrics: all updates skipped, a collapsed policy."""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

MAX_ALL_SKIPPED_STEPS = 3  # global steps in a row whose every update was skipped before the run stops
COLLAPSE_ZERO_REWARD_STEPS = 10  # global steps in a row with zero reward before a warning
COLLAPSE_ENTROPY_FRACTION = 0.95  # response entropy above this share of log(vocab) is a warning


class RunWatch:
  """Watches the per-step metrics for what must not pass silently: a run whose updates are all skipped (returns
  True to stop it) and a collapsed policy (logged as a warning: entropy at its maximum, or rewards at zero)."""

  def __init__(self, vocab_size: int):
    self.max_entropy = math.log(vocab_size)
    self.all_skipped = 0
    self.zero_reward = 0
    self.warned_entropy = False

  def observe(self, step: int, m: dict[str, Any]) -> bool:
    updates = m.get("learn/skipped_updates")
    if updates is not None:
      self.all_skipped = self.all_skipped + 1 if updates >= m.get("learn/updates", 1) else 0
    if "reward/mean" not in m:  # the in-flight mode's first `delay` steps learn no batch and report none
      return self.all_skipped >= MAX_ALL_SKIPPED_STEPS
    self.zero_reward = self.zero_reward + 1 if m["reward/mean"] == 0 else 0
    if self.zero_reward == COLLAPSE_ZERO_REWARD_STEPS:
      logger.warning(
          "reward 0 for %d global steps in a row (step %d): the policy may have collapsed", self.zero_reward, step
      )
    if not self.warned_entropy and m["response/entropy"] >= COLLAPSE_ENTROPY_FRACTION * self.max_entropy:
      self.warned_entropy = True  # once per run: a model trained from scratch without SFT starts there
      logger.warning(
          "response entropy %.2f nats at step %d is at its maximum (log V = %.2f): the policy is close to "
          "uniform; lower optimizer.learning_rate",
          m["response/entropy"],
          step,
          self.max_entropy,
      )
    return self.all_skipped >= MAX_ALL_SKIPPED_STEPS
