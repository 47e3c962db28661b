"""Rollout batches and the delay buffer that emulates stale sampling exactly.

A `RolloutBatch` is everything the learner needs about one global step's samples, as host numpy arrays
in the learner's layout (one sample per row: left-padded prompt then response). It carries the
behavior log-probs recorded by the sampler at generation time together with the `policy_version` of
the parameters that produced them; nothing here ever recomputes them (case B15).

`RolloutBuffer` is a FIFO of depth `delay`: the batch pushed at global step s is released at step
s + delay. With `num_updates_per_step = n` and the sampler always using the newest parameters, a sample
consumed by update j (0-based) of step s + delay was produced by version (s - delay) * n, i.e. its
staleness is exactly delay * n + j once s >= delay (the paper's d = 2, n = 16 gives 32..47). During the
first `delay` steps the buffer fills and no update happens; the first `delay` released batches were
sampled by the initial parameters and so have the smaller staleness s * n + j (see `Trainer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

_FIELDS = (
    "tokens",
    "segment_ids",
    "positions",
    "response_mask",
    "behavior_logp",
    "learner_logp",
    "advantages",
    "rewards",
    "group_ids",
    "policy_version",
    "response_lengths",
    "truncated",
)


@dataclasses.dataclass
class RolloutBatch:
  """Samples of one global step in learner layout (N rows, L = prompt bucket + max new tokens).

  Attributes:
    tokens: [N, L] int32 prompt and response tokens (padding anywhere is segment 0).
    segment_ids: [N, L] int32, 1 on real tokens, 0 on padding.
    positions: [N, L] int32 RoPE positions (count real tokens only).
    response_mask: [N, L] bool, True on response tokens (up to and including the stop token).
    behavior_logp: [N, L] float32 sampler log-prob of each response token (0 elsewhere), under the
      temperature-scaled full-vocabulary distribution it was sampled from.
    learner_logp: [N, L] float32 learner (training-precision) log-prob of the same tokens under the same
      parameter version, computed at sampling time; equals behavior_logp up to the sampler's precision
      (MIPU's pi_k; TIS/MIS rollout correction uses it).
    advantages: [N] float32 group-normalised advantages.
    rewards: [N] float32 rewards.
    group_ids: [N] int64 prompt/group id of each sample (unique across the run).
    policy_version: [N] int64 number of optimizer updates of the parameters that sampled each row.
    response_lengths: [N] int32 response tokens including the stop token.
    truncated: [N] bool, True if generation hit max_new_tokens without a stop token.
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  response_mask: np.ndarray
  behavior_logp: np.ndarray
  learner_logp: np.ndarray
  advantages: np.ndarray
  rewards: np.ndarray
  group_ids: np.ndarray
  policy_version: np.ndarray
  response_lengths: np.ndarray
  truncated: np.ndarray

  def __post_init__(self):
    n, length = self.tokens.shape
    for name in ("segment_ids", "positions", "response_mask", "behavior_logp", "learner_logp"):
      if getattr(self, name).shape != (n, length):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, expected {(n, length)}")
    for name in ("advantages", "rewards", "group_ids", "policy_version", "response_lengths", "truncated"):
      if getattr(self, name).shape != (n,):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, expected {(n,)}")

  @property
  def size(self) -> int:
    return int(self.tokens.shape[0])

  def select(self, rows: np.ndarray | slice) -> "RolloutBatch":
    """The rows `rows` of every field, as a new batch."""
    return RolloutBatch(**{f: getattr(self, f)[rows] for f in _FIELDS})

  def split(self, num: int) -> list["RolloutBatch"]:
    """`num` equal consecutive mini-batches.

    Raises:
      ValueError: the batch size is not divisible by `num`.
    """
    if num <= 0 or self.size % num:
      raise ValueError(f"cannot split a batch of {self.size} samples into {num} equal mini-batches")
    m = self.size // num
    return [self.select(slice(i * m, (i + 1) * m)) for i in range(num)]

  def learner_arrays(self) -> dict[str, np.ndarray]:
    """The [N, L] / [N] arrays the jitted learner step consumes."""
    return {
        "tokens": self.tokens,
        "segment_ids": self.segment_ids,
        "positions": self.positions,
        "response_mask": self.response_mask,
        "behavior_logp": self.behavior_logp,
        "learner_logp": self.learner_logp,
        "advantages": self.advantages,
    }

  def to_dict(self) -> dict[str, np.ndarray]:
    return {f: getattr(self, f) for f in _FIELDS}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "RolloutBatch":
    return cls(**{f: np.asarray(d[f]) for f in _FIELDS})


class RolloutBuffer:
  """FIFO that releases each pushed batch exactly `delay` global steps later.

  `push(step, batch)` then `pop(step)` in every global step: `pop` returns the batch pushed at
  `step - delay` (with delay 0, the batch just pushed: on-policy), or None while the buffer is filling.

  Raises:
    ValueError: negative delay; steps pushed out of order.
  """

  def __init__(self, delay: int):
    if delay < 0:
      raise ValueError(f"delay must be >= 0 (0 = on-policy), got {delay}")
    self.delay = int(delay)
    self._items: list[tuple[int, RolloutBatch]] = []

  def __len__(self) -> int:
    return len(self._items)

  def push(self, step: int, batch: RolloutBatch) -> None:
    if self._items and step <= self._items[-1][0]:
      raise ValueError(f"RolloutBuffer.push: step {step} is not after the last pushed step {self._items[-1][0]}")
    self._items.append((int(step), batch))

  def pop(self, step: int) -> RolloutBatch | None:
    """The batch pushed at `step - delay`, removed from the buffer, or None if there is none yet."""
    if self._items and self._items[0][0] <= step - self.delay:
      return self._items.pop(0)[1]
    return None

  def state_dict(self) -> dict[str, Any]:
    """Checkpointable contents: the waiting batches and their steps (needed so a resumed run keeps its staleness)."""
    return {
        "steps": np.asarray([s for s, _ in self._items], np.int64),
        "batches": {str(i): b.to_dict() for i, (_, b) in enumerate(self._items)},
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    steps = [int(s) for s in np.asarray(state["steps"]).reshape(-1)]
    self._items = [(s, RolloutBatch.from_dict(state["batches"][str(i)])) for i, s in enumerate(steps)]
