"""The model-agnostic decode loop: sample, record, stop, feed back (pure functions, jit-friendly).

`step_fn(model_carry, tokens_b, step) -> (logits_bv, model_carry)` is whatever produces the next logits
(the KV-cached transformer in `Sampler`, a scripted function in tests), so stop handling and log-prob
bookkeeping are tested independently of the model.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from minpro_jax.models.moe import NO_ROUTE, ROUTE_DTYPE
from minpro_jax.sampling.methods import SamplingParams, get_next_tokens


class LoopState(NamedTuple):
  """Decode-loop carry (donated between prefill and decode).

  step: int32 scalar, next response index to fill.
  tokens: [B, R] int32 response ids (pad id where masked).
  logp: [B, R] float32 behavior log-probs (0 where masked).
  entropy: [B, R] float32 (0 where masked).
  mask: [B, R] bool, True up to and including the stop token.
  done: [B] bool, row finished (stopped, or a padding row of the batch bucket).
  stopped: [B] bool, row emitted a stop id.
  keys: [B] per-row PRNG keys; the key of step i is fold_in(keys[b], i).
  model_carry: opaque state of `step_fn` (the KV cache and positions).
  routes: None, or [B, R, L, k] int16 MoE experts per response token and layer (router replay): index i holds
    the experts that fed response token i forward (the step that sampled index i + 1); NO_ROUTE (-1) elsewhere.
  kept_logp_threshold: None, or [B, R] float32 threshold of each token's top-k / top-p set when the sampling
    truncates (`NextTokens`; -inf where masked).
  """

  step: jax.Array
  tokens: jax.Array
  logp: jax.Array
  entropy: jax.Array
  mask: jax.Array
  done: jax.Array
  stopped: jax.Array
  keys: jax.Array
  model_carry: Any
  routes: jax.Array | None = None
  kept_logp_threshold: jax.Array | None = None

  def outputs(self) -> tuple:
    """(tokens, logp, entropy, mask, stopped, routes, kept_logp_threshold): what the sampler returns."""
    return self.tokens, self.logp, self.entropy, self.mask, self.stopped, self.routes, self.kept_logp_threshold


def init_loop_state(
    row_keys: jax.Array,
    active_b: jax.Array,
    max_new_tokens: int,
    model_carry,
    pad_id: int = 0,
    route_shape: tuple[int, int] | None = None,
    truncates: bool = False,
) -> LoopState:
  """An empty carry for B rows; rows with active_b False start done (batch-bucket padding). `route_shape` (L, k)
  records MoE routes (`LoopState.routes`); `truncates` (`SamplingParams.truncates`) records the kept-set
  thresholds."""
  b = active_b.shape[0]
  shape = (b, max_new_tokens)
  routes = None if route_shape is None else jnp.full((*shape, *route_shape), NO_ROUTE, ROUTE_DTYPE)
  return LoopState(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full(shape, pad_id, jnp.int32),
      logp=jnp.zeros(shape, jnp.float32),
      entropy=jnp.zeros(shape, jnp.float32),
      mask=jnp.zeros(shape, bool),
      done=~active_b,
      stopped=jnp.zeros((b,), bool),
      keys=row_keys,
      model_carry=model_carry,
      routes=routes,
      kept_logp_threshold=jnp.full(shape, -jnp.inf, jnp.float32) if truncates else None,
  )


def sample_step(state: LoopState, logits_bv: jax.Array, sampling: SamplingParams, pad_id: int = 0) -> LoopState:
  """Samples response index `state.step` for every live row and applies the stop rule (case B09 of tests/CASES.md).

  A row that is already done gets the pad id, mask False and log-prob 0. A row that draws a stop id keeps
  that token (mask True) and is done from the next index on.
  """
  i = state.step
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys, i)
  nxt = get_next_tokens(logits_bv, step_keys, sampling)
  live = ~state.done
  tok = jnp.where(live, nxt.tokens, pad_id)
  stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
  is_stop = live & jnp.any(nxt.tokens[:, None] == stop_ids[None, :], axis=-1) if stop_ids.size else jnp.zeros_like(live)
  col = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None].astype(a.dtype), (0, i))
  if state.kept_logp_threshold is not None:
    state = state._replace(
        kept_logp_threshold=col(state.kept_logp_threshold, jnp.where(live, nxt.kept_logp_threshold, -jnp.inf))
    )
  return state._replace(
      step=i + 1,
      tokens=col(state.tokens, tok),
      logp=col(state.logp, jnp.where(live, nxt.logp, 0.0)),
      entropy=col(state.entropy, jnp.where(live, nxt.entropy, 0.0)),
      mask=col(state.mask, live),
      done=state.done | is_stop,
      stopped=state.stopped | is_stop,
  )


def decode_loop(step_fn: Callable, state: LoopState, sampling: SamplingParams, pad_id: int = 0) -> LoopState:
  """Runs `lax.while_loop` until every row is done or `max_new_tokens` indices are filled.

  `state` must already hold index 0 (sampled from the prefill logits). Each iteration feeds the token of
  index step - 1 (pad for finished rows) to `step_fn` and samples index `step`. With `state.routes`, `step_fn`
  returns (logits, carry, routes [B, L, k]) and the routes of the rows still live are written at index step - 1.
  """
  r = sampling.max_new_tokens

  def cond(s):
    return (s.step < r) & ~jnp.all(s.done)

  def body(s):
    prev = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)[:, 0]
    logits, carry, *routes = step_fn(s.model_carry, prev, s.step)
    if s.routes is not None:
      fed = jnp.where(~s.done[:, None, None], routes[0], NO_ROUTE).astype(ROUTE_DTYPE)
      s = s._replace(routes=jax.lax.dynamic_update_slice_in_dim(s.routes, fed[:, None], s.step - 1, axis=1))
    return sample_step(s._replace(model_carry=carry), logits, sampling, pad_id)

  return jax.lax.while_loop(cond, body, state)
