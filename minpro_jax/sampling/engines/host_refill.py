"""The host-refill engine: the continuous engine's rows and refill rule, driven from the host in chunks.

A jitted `lax.while_loop` runs decode steps until `need` rows are done (or every row is), then the host refills
the done rows with a jitted prefill of the waiting prompts (their keys / values written into those rows' slots
[0, P); the slots after P keep the previous occupant's entries, which the causal rule hides until the new row
overwrites them) and samples their index 0 (`minpro_jax.sampling.continuous`: `refill`, `decode_until`). Outputs are
scattered straight into [N, R] arrays on the device, so the host reads only the [B] done flags between chunks.
Same responses as the continuous engine; slower on this project's CPU (benchmarks/README.md), kept as the A/B.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from minpro_jax.models.transformer import keys_head_dim_major
from minpro_jax.runtime.multihost import settle, to_host
from minpro_jax.sampling import continuous as cb
from minpro_jax.sampling.engines.base import Requests, SamplerCore, bucket, register_engine
from minpro_jax.sampling.engines.continuous import ContinuousEngineBase, ContinuousOptions
from minpro_jax.sampling.methods import SamplingParams


@register_engine("host_refill")
@dataclasses.dataclass(frozen=True)
class HostRefill(ContinuousOptions):
  """Options of the host-refill engine (`ContinuousOptions`)."""

  def make(self, core: SamplerCore) -> "HostRefillEngine":
    return HostRefillEngine(core, self)


class HostRefillEngine(ContinuousEngineBase):
  """Decode chunks and host refills (see the module docstring)."""

  def __init__(self, core: SamplerCore, options: ContinuousOptions):
    super().__init__(core, options)
    self._init = jax.jit(self._init_impl, static_argnames=("rows", "num_requests", "slots", "sampling"))
    self._refill = jax.jit(self._refill_impl, static_argnames=("sampling",), donate_argnums=(1,))
    self._decode = jax.jit(self._decode_impl, static_argnames=("sampling", "p_len"), donate_argnums=(1,))

  def _init_impl(self, *, rows, num_requests, slots, sampling: SamplingParams):
    c = self.core
    return cb.init_state(
        c.config, rows, num_requests, slots, sampling.max_new_tokens, c.pad_id, c.record_routes, sampling.truncates
    )

  def _refill_impl(self, state, st, tokens_mp, segs_mp, rows_m, reqs_m, groups_m, keys_m, *, sampling):
    self.traced()
    c = self.core
    model = c.model(state)
    hd_major = keys_head_dim_major(c.config.jnp_dtype)
    return cb.refill(
        st,
        c.prefill_fn(model),
        tokens_mp,
        segs_mp,
        rows_m,
        reqs_m,
        groups_m,
        keys_m,
        sampling,
        c.pad_id,
        hd_major,
        c.logits_processor,
    )

  def _decode_impl(self, state, st, need, *, sampling: SamplingParams, p_len: int):
    self.traced()
    model = self.core.model(state)
    step_fn = self.step_fn(model, p_len + sampling.max_new_tokens)
    return cb.decode_until(st, step_fn, need, sampling, self.core.pad_id, p_len, self.core.logits_processor)

  def run(self, state, requests: Requests, sampling: SamplingParams) -> tuple:
    n, p_len = requests.n, requests.prompt_len
    tokens, segs, keys = requests.tokens[:n], requests.segs[:n], requests.key_data()
    row_group = requests.row_group[:n]
    rows, refill_at = self.rows_and_refill(n)
    st = settle(self._init(rows=rows, num_requests=n, slots=p_len + sampling.max_new_tokens, sampling=sampling))
    done = np.ones(rows, bool)
    nxt = 0  # next waiting request
    while True:
      free = np.flatnonzero(done)[: n - nxt]
      if free.size:
        m = min(bucket(free.size, self.core.batch_buckets) or rows, rows)
        take = np.arange(nxt, nxt + free.size)
        pad = m - free.size
        at = np.concatenate([free, np.full(pad, rows)]).astype(np.int32)
        reqs = np.concatenate([take, np.full(pad, n)]).astype(np.int32)
        src = np.concatenate([take, np.full(pad, take[-1])])
        groups = row_group[src].astype(np.int32)
        st = settle(self._refill(state, st, tokens[src], segs[src], at, reqs, groups, keys[src], sampling=sampling))
        nxt += free.size
      waiting = n - nxt
      need = min(refill_at, waiting) if waiting else rows + 1
      st = self._decode(state, st, np.int32(need), sampling=sampling, p_len=p_len)
      done = to_host(st.done)
      if not waiting and done.all():
        break
    return st.outputs()
