"""Group-normalised outcome advantages keyed by explicit group (prompt) ids.

``group_advantages`` never infers groups from positions: samples can be shuffled or split across
micro-batches without mixing groups. Works under ``jax.jit`` with no static group count: ids are mapped
to dense ranks with a sort, and per-group statistics use ``jax.ops.segment_*`` with ``num_segments=N``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")


def _dense_group_index(group_ids: jax.Array) -> jax.Array:
  """Map arbitrary integer ids to dense indices in [0, num_distinct) (jit-friendly, via argsort)."""
  order = jnp.argsort(group_ids, stable=True)
  sorted_ids = group_ids[order]
  new_group = jnp.concatenate([jnp.zeros((1,), jnp.int32), (sorted_ids[1:] != sorted_ids[:-1]).astype(jnp.int32)])
  dense_sorted = jnp.cumsum(new_group)
  return jnp.zeros_like(dense_sorted).at[order].set(dense_sorted)


def group_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    mode: str = "grpo",
    std_ddof: int = 1,
    eps: float = 1e-6,
) -> jax.Array:
  """Per-sample advantages normalised within each group of samples sharing a ``group_ids`` value.

  Modes (n = group size, m = group mean, computed in float32 with two passes):
    * ``"grpo"`` (DeepSeekMath GRPO; verl ``compute_grpo_outcome_advantage``): (r - m) / (std + eps), std
      with ``std_ddof`` (1 = unbiased, matching torch.std / verl; 0 = population).
    * ``"drgrpo"`` (Dr. GRPO, arXiv 2503.20783): r - m (no std division).
    * ``"rloo"`` (leave-one-out): r_i - (sum_g - r_i) / (n - 1).
  Rules:
    * A group (n >= 2) whose rewards are all exactly equal (group max == group min) gets exactly 0:
      no NaN and no amplification of a rounding residue by 1/std (case B07, tests/CASES.md).
    * A group of size 1 follows verl: mean 0 and std 1, i.e. ``grpo`` gives r / (1 + eps), ``drgrpo``
      and ``rloo`` give r.
    * ``grpo`` with ``std_ddof >= n`` for n >= 2 is treated like ddof = n - 1.

  Args:
    rewards: [N] float rewards.
    group_ids: [N] integer group (prompt) ids; any values, any order.
    mode: one of ``ADVANTAGE_MODES``.
    std_ddof: 0 or 1.
    eps: added to the std in ``grpo`` mode.

  Returns: [N] float32 advantages.

  Raises: ValueError for an unknown mode, bad ddof, or mismatched/invalid shapes or dtypes.
  """
  if mode not in ADVANTAGE_MODES:
    raise ValueError(f"Unknown advantage mode {mode!r}; valid choices: {', '.join(ADVANTAGE_MODES)}.")
  if std_ddof not in (0, 1):
    raise ValueError(f"std_ddof must be 0 or 1, got {std_ddof!r}.")
  if rewards.ndim != 1 or group_ids.shape != rewards.shape:
    raise ValueError(
        f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}."
    )
  if not jnp.issubdtype(group_ids.dtype, jnp.integer):
    raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}.")
  n_total = rewards.shape[0]
  r = rewards.astype(jnp.float32)
  idx = _dense_group_index(group_ids)
  seg = lambda op, x: op(x, idx, num_segments=n_total)[idx]  # noqa: E731
  count = seg(jax.ops.segment_sum, jnp.ones_like(r))
  total = seg(jax.ops.segment_sum, r)
  all_equal = seg(jax.ops.segment_max, r) == seg(jax.ops.segment_min, r)
  singleton = count == 1
  mean = total / count
  dev = r - mean
  if mode == "drgrpo":
    adv = dev
  elif mode == "rloo":
    adv = r - (total - r) / jnp.maximum(count - 1.0, 1.0)
  else:
    var = seg(jax.ops.segment_sum, dev * dev) / jnp.maximum(count - std_ddof, 1.0)
    adv = dev / (jnp.sqrt(var) + eps)
  adv = jnp.where(all_equal, 0.0, adv)
  single = r / (1.0 + eps) if mode == "grpo" else r
  return jnp.where(singleton, single, adv)
