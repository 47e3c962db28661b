"""Rollout batches and the delay buffer that emulates stale sampling exactly.

A `RolloutBatch` is everything the learner needs about one global step's samples, as host numpy arrays
in the learner's layout (one sample per row: left-padded prompt then response); it is built from the
sampler's `GenerationBatch` by `RolloutBatch.from_generation`. It carries the behavior log-probs recorded
by the sampler at generation time together with the `policy_version` of the parameters that produced
them; nothing here ever recomputes them (case B15, tests/CASES.md).

Staleness. `RolloutBuffer` is a FIFO of depth d = `delay`: the batch pushed at global step s is released
at step s + d. Each global step passes E = `num_epochs` times over the batch released in it, each pass n =
`num_updates_per_step` optimizer updates (`minpro_jax.rl.epochs`; none while the buffer fills, steps 0..d-1), and
the sampler always uses the newest parameters, so the parameters at the start of step t are version
max(0, t - d) * E * n. The batch released at step s >= d was sampled at step s - d by version
max(0, s - 2d) * E * n, and update j (0-based) of pass e (0-based) of step s runs at version
(s - d) * E * n + e * n + j. The staleness of that use of a sample (`minpro_jax.rl.learner.staleness`, updates
between sampling and use) is therefore:
  * d * E * n + e * n + j once the buffer has been full for d steps (s >= 2d);
  * (s - d) * E * n + e * n + j for the first d released batches (d <= s < 2d), which the initial parameters
    sampled.
Each sample is used E times, so the `staleness/*` metrics and histogram count E uses per sample. The paper's d = 2,
E = 1, n = 16 gives 32..47 in the steady state (tests/test_staleness.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import flax.struct
import numpy as np

from minpro_jax.models.moe import NO_ROUTE
from minpro_jax.sampling.batch import GenerationBatch

logger = logging.getLogger(__name__)
_ROW_FIELDS = ("tokens", "segment_ids", "positions", "response_mask", "behavior_logp", "learner_logp")
_SAMPLE_FIELDS = ("advantages", "rewards", "group_ids", "policy_version", "response_lengths", "truncated")


@flax.struct.dataclass
class RolloutBatch:
  """Samples of one global step in learner layout (N rows, L = prompt bucket + max new tokens).

  A pytree (`flax.struct.dataclass`, frozen: use `.replace(field=...)`) of host numpy arrays.

  Attributes:
    tokens: [N, L] int32 prompt and response tokens (padding anywhere is segment 0).
    segment_ids: [N, L] int32, 1 on real tokens, 0 on padding.
    positions: [N, L] int32 RoPE positions (count real tokens only).
    response_mask: [N, L] bool, True on response tokens (up to and including the stop token).
    behavior_logp: [N, L] float32 sampler log-prob of each response token (0 elsewhere), under the
      temperature-scaled distribution it was sampled from (renormalised over the top-k / top-p set when the
      sampling truncated).
    learner_logp: [N, L] float32 learner (training-precision) log-prob of the same tokens under the same
      parameter version, computed at sampling time; equals behavior_logp up to the sampler's precision
      (MIPU's pi_k; TIS/MIS rollout correction uses it).
    advantages: [N] float32 group-normalised advantages.
    rewards: [N] float32 rewards.
    group_ids: [N] int64 prompt/group id of each sample (unique across the run).
    policy_version: [N] int64 number of optimizer updates of the parameters that sampled each row.
    response_lengths: [N] int32 response tokens including the stop token.
    truncated: [N] bool, True if generation hit max_new_tokens without a stop token.
    routes: None, or [N, L, layers, k] int16 MoE experts that fed each token forward in the sampler (router
      replay, `loss.router_replay`): set on response tokens the sampler fed forward, NO_ROUTE (-1) on prompt,
      padding and the last response token.
    kept_logp_threshold: None when the sampling did not truncate, else [N, L] float32 threshold of each response
      token's top-k / top-p set (`GenerationBatch.kept_logp_threshold`), -inf elsewhere; the learner renormalises
      its log-probs over the same sets (`minpro_jax.models.logprobs`).
    proximal_logp: None, or [N, L] float32 log-probs of the same tokens under decoupled PPO's proximal policy (the
      parameters before the first update of the step that learns from the batch; `minpro_jax.rl.proximal`), set by
      the learn step when the loss reads them; 0 off `response_mask`. Never part of a checkpointed buffer.
    token_version: None when one version sampled each row (`policy_version`, delay mode), else [N, L] int32 the
      version that drew each response token, -1 elsewhere (in-flight updates, `minpro_jax.run.inflight_runner`:
      one response's tokens come from several versions; `policy_version` is then each row's smallest).

  Raises (on construction, when every field is an array):
    ValueError: a field whose shape is not [N, L] / [N] (names the field).
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
  routes: np.ndarray | None = None
  kept_logp_threshold: np.ndarray | None = None
  proximal_logp: np.ndarray | None = None
  token_version: np.ndarray | None = None

  def __post_init__(self):
    # pytree transforms rebuild the batch with placeholder leaves (None, sentinels): only arrays are checked
    if not all(hasattr(getattr(self, f), "shape") for f in _ROW_FIELDS + _SAMPLE_FIELDS):
      return
    n, length = self.tokens.shape
    for name in _ROW_FIELDS[1:]:
      if getattr(self, name).shape != (n, length):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, expected {(n, length)}")
    for name in _SAMPLE_FIELDS:
      if getattr(self, name).shape != (n,):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, expected {(n,)}")
    if hasattr(self.routes, "shape") and (self.routes.ndim != 4 or self.routes.shape[:2] != (n, length)):
      raise ValueError(f"RolloutBatch.routes has shape {self.routes.shape}, expected {(n, length)} + (layers, k)")
    thr = self.kept_logp_threshold
    if hasattr(thr, "shape") and thr.shape != (n, length):
      raise ValueError(f"RolloutBatch.kept_logp_threshold has shape {thr.shape}, expected {(n, length)}")
    for name in ("proximal_logp", "token_version"):
      a = getattr(self, name)
      if hasattr(a, "shape") and a.shape != (n, length):
        raise ValueError(f"RolloutBatch.{name} has shape {a.shape}, expected {(n, length)}")

  @classmethod
  def from_generation(
      cls,
      gen: GenerationBatch,
      *,
      rewards: np.ndarray,
      advantages: np.ndarray,
      learner_logp: np.ndarray | None = None,
  ) -> "RolloutBatch":
    """The learner layout [N, P + R] of the sampler's batch `gen` (prompt [N, P], response [N, R]).

    The left-padded prompt ends at column P - 1 and the response starts at column P, so every row is one
    contiguous segment; `token_logprobs(model, tokens, segment_ids, positions, temperature=gen.temperature)`
    (with `kept_logp_threshold_bt=kept_logp_threshold` when the sampling truncated) reproduces `behavior_logp` on
    `response_mask` (exactly, at equal parameters and precision): the
    log-prob of token t sits at index t, as `token_logprobs` aligns it.

    Args:
      gen: the sampler's `GenerationBatch`.
      rewards: [N] rewards (stored as float32).
      advantages: [N] advantages (stored as float32).
      learner_logp: optional [N, P + R] learner log-probs of the same tokens (stored as float32); None
        stores zeros (fill it later with `.replace(learner_logp=...)`).

    Returns:
      A `RolloutBatch` with `policy_version` = gen.policy_version on every row (with `gen.token_version`: each
      row's smallest token version, and `token_version` in the learner layout), `group_ids` int64,
      `response_lengths` = gen.lengths and `truncated` = gen.truncated.

    Raises:
      ValueError: rewards / advantages / learner_logp of the wrong shape.
    """
    n, p = gen.prompt_tokens.shape
    tokens = np.concatenate([gen.prompt_tokens, gen.response_tokens], axis=1).astype(np.int32)
    real = np.concatenate([gen.prompt_mask, gen.response_mask], axis=1)
    positions = np.where(real, np.cumsum(real, axis=1) - 1, 0).astype(np.int32)
    behavior_logp = np.concatenate([np.zeros((n, p), np.float32), gen.behavior_logp], axis=1)
    if learner_logp is None:
      learner_logp = np.zeros(tokens.shape, np.float32)
    routes = None
    if gen.routes is not None:
      prompt_routes = np.full((n, p, *gen.routes.shape[2:]), NO_ROUTE, gen.routes.dtype)
      routes = np.concatenate([prompt_routes, gen.routes], axis=1)
    kept = None
    if gen.kept_logp_threshold is not None:
      kept = np.concatenate([np.full((n, p), -np.inf, np.float32), gen.kept_logp_threshold], axis=1)
      kept = kept.astype(np.float32)
    version, token_version = np.full(n, gen.policy_version, np.int64), None
    if gen.token_version is not None:
      token_version = np.concatenate([np.full((n, p), -1, np.int32), gen.token_version], axis=1).astype(np.int32)
      drawn = np.where(gen.response_mask, gen.token_version, np.iinfo(np.int32).max).min(axis=1)
      version = np.where(gen.response_mask.any(axis=1), drawn, gen.policy_version).astype(np.int64)
    return cls(
        tokens=tokens,
        segment_ids=real.astype(np.int32),
        positions=positions,
        response_mask=np.concatenate([np.zeros((n, p), bool), gen.response_mask], axis=1),
        behavior_logp=behavior_logp.astype(np.float32),
        learner_logp=np.asarray(learner_logp, np.float32),
        advantages=np.asarray(advantages, np.float32),
        rewards=np.asarray(rewards, np.float32),
        group_ids=np.asarray(gen.group_ids).astype(np.int64),
        policy_version=version,
        response_lengths=gen.lengths,
        truncated=gen.truncated,
        routes=routes,
        kept_logp_threshold=kept,
        token_version=token_version,
    )

  @property
  def size(self) -> int:
    return int(self.tokens.shape[0])

  def select(self, rows: np.ndarray | slice) -> "RolloutBatch":
    """The rows `rows` of every field, as a new batch."""
    return RolloutBatch(**{f: None if getattr(self, f) is None else getattr(self, f)[rows] for f in _FIELDS})

  def split(self, num: int) -> list["RolloutBatch"]:
    """`num` equal consecutive mini-batches.

    Raises:
      ValueError: the batch size is not divisible by `num`.
    """
    if num <= 0 or self.size % num:
      raise ValueError(f"cannot split a batch of {self.size} samples into {num} equal mini-batches")
    m = self.size // num
    return [self.select(slice(i * m, (i + 1) * m)) for i in range(num)]

  def to_dict(self) -> dict[str, np.ndarray]:
    """The fields that are set (routes and kept_logp_threshold only when recorded), for checkpoints."""
    return {f: getattr(self, f) for f in _FIELDS if getattr(self, f) is not None}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "RolloutBatch":
    return cls(**{f: np.asarray(d[f]) for f in _FIELDS if f in d})


