"""Deterministic, shardable, resumable prompt-batch iterator over an in-memory list of problems (grain).

Order: the problems of this JAX process's shard are shuffled with ``seed`` and reshuffled every epoch
(``grain.MapDataset.shuffle(seed).repeat(num_epochs)``, which reseeds per epoch). Each epoch is cut into
``len(shard) // batch_size`` batches (the epoch's remainder is dropped, so a batch never mixes two epochs and no
example appears twice within an epoch). The iterator's whole state is the next step number, so
``get_state()`` is a small JSON-serialisable dict and ``set_state`` resumes with exactly the remaining batches
(case B23 of tests/CASES.md: resuming at an epoch boundary still runs the remaining epochs).

Sharding: ``shard_index/shard_count`` default to ``jax.process_index()/process_count()`` (grain's
``ShardByJaxProcess``). Each process takes a strided, equal-size slice (``len // count`` problems; the remainder is
dropped) so every process runs the same number of steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import grain

from minpro_jax.data.records import MathProblem

_STATE_VERSION = 1


class ProblemLoader(Iterator[list[MathProblem]]):
  """Iterator of prompt batches (``list[MathProblem]`` of length ``batch_size``).

  Args:
    problems: all problems (every process passes the same list in the same order).
    batch_size: problems per batch on this process (the per-process prompt batch).
    seed: shuffle seed; ``None`` keeps file order (still repeated).
    num_epochs: passes over the data; ``None`` repeats forever.
    shard_index, shard_count: this process's shard; default from ``grain.sharding.ShardByJaxProcess``.

  Raises:
    ValueError: bad sizes, or a shard too small for one batch.
  """

  def __init__(
      self,
      problems: Sequence[MathProblem],
      batch_size: int,
      *,
      seed: int | None = 0,
      num_epochs: int | None = 1,
      shard_index: int | None = None,
      shard_count: int | None = None,
  ):
    if batch_size <= 0:
      raise ValueError(f"batch_size={batch_size} must be positive")
    if num_epochs is not None and num_epochs <= 0:
      raise ValueError(f"num_epochs={num_epochs} must be positive or None")
    if shard_index is None or shard_count is None:
      sh = grain.sharding.ShardByJaxProcess(drop_remainder=True)
      shard_index, shard_count = sh.shard_index, sh.shard_count
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index={shard_index} not in [0, shard_count={shard_count})")
    per_shard = len(problems) // shard_count
    ds = grain.MapDataset.source(list(problems))[shard_index : per_shard * shard_count : shard_count]
    if per_shard < batch_size:
      raise ValueError(
          f"{len(problems)} problems over {shard_count} shard(s) give {per_shard} per shard, fewer than "
          f"batch_size={batch_size}"
      )
    if seed is not None:
      ds = ds.shuffle(seed=seed)
    self._epoch_len = per_shard
    self._ds = ds.repeat(num_epochs)  # reseeds the shuffle every epoch
    self.batch_size = batch_size
    self.seed, self.num_epochs = seed, num_epochs
    self.shard_index, self.shard_count = shard_index, shard_count
    self.steps_per_epoch = per_shard // batch_size
    self._step = 0

  @property
  def total_steps(self) -> float:
    """Number of batches in the whole run (``math.inf`` if ``num_epochs`` is None)."""
    return math.inf if self.num_epochs is None else self.steps_per_epoch * self.num_epochs

  @property
  def step(self) -> int:
    """Batches already returned."""
    return self._step

  @property
  def epoch(self) -> int:
    return self._step // self.steps_per_epoch

  def __iter__(self) -> "ProblemLoader":
    return self

  def __next__(self) -> list[MathProblem]:
    if self._step >= self.total_steps:
      raise StopIteration
    epoch, b = divmod(self._step, self.steps_per_epoch)
    start = epoch * self._epoch_len + b * self.batch_size
    batch = [self._ds[i] for i in range(start, start + self.batch_size)]
    self._step += 1
    return batch

  @property
  def remaining(self) -> int:
    """Batches left before the loader stops."""
    return self.total_steps - self._step

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable state: the step plus the settings it is only valid for."""
    return {
        "version": _STATE_VERSION,
        "step": self._step,
        "seed": self.seed,
        "batch_size": self.batch_size,
        "epoch_len": self._epoch_len,
        "shard_index": self.shard_index,
        "shard_count": self.shard_count,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Resume from ``get_state()``.

    Raises:
      ValueError: the state was written by a loader with a different seed/batch size/data size/sharding (resuming
        would silently change the order), or has a negative step.
    """
    for k, mine in (
        ("seed", self.seed),
        ("batch_size", self.batch_size),
        ("epoch_len", self._epoch_len),
        ("shard_index", self.shard_index),
        ("shard_count", self.shard_count),
    ):
      if state.get(k) != mine:
        raise ValueError(f"loader state {k}={state.get(k)!r} does not match this loader's {k}={mine!r}")
    step = int(state["step"])
    if step < 0:
      raise ValueError(f"loader state step={step} is negative")
    self._step = step
