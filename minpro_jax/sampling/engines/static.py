"""The static engine: every row of a call runs until the slowest stops.

  1. Jitted prefill: the prompts run through the model into a fresh KV cache of P + max_new_tokens slots (segment
     id 1 on real tokens, 0 on pads, so pads are never attended to; RoPE positions count real tokens only), and
     response index 0 is sampled from the last prompt position.
  2. Jitted decode: a `lax.while_loop` feeds one token per row per step (cache slot P + i - 1, position
     len(prompt) + i - 1), samples index i, and exits as soon as every row has stopped. Its carry (KV cache and
     outputs) is donated, and nothing goes back to the host until the loop ends. Attention reads the whole cache.

The reference the other engines are tested against, token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.rope import rope_tables
from minpro_jax.models.transformer import KVCache
from minpro_jax.runtime.multihost import settle
from minpro_jax.sampling.engines.base import Engine, Requests, SamplerCore, register_engine
from minpro_jax.sampling.loop import LoopState, decode_loop, init_loop_state, sample_step
from minpro_jax.sampling.methods import SamplingParams


@register_engine("static")
@dataclasses.dataclass(frozen=True)
class Static:
  """Options of the static engine (none)."""

  def make(self, core: SamplerCore) -> "StaticEngine":
    return StaticEngine(core, self)


class StaticEngine(Engine):
  """Prefill, then one decode loop over all rows (see the module docstring).

  Attributes:
    prefill: jitted `(state, tokens [B, P], segs [B, P], row_keys [B], active [B], row_group [B]; sampling) ->
      LoopState` (public for compile-only tools: `minpro_jax.aot` lowers it).
    decode: jitted `(state, LoopState; sampling, cache_offset=P) -> LoopState`, the carry donated.
  """

  def __init__(self, core: SamplerCore, options: Static):
    super().__init__(core, options)
    self.prefill = jax.jit(self._prefill, static_argnames=("sampling",))
    self.decode = jax.jit(self._decode, static_argnames=("sampling", "cache_offset"), donate_argnums=(1,))

  def _prefill(self, state, tokens_bp, segment_bp, row_keys, active_b, row_group=None, *, sampling: SamplingParams):
    self.traced()
    core = self.core
    model = core.model(state)
    b, p = tokens_bp.shape
    positions = jnp.where(segment_bp > 0, jnp.cumsum(segment_bp, axis=1) - 1, 0).astype(jnp.int32)
    cache = KVCache.zeros(core.config, b, p + sampling.max_new_tokens)
    out = model(tokens_bp, positions, segment_bp, cache=cache, cache_index=0, return_hidden=True)
    logits = model.logits(out.out[:, -1:])[:, 0]
    group = jnp.zeros((b,), jnp.int32) if row_group is None else row_group
    if core.logits_processor is not None:
      logits = core.logits_processor(logits, jnp.zeros((b,), jnp.int32), group)
    carry = (out.cache, positions[:, -1] + 1, group)
    route_shape = (core.config.num_layers, core.config.num_experts_per_tok) if core.record_routes else None
    st = init_loop_state(
        row_keys, active_b, sampling.max_new_tokens, carry, core.pad_id, route_shape, sampling.truncates
    )
    return sample_step(st, logits, sampling, core.pad_id)

  def _decode(self, state, loop_state: LoopState, *, sampling: SamplingParams, cache_offset: int):
    self.traced()
    core = self.core
    model = core.model(state)
    # cos/sin of every position a row can reach (prompt bucket + max_new_tokens), built once outside the loop;
    # each step gathers its rows (see `rope_tables`)
    cos_s, sin_s = rope_tables(jnp.arange(cache_offset + sampling.max_new_tokens)[None], core.config)

    def step_fn(carry, tokens_b, step):
      cache, next_pos, group = carry
      pos = (next_pos + step - 1)[:, None]
      rope = (cos_s[0][pos], sin_s[0][pos])
      out = model(
          tokens_b[:, None], pos, jnp.ones_like(pos), cache=cache, cache_index=cache_offset + step - 1, rope=rope
      )
      logits = out.out[:, 0]
      if core.logits_processor is not None:
        logits = core.logits_processor(logits, jnp.full(group.shape, step, jnp.int32), group)
      routes = (out.routes[:, 0],) if core.record_routes else ()
      return logits, (out.cache, next_pos, group), *routes

    return decode_loop(step_fn, loop_state, sampling, core.pad_id)

  def run(self, state, requests: Requests, sampling: SamplingParams) -> tuple:
    rows = requests.tokens.shape[0]
    active = np.arange(rows) < requests.n
    group = requests.row_group.astype(np.int32)
    st = settle(
        self.prefill(state, requests.tokens, requests.segs, requests.row_keys, active, group, sampling=sampling)
    )
    return self.decode(state, st, sampling=sampling, cache_offset=requests.prompt_len).outputs()