_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutBatch))


def mask_truncated(batch: RolloutBatch) -> RolloutBatch:
  """DAPO's overlong filtering (`reward.mask_truncated`): `batch` with the response mask of every truncated row
  cleared, so those rows get no loss (call it after the advantages are computed: their rewards still count there).

  Logs a warning naming the field when that clears every response token of the batch: it then gives no learning
  signal (no token has a loss), e.g. when `sampling.max_new_tokens` is too small for the task.
  """
  mask = batch.response_mask & ~batch.truncated[:, None]
  if batch.response_mask.any() and not mask.any():
    logger.warning(
        "reward.mask_truncated: all %d responses of this batch were truncated at sampling.max_new_tokens, so no "
        "token has a loss and the batch teaches nothing; raise sampling.max_new_tokens or unset reward.mask_truncated",
        batch.truncated.size,
    )
  return batch.replace(response_mask=mask)


class RolloutBuffer:
  """FIFO that releases each pushed batch exactly `delay` global steps later.

  `push(step, batch)` then `pop(step)` in every global step: `pop` returns the batch pushed at
  `step - delay` (with delay 0, the batch just pushed: on-policy), or None while the buffer is filling.
  The staleness this produces is derived in the module docstring.

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

  def map_batches(self, fn) -> None:
    """Replaces every waiting batch b by `fn(b)` (steps kept)."""
    self._items = [(s, fn(b)) for s, b in self._items]

  def state_dict(self) -> dict[str, Any]:
    """Checkpointable contents: the waiting batches and their steps (needed so a resumed run keeps its staleness)."""
    return {
        "steps": np.asarray([s for s, _ in self._items], np.int64),
        "batches": {str(i): b.to_dict() for i, (_, b) in enumerate(self._items)},
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    steps = [int(s) for s in np.asarray(state["steps"]).reshape(-1)]
    self._items = [(s, RolloutBatch.from_dict(state["batches"][str(i)])) for i, s in enumerate(steps)]
