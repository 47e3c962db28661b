"""PPO epochs (`config.num_epochs`): the row order of each pass over a released batch.

A global step passes over the batch the delay buffer released `num_epochs` (E) times, each pass split into the
`num_updates_per_step` (n) mini-batches of consecutive rows, one optimizer update each: E x n updates a step, as
Tunix's `num_iterations`, MaxText's `rl.num_iterations` and verl's `ppo_epochs` do. The first pass takes the rows
in their order (so E = 1 is the one-pass learner, unchanged); every later pass reorders the batch's groups (the
`group_size` consecutive rows of a prompt stay together, so a mini-batch still holds whole groups) by a permutation
drawn from (`config.seed`, the policy version before the step's first update, the pass): a pure function of the
run's state, so a resumed run draws the same orders. The staleness this gives is derived in
`minpro_jax.rl.rollout`.
"""

from __future__ import annotations

import numpy as np

EPOCH_SALT = 0x5EED0E  # keeps these draws apart from the run's other uses of its seed


def epoch_rows(num_rows: int, group_size: int, epoch: int, seed: int, version: int) -> np.ndarray:
  """[num_rows] int64 row order of pass `epoch` (0-based) over a batch of `num_rows` rows in groups of `group_size`:
  0, 1, ... for pass 0; whole groups in a permuted order for the others (module docstring).

  Raises:
    ValueError: `num_rows` not a multiple of `group_size` (>= 1), or a negative epoch.
  """
  if group_size < 1 or num_rows % group_size:
    raise ValueError(f"epoch_rows: {num_rows} rows do not split into groups of {group_size}")
  if epoch < 0:
    raise ValueError(f"epoch_rows: epoch must be >= 0, got {epoch}")
  rows = np.arange(num_rows, dtype=np.int64)
  if epoch == 0:
    return rows
  rng = np.random.default_rng([int(seed), int(version), int(epoch), EPOCH_SALT])
  groups = rng.permutation(num_rows // group_size)
  return (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1).astype(np.int64)
