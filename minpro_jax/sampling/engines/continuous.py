"""The continuous engine (the default): a fixed number of decode rows, each refilled with the next waiting request
as soon as it stops, with decode attention over the live cache length only. The whole call is one jitted
`lax.while_loop` whose iterations either prefill waiting prompts into done rows or run a decode step
(`minpro_jax.sampling.continuous.decode_with_refills`, which holds the algorithm and its invariants). Every response
is the static engine's, token for token (log-probs up to fp32 rounding of the batch's matmuls).

`ContinuousOptions` and `ContinuousEngineBase` are shared with the host-refill and paged engines: the decode rows
and refill rule, and the dense decode step.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.rope import rope_tables
from minpro_jax.models.transformer import keys_head_dim_major
from minpro_jax.sampling import continuous as cb
from minpro_jax.sampling.engines.base import Engine, Requests, SamplerCore, bucket, register_engine
from minpro_jax.sampling.methods import SamplingParams


@dataclasses.dataclass(frozen=True)
class ContinuousOptions:
  """decode_rows: the decode rows of a call (rounded up to a batch bucket, never more than the call's own bucket).
  refill_rows: the engine refills once this many rows are done (or fewer when fewer requests wait); None:
    max(1, rows // 8).

  Raises:
    ValueError: decode_rows or refill_rows not an int >= 1.
  """

  decode_rows: int = 64
  refill_rows: int | None = None

  def __post_init__(self):
    for name in ("decode_rows", "refill_rows"):
      v = getattr(self, name)
      if v is None and name == "refill_rows":
        continue
      if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < 1:
        raise ValueError(
            f"{name}={v!r}: must be an int >= 1 (decode_rows {self.decode_rows}, refill_rows " f"{self.refill_rows})"
        )
      object.__setattr__(self, name, int(v))


class ContinuousEngineBase(Engine):
  """What the continuous engines share: their rows and refill rule, and the dense decode step."""

  def __init__(self, core: SamplerCore, options: ContinuousOptions):
    super().__init__(core, options)

  def rows_and_refill(self, num_requests: int) -> tuple[int, int]:
    """(decode rows, rows per refill) of a call of `num_requests` requests: `decode_rows` rounded up to a batch
    bucket but never more than the call's own bucket, and `refill_rows` (default rows // 8) capped at the rows."""
    n, buckets, o = int(num_requests), self.core.batch_buckets, self.options
    rows = min(bucket(o.decode_rows, buckets) or o.decode_rows, bucket(n, buckets) or n)
    return rows, min(o.refill_rows or max(1, rows // 8), rows)

  def decode_rows(self, num_requests: int) -> int:
    return self.rows_and_refill(num_requests)[0]

  def step_fn(self, model, num_positions: int):
    """The dense continuous decode step: one token per row at its own cache slot and position, attending to the
    live length of the cache; RoPE tables are built once for every position a row can reach."""
    cos_s, sin_s = rope_tables(jnp.arange(num_positions)[None], self.core.config)
    record_routes = self.core.record_routes

    def step_fn(cache, tokens_b, slot_b, pos_b, live_len):
      pos = pos_b[:, None]
      rope = (cos_s[0][pos], sin_s[0][pos])
      out = model(
          tokens_b[:, None], pos, jnp.ones_like(pos), cache=cache, cache_index=slot_b, rope=rope, live_len=live_len
      )
      return out.out[:, 0], out.cache, *((out.routes[:, 0],) if record_routes else ())

    return step_fn


@register_engine("continuous")
@dataclasses.dataclass(frozen=True)
class Continuous(ContinuousOptions):
  """Options of the continuous engine (`ContinuousOptions`)."""

  def make(self, core: SamplerCore) -> "ContinuousEngine":
    return ContinuousEngine(core, self)


class ContinuousEngine(ContinuousEngineBase):
  """The whole call in one jitted loop (see the module docstring).

  Attributes:
    program: jitted `(state, (tokens [N, P], segs [N, P], groups [N] i32, keys [N, 2] u32); sampling, p_len, rows,
      refill) -> outputs` (public for compile-only tools: `minpro_jax.aot` lowers it).
  """

  def __init__(self, core: SamplerCore, options: ContinuousOptions):
    super().__init__(core, options)
    self.program = jax.jit(self._all, static_argnames=("sampling", "p_len", "rows", "refill"))

  def _all(self, state, requests, *, sampling: SamplingParams, p_len: int, rows: int, refill: int):
    self.traced()
    core = self.core
    model = core.model(state)
    n = requests[0].shape[0]
    slots = p_len + sampling.max_new_tokens
    st = cb.init_state(
        core.config, rows, n, slots, sampling.max_new_tokens, core.pad_id, core.record_routes, sampling.truncates
    )
    step_fn = self.step_fn(model, p_len + sampling.max_new_tokens)
    hd_major = keys_head_dim_major(core.config.jnp_dtype)
    st = cb.decode_with_refills(
        st,
        step_fn,
        core.prefill_fn(model),
        requests,
        refill,
        sampling,
        core.pad_id,
        p_len,
        hd_major,
        core.logits_processor,
    )
    return st.outputs()

  def program_inputs(self, requests: Requests) -> tuple:
    """The `program`'s request arrays of `requests`: its first N rows, group ids as int32, key data."""
    n = requests.n
    return requests.tokens[:n], requests.segs[:n], requests.row_group[:n].astype(np.int32), requests.key_data()

  def run(self, state, requests: Requests, sampling: SamplingParams) -> tuple:
    rows, refill = self.rows_and_refill(requests.n)
    return self.program(
        state, self.program_inputs(requests), sampling=sampling, p_len=requests.prompt_len, rows=rows, refill=refill
    )
