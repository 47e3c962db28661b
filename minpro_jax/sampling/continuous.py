"""Continuous batching: a fixed set of decode rows, each refilled with the next waiting prompt when it stops.

All N = prompts x group_size requests of one `generate` call are known up front. B decode rows (a batch
bucket) share one KV cache of P + R slots per row (P the prompt bucket of the whole call, R =
max_new_tokens). Every row carries its own response index i_b, so its new token goes to its own cache slot
P + i_b - 1 at RoPE position len(prompt) + i_b - 1 (`Transformer` with a [B] `cache_index`), and its draw
uses fold_in(row_key, i_b) with row_key = fold_in(fold_in(key(seed), group_id), sample_index): what a row
samples depends only on its prompt, its key and the parameters, never on which decode row it ran in or what
ran beside it.

Chunked work (the host-refill engine, `sampling.engines.host_refill`): a jitted `lax.while_loop` runs decode steps until `need` rows are done (or every row is), then
the host refills the done rows with a jitted prefill of the waiting prompts (their keys / values written into
those rows' slots [0, P); the slots after P keep the previous occupant's entries, which the causal rule hides
until the new row overwrites them) and samples their index 0. Outputs are scattered straight into [N, R]
arrays on the device, indexed by request, so the host reads only the [B] done flags between chunks.
`decode_with_refills` (the continuous engine, the default) instead runs the whole call as one `lax.while_loop`
whose iterations either prefill the next waiting prompts into done rows (a `lax.cond` branch) or decode.

Each decode step attends over the first L cache slots only, L the smallest `live_length_buckets` size >=
P + the longest live row's index (`live_length_attention`), so a step's cost follows the live length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from minpro_jax.models.moe import NO_ROUTE, ROUTE_DTYPE
from minpro_jax.models.transformer import KVCache
from minpro_jax.sampling.methods import SamplingParams, get_next_tokens


class ContinuousState(NamedTuple):
  """Carry of the continuous decode (donated between chunks and refills).

  step: [B] int32, next response index of each decode row (1 after its prefill).
  done: [B] bool, the row has stopped, used its budget, or holds no request.
  req: [B] int32, the request (output row) the decode row works on; N = none (writes are dropped).
  group: [B] int32, that request's group id (what a `logits_processor` sees).
  keys: [B, 2] uint32 key data of each row's PRNG key (index i uses fold_in(key, i)).
  next_pos: [B] int32, RoPE position of response index 0 (the prompt's real length).
  prev: [B] int32, the token sampled last (fed at the next step).
  cache: the `KVCache` of B rows x (P + R) slots.
  tokens / logp / entropy / mask: [N, R] outputs by request (pad id / 0 / 0 / False where not generated).
  stopped: [N] bool, the request emitted a stop id.
  routes: None, or [N, R, L, k] int16 MoE experts that fed each response token forward (`LoopState.routes`).
  kept_logp_threshold: None, or [N, R] float32 kept-set thresholds when the sampling truncates (`LoopState`).
  """

  step: jax.Array
  done: jax.Array
  req: jax.Array
  group: jax.Array
  keys: jax.Array
  next_pos: jax.Array
  prev: jax.Array
  cache: KVCache
  tokens: jax.Array
  logp: jax.Array
  entropy: jax.Array
  mask: jax.Array
  stopped: jax.Array
  routes: jax.Array | None = None
  kept_logp_threshold: jax.Array | None = None

  def outputs(self) -> tuple:
    """(tokens, logp, entropy, mask, stopped, routes, kept_logp_threshold): what the sampler returns."""
    return self.tokens, self.logp, self.entropy, self.mask, self.stopped, self.routes, self.kept_logp_threshold


def init_state(
    config,
    rows: int,
    num_requests: int,
    slots: int,
    max_new_tokens: int,
    pad_id: int,
    record_routes: bool = False,
    truncates: bool = False,
) -> ContinuousState:
  """Every decode row empty (done, request N); outputs [N, R] empty (`truncates`: with kept-set thresholds,
  `SamplingParams.truncates`). Traceable."""
  shape = (num_requests, max_new_tokens)
  route_shape = (*shape, config.num_layers, config.num_experts_per_tok)
  z = jnp.zeros((rows,), jnp.int32)
  return ContinuousState(
      step=z + 1,
      done=jnp.ones((rows,), bool),
      req=z + num_requests,
      group=z,
      keys=jnp.zeros((rows, 2), jnp.uint32),
      next_pos=z,
      prev=z + pad_id,
      cache=KVCache.zeros(config, rows, slots),
      tokens=jnp.full(shape, pad_id, jnp.int32),
      logp=jnp.zeros(shape, jnp.float32),
      entropy=jnp.zeros(shape, jnp.float32),
      mask=jnp.zeros(shape, bool),
      stopped=jnp.zeros((num_requests,), bool),
      routes=jnp.full(route_shape, NO_ROUTE, ROUTE_DTYPE) if record_routes else None,
      kept_logp_threshold=jnp.full(shape, -jnp.inf, jnp.float32) if truncates else None,
  )


def record(
    st: ContinuousState,
    logits_bv,
    step_b,
    live_b,
    req_b,
    group_b,
    keys_b,
    sampling: SamplingParams,
    pad_id: int,
    processor=None,
):
  """Samples response index step_b[b] of the rows with live_b True and writes it to their requests' outputs.

  The stop rule is the static loop's (`minpro_jax.sampling.loop.sample_step`): a stop token is kept (mask
  True) and ends the row; so does filling index R - 1. `processor(logits [B, V], step [B], group id [B])`,
  when given, replaces the raw logits first (`Sampler(logits_processor=...)`).

  Returns:
    (state with the outputs updated, next step [B], done [B], sampled token or pad [B]).
  """
  n, r = st.tokens.shape
  if processor is not None:
    logits_bv = processor(logits_bv, step_b, group_b)
  key_fn = lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i)
  nxt = get_next_tokens(logits_bv, jax.vmap(key_fn)(keys_b, step_b), sampling)
  stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
  is_stop = jnp.any(nxt.tokens[:, None] == stop_ids[None, :], axis=-1) if stop_ids.size else jnp.zeros_like(live_b)
  is_stop = is_stop & live_b
  at = jnp.where(live_b, req_b, n)  # out of range: dropped
  col = jnp.minimum(step_b, r - 1)
  st = st._replace(
      tokens=st.tokens.at[at, col].set(nxt.tokens, mode="drop"),
      logp=st.logp.at[at, col].set(nxt.logp, mode="drop"),
      entropy=st.entropy.at[at, col].set(nxt.entropy, mode="drop"),
      mask=st.mask.at[at, col].set(True, mode="drop"),
      stopped=st.stopped.at[at].set(is_stop, mode="drop"),
  )
  if st.kept_logp_threshold is not None:
    thr = st.kept_logp_threshold.at[at, col].set(nxt.kept_logp_threshold, mode="drop")
    st = st._replace(kept_logp_threshold=thr)
  new_step = jnp.where(live_b, step_b + 1, step_b)
  done = ~live_b | is_stop | (new_step >= r)
  return st, new_step, done, jnp.where(live_b, nxt.tokens, pad_id)


def refill(
    st: ContinuousState,
    prefill_fn,
    tokens_np,
    segs_np,
    rows,
    reqs,
    groups,
    keys,
    sampling,
    pad_id,
    keys_hd_major,
    processor=None,
):
  """Prefills up to M prompts into decode rows `rows` and samples their index 0.

  Args:
    st: the carry.
    prefill_fn: (tokens [M, P], positions, segments, cache of P slots) -> (logits [M, V], KVCache).
    tokens_np, segs_np: [M, P] int32 left-padded prompts and their segment ids (1 real, 0 pad).
    rows: [M] int32 decode rows to fill (B: a padding entry, ignored).
    reqs: [M] int32 request ids (N for padding entries).
    groups: [M] int32 their group ids.
    keys: [M, 2] uint32 key data of the requests' row keys.
    sampling, pad_id, processor: as `record`.
    keys_hd_major: the key cache layout (`minpro_jax.models.transformer.keys_head_dim_major`).
  """
  p = tokens_np.shape[1]
  positions = jnp.where(segs_np > 0, jnp.cumsum(segs_np, axis=1) - 1, 0).astype(jnp.int32)
  logits, small = prefill_fn(tokens_np, positions, segs_np)
  if keys_hd_major:  # keys [B, K, hd, S]
    big_k = [kb.at[rows, :, :, :p].set(kn, mode="drop") for kb, kn in zip(st.cache.k, small.k)]
  else:
    big_k = [kb.at[rows, :, :p].set(kn, mode="drop") for kb, kn in zip(st.cache.k, small.k)]
  big_v = [vb.at[rows, :, :p].set(vn, mode="drop") for vb, vn in zip(st.cache.v, small.v)]
  seg = st.cache.segment_ids.at[rows, :p].set(segs_np, mode="drop")
  st = st._replace(cache=KVCache(k=tuple(big_k), v=tuple(big_v), segment_ids=seg))
  return start_rows(st, logits, positions, rows, reqs, groups, keys, sampling, pad_id, processor)


def start_rows(st: ContinuousState, logits, positions, rows, reqs, groups, keys, sampling, pad_id, processor=None):
  """Samples index 0 of freshly prefilled decode rows from their prefill logits [M, V] and sets their carry
  (positions: [M, P] the prompts' RoPE positions; other arguments as `refill`)."""
  live = rows < st.next_pos.shape[0]
  st, step, done, prev = record(st, logits, jnp.zeros_like(rows), live, reqs, groups, keys, sampling, pad_id, processor)
  put = lambda a, x: a.at[rows].set(x, mode="drop")
  return st._replace(
      step=put(st.step, step),
      done=put(st.done, done),
      req=put(st.req, reqs),
      group=put(st.group, groups),
      keys=put(st.keys, keys),
      next_pos=put(st.next_pos, positions[:, -1] + 1),
      prev=put(st.prev, prev),
  )


def decode_step(s: ContinuousState, step_fn, sampling: SamplingParams, pad_id: int, p_len: int, processor=None):
  """One token for every live row: `step_fn` at each row's own cache slot and position, attending to the live
  length of the cache (the longest live row), then `record`. Finished rows are carried unchanged by `record`.

  Args: as `decode_until`. Returns: the updated `ContinuousState`.
  """
  live = ~s.done
  slot = p_len + s.step - 1
  live_len = p_len + jnp.max(jnp.where(live, s.step, 1))
  logits, cache, *routes = step_fn(s.cache, s.prev, slot, s.next_pos + s.step - 1, live_len)
  s = s._replace(cache=cache)
  if s.routes is not None:  # the experts that fed response index step - 1 forward
    at = jnp.where(live, s.req, s.routes.shape[0])
    s = s._replace(routes=s.routes.at[at, s.step - 1].set(routes[0].astype(ROUTE_DTYPE), mode="drop"))
  s, step, done, prev = record(s, logits, s.step, live, s.req, s.group, s.keys, sampling, pad_id, processor)
  return s._replace(step=step, done=done, prev=prev)


def decode_until(st: ContinuousState, step_fn, need, sampling: SamplingParams, pad_id: int, p_len: int, processor=None):
  """Decode steps (one token per live row) until at least `need` rows are done or every row is.

  step_fn(cache, tokens [B], slots [B], positions [B], live_len) -> (logits [B, V], cache), plus routes [B, L, k]
  when the state records them.
  """

  def cond(s):
    n_done = jnp.sum(s.done.astype(jnp.int32))
    return ~jnp.all(s.done) & (n_done < need)

  def body(s):
    return decode_step(s, step_fn, sampling, pad_id, p_len, processor)

  return jax.lax.while_loop(cond, body, st)


def refill_rule(n_done, waiting, refill_rows: int, minimum=jnp.minimum):
  """The in-loop refill policy of `decode_with_refills`: (refill now?, how many rows).

  An iteration refills when requests wait and at least min(refill_rows, waiting) decode rows are done; it then
  fills min(done rows, refill_rows, waiting) of them. Works on traced int32 scalars and, with `minimum=min`, on
  Python ints (`minpro_jax.aot.schedule` simulates the sampler's schedule with the same rule).
  """
  go = (waiting > 0) & (n_done >= minimum(refill_rows, waiting))
  return go, minimum(minimum(n_done, refill_rows), waiting)


def refill_next(s, nxt, count, m: int, refill_fn, prefill_fn, requests, sampling, pad_id, keys_hd_major, processor):
  """The refill branch of the in-loop samplers: the next `count` (<= m, traced) waiting requests nxt, nxt + 1, ...
  go into done decode rows (done rows first) through `refill_fn` (`refill`, or the page pool's).

  Args:
    s: the carry; nxt: int32 scalar, the next waiting request; m: the rows one refill prefills (static).
    requests: (tokens [N, P], segments [N, P], groups [N], keys [N, 2]) as `decode_with_refills`.
    Others as `refill`.

  Returns:
    (the carry after the refill, nxt + count).
  """
  tokens_n, segs_n, groups_n, keys_n = requests
  n, b = tokens_n.shape[0], s.done.shape[0]
  order = jnp.argsort(~s.done, stable=True)[:m].astype(jnp.int32)  # done rows first
  slot_ok = jnp.arange(m) < count
  rows = jnp.where(slot_ok, order, b)
  reqs = jnp.where(slot_ok, nxt + jnp.arange(m, dtype=jnp.int32), n)
  src = jnp.clip(reqs, 0, n - 1)
  args = (tokens_n[src], segs_n[src], rows, reqs, groups_n[src], keys_n[src])
  return refill_fn(s, prefill_fn, *args, sampling, pad_id, keys_hd_major, processor), nxt + count


def decode_with_refills(
    st: ContinuousState,
    step_fn,
    prefill_fn,
    requests,
    refill_rows: int,
    sampling: SamplingParams,
    pad_id: int,
    p_len: int,
    keys_hd_major: bool,
    processor=None,
):
  """The whole call in one `lax.while_loop`: each iteration either refills up to `refill_rows` done rows with the
  next waiting requests (when at least min(refill_rows, waiting) rows are done) or runs one decode step.

  Args:
    requests: (tokens [N, P] int32, segments [N, P] int32, groups [N] int32, keys [N, 2] uint32) of all requests,
      served in order.
    refill_rows: M, the rows one refill prefills (static).
    Others as `decode_until` / `refill`.

  Returns:
    The final carry (every request done).
  """
  n, m = requests[0].shape[0], refill_rows

  def refill_branch(c):
    s, nxt = c
    _, count = refill_rule(jnp.sum(s.done.astype(jnp.int32)), n - nxt, m)
    return refill_next(s, nxt, count, m, refill, prefill_fn, requests, sampling, pad_id, keys_hd_major, processor)

  def step_branch(c):
    s, nxt = c
    return decode_step(s, step_fn, sampling, pad_id, p_len, processor), nxt

  def cond(c):
    s, nxt = c
    return (nxt < n) | ~jnp.all(s.done)

  def body(c):
    s, nxt = c
    go, _ = refill_rule(jnp.sum(s.done.astype(jnp.int32)), n - nxt, m)
    return jax.lax.cond(go, refill_branch, step_branch, c)

  return jax.lax.while_loop(cond, body, (st, jnp.zeros((), jnp.int32)))[0]
