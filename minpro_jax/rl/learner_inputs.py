"""What the learner's jitted programs read of a `RolloutBatch`: `ScoreInputs` for the score pass, `UpdateInputs` for
an update (device arrays, the shapes and dtypes of `RolloutBatch`; packed (`minpro_jax.rl.packing`), [R, W] rows
with advantages per token)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from minpro_jax.rl.rollout import RolloutBatch

SCORE_ROW_FIELDS = ("tokens", "segment_ids", "positions")
# the fields every update reads; the optional ones (`UpdateInputs`) follow them
UPDATE_ROW_FIELDS = (
    "tokens",
    "segment_ids",
    "positions",
    "response_mask",
    "behavior_logp",
    "learner_logp",
    "advantages",
)


def device(x) -> jax.Array | None:
  """`x` as a device array, None for None."""
  return None if x is None else jnp.asarray(x)


def replayed_routes(batch: RolloutBatch, replay: bool) -> jax.Array | None:
  """The batch's routes as a device array when replaying them, else None.

  Raises:
    ValueError: replay without routes in the batch (the sampler records them with `record_routes=True`).
  """
  if not replay:
    return None
  if batch.routes is None:
    raise ValueError(
        "LossConfig.router_replay=True but the batch has no routes; sample it with Sampler(record_routes=True)"
    )
  return jnp.asarray(batch.routes)


class ScoreInputs(NamedTuple):
  """What scoring reads of a `RolloutBatch`: [N, L] int32 tokens, segment_ids and positions (device arrays), the
  [N, L, layers, k] routes to replay (or None) and the [N, L] float32 kept-set thresholds of truncated sampling
  (or None: full-vocabulary log-probs)."""

  tokens: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  routes: jax.Array | None = None
  kept_logp_threshold: jax.Array | None = None

  @classmethod
  def of(cls, batch: RolloutBatch, replay: bool = False) -> "ScoreInputs":
    arrays = (jnp.asarray(getattr(batch, f)) for f in SCORE_ROW_FIELDS)
    return cls(*arrays, replayed_routes(batch, replay), device(batch.kept_logp_threshold))


class UpdateInputs(NamedTuple):
  """What an update reads of a `RolloutBatch` (device arrays, the shapes and dtypes of `RolloutBatch`); packed
  (`minpro_jax.rl.packing`), the [R, W] rows with advantages per token ([R, W] float32) instead of per sample.

  Optional (None when the loss does not read them): `routes` to replay, the truncated sampling's
  `kept_logp_threshold`, decoupled PPO's `proximal_logp` ([N, L] float32 log-probs of pi_prox,
  `RolloutBatch.proximal_logp`) and `proximal_alpha` (a float32 scalar: A-3PO's interpolation weight of this
  update, `minpro_jax.rl.proximal`; set per update, never sliced by rows).
  """

  tokens: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  response_mask: jax.Array
  behavior_logp: jax.Array
  learner_logp: jax.Array
  advantages: jax.Array
  routes: jax.Array | None = None
  kept_logp_threshold: jax.Array | None = None
  proximal_logp: jax.Array | None = None
  proximal_alpha: jax.Array | None = None

  @classmethod
  def of(cls, batch: RolloutBatch, replay: bool = False) -> "UpdateInputs":
    arrays = (jnp.asarray(getattr(batch, f)) for f in UPDATE_ROW_FIELDS)
    return cls(
        *arrays,
        routes=replayed_routes(batch, replay),
        kept_logp_threshold=device(batch.kept_logp_threshold),
        proximal_logp=device(batch.proximal_logp),
    )

  def score_inputs(self) -> ScoreInputs:
    return ScoreInputs(self.tokens, self.segment_ids, self.positions, self.routes, self.kept_logp_threshold)
