"""A streaming sampler: the continuous engine's pool of decode rows run in segments of `k` decode steps, with the
parameters swapped between segments while responses are still being generated (in-flight weight updates, as
PipelineRL and AReaL's interruptible generation do).

The pool is `sampling.continuous`'s: B decode rows share one KV cache of P + R slots per row and every row carries
its own response index; the in-loop refill rule (`continuous.refill_rule`) keeps the rows busy. What differs:

* requests are a stream, not one call's list. Request g (a global count: the callers admit whole batches, request
  `i` of batch `b` is g = b * N + i) sits in ring slot g % C of C = `capacity` slots, and its outputs go to that
  slot's [R] row of the [C, R] outputs. The caller admits requests (`StreamPool.admit`) and collects finished ones
  (`collect`, which frees their slots); a slot is reused only once its request is collected;
* `segment` runs the loop until `k` decode steps are done (refills do not count) or no row is live and no admitted
  request waits; every token a segment draws is stamped with the segment's `version` in the [C, R] int32
  `version` outputs (-1 where nothing was drawn), next to its behaviour log-prob under that version;
* `swap(params, version)` gives the rows that continue the new parameters. `kv="keep"` leaves the keys and values of
  their prompts and earlier tokens as the older parameters computed them (PipelineRL's choice: the stale-KV effect);
  `kv="recompute"` recomputes every live row's cache under the new parameters first (one forward over its prompt
  and the response tokens fed so far), so each later token's log-prob is exactly the new version's teacher-forced
  log-prob (up to fp32 rounding of the two programs' summation orders).

Several JAX processes (docs/multihost.md) run one pool together: every process admits the same requests and runs
the same segments on the global mesh, so the pool's host-side state (the ring, the started count, which requests
are live or finished) is the same on every process; only the small [B] row flags are read back whole
(`multihost.to_host`), and `collect(own_rows=True)` gives each process only its rows of a finished batch (whole
groups, `row_layout.rows_to_host`), as `Sampler.generate(own_rows=True)` does. A checkpoint holds the device arrays
as they are sharded (each process writes and reads back its own shards: `state_dict`, `checkpoint_template`), with
or without the KV cache: without it (`with_kv=False`), the next `swap` after `load_state_dict` rebuilds every live
row's cache under the parameters it is given, as `kv="recompute"` does at every swap.

What a request samples depends only on its prompt, its row key (`Sampler.generate`'s: fold_in(fold_in(key(seed),
group), sample)) and the parameters each of its tokens was drawn under, never on the ring slot or decode row it ran
in. With segments longer than every admitted request's decode (no swap while a request is live), every request is
the continuous engine's, bit for bit.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.transformer import KVCache, keys_head_dim_major
from minpro_jax.runtime import multihost
from minpro_jax.runtime.row_layout import rows_to_host
from minpro_jax.sampling import continuous as cb
from minpro_jax.sampling.batch import GenerationBatch
from minpro_jax.sampling.engines.base import bucket
from minpro_jax.sampling.engines.continuous import ContinuousEngine
from minpro_jax.sampling.methods import SamplingParams

KV_MODES = ("keep", "recompute")  # `StreamPool(kv=...)`, config.staleness.inflight_kv


class SegmentStats(NamedTuple):
  """What one `StreamPool.segment` did: decode steps, refills, and sum over decode steps of the live rows."""

  decode_steps: int
  refills: int
  busy_row_steps: int


def _segment(engine, state, pool, version_map, requests, nxt, avail, version, *, sampling, p_len, refill, every):
  """The segment loop (jitted by `StreamPool`): refill or decode until `every` decode steps or nothing to do."""
  core = engine.core
  model = core.model(state)
  tokens_c, segs_c, groups_c, keys_c = requests
  cap, b, m = tokens_c.shape[0], pool.done.shape[0], refill
  step_fn = engine.step_fn(model, p_len + sampling.max_new_tokens)
  prefill_fn, hd_major = core.prefill_fn(model), keys_head_dim_major(core.config.jnp_dtype)

  def refill_branch(c):
    s, nxt, steps, refills, busy = c
    _, count = cb.refill_rule(jnp.sum(s.done.astype(jnp.int32)), avail - nxt, m)
    order = jnp.argsort(~s.done, stable=True)[:m].astype(jnp.int32)  # done rows first
    ok = jnp.arange(m) < count
    rows = jnp.where(ok, order, b)
    slot = jnp.where(ok, (nxt + jnp.arange(m, dtype=jnp.int32)) % cap, cap)
    src = jnp.clip(slot, 0, cap - 1)
    args = (tokens_c[src], segs_c[src], rows, slot, groups_c[src], keys_c[src])
    s = cb.refill(s, prefill_fn, *args, sampling, core.pad_id, hd_major, core.logits_processor)
    return s, nxt + count, steps, refills + 1, busy

  def step_branch(c):
    s, nxt, steps, refills, busy = c
    live = jnp.sum((~s.done).astype(jnp.int32))
    s = cb.decode_step(s, step_fn, sampling, core.pad_id, p_len, core.logits_processor)
    return s, nxt, steps + 1, refills, busy + live

  def cond(c):
    s, nxt, steps, _, _ = c
    return (steps < every) & ((nxt < avail) | ~jnp.all(s.done))

  def body(c):
    s, nxt = c[0], c[1]
    go, _ = cb.refill_rule(jnp.sum(s.done.astype(jnp.int32)), avail - nxt, m)
    return jax.lax.cond(go, refill_branch, step_branch, c)

  zero = jnp.zeros((), jnp.int32)
  pool, nxt, steps, refills, busy = jax.lax.while_loop(cond, body, (pool, nxt, zero, zero, zero))
  version_map = jnp.where(pool.mask & (version_map < 0), version, version_map)
  return pool, version_map, nxt, jnp.stack([steps, refills, busy])


def _recompute(core, state, pool, prompts, *, p_len):
  """Every live row's cache recomputed under `state`: one forward over its prompt (the ring slot's tokens) and the
  response tokens already fed (indices < step - 1; the last drawn token is fed by the next decode step)."""
  model = core.model(state)
  tokens_c, segs_c = prompts
  cap, r = pool.tokens.shape
  live = ~pool.done
  slot = jnp.clip(pool.req, 0, cap - 1)
  fed = (jnp.arange(r)[None, :] < (pool.step - 1)[:, None]) & live[:, None]
  resp = jnp.where(fed, pool.tokens[slot], core.pad_id)
  p_segs = segs_c[slot]
  tokens = jnp.concatenate([tokens_c[slot], resp], axis=1)
  segs = jnp.concatenate([p_segs, fed.astype(jnp.int32)], axis=1)
  p_pos = jnp.where(p_segs > 0, jnp.cumsum(p_segs, axis=1) - 1, 0)
  r_pos = jnp.where(fed, pool.next_pos[:, None] + jnp.arange(r)[None, :], 0)
  positions = jnp.concatenate([p_pos, r_pos], axis=1).astype(jnp.int32)
  cache = KVCache.zeros(model.config, tokens.shape[0], p_len + r)
  new = model(tokens, positions, segs, cache=cache, cache_index=0, return_hidden=True).cache
  keep = lambda old, fresh: jnp.where(live.reshape((-1,) + (1,) * (old.ndim - 1)), fresh, old)  # noqa: E731
  cache = KVCache(
      k=tuple(keep(o, n) for o, n in zip(pool.cache.k, new.k)),
      v=tuple(keep(o, n) for o, n in zip(pool.cache.v, new.v)),
      segment_ids=keep(pool.cache.segment_ids, new.segment_ids),
  )
  return pool._replace(cache=cache)


def _clear(pool, version_map, slots, pad_id):
  """The outputs of ring slots `slots` reset (pad / 0 / False / -1 / -inf) for their next requests."""
  put = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
  pool = pool._replace(
      tokens=put(pool.tokens, pad_id),
      logp=put(pool.logp, 0.0),
      entropy=put(pool.entropy, 0.0),
      mask=put(pool.mask, False),
      stopped=put(pool.stopped, False),
  )
  if pool.kept_logp_threshold is not None:
    pool = pool._replace(kept_logp_threshold=put(pool.kept_logp_threshold, -jnp.inf))
  return pool, put(version_map, -1)


def _take(outputs, version_map, slots):
  """The outputs and versions of ring slots `slots`, and the smallest version that drew one of their tokens
  (int32 max when none: a replicated scalar, the same on every process)."""
  taken = tuple(None if a is None else a[slots] for a in outputs)
  ver = version_map[slots]
  mask = taken[3]
  return (*taken, ver), jnp.min(jnp.where(mask, ver, jnp.iinfo(jnp.int32).max))


def _without_kv(cache: KVCache) -> KVCache:
  """`cache` without its keys and values (what a checkpoint without the KV cache holds: the segment ids)."""
  return KVCache(k=(), v=(), segment_ids=cache.segment_ids)


def _placed(tree):
  """`tree`'s arrays as the pool keeps them between segments, in buffers of their own (the segments donate them):
  device arrays copied (made under the sampler's mesh: global arrays in a multi-process run); host arrays as device
  arrays in one process, kept as host values in several (the same on every process: the next jitted segment takes
  them as the global value, where a process-local device array is not one)."""
  several = multihost.process_count() > 1
  return jax.tree.map(lambda a: np.asarray(a) if several and not isinstance(a, jax.Array) else jnp.copy(a), tree)


class StreamPool:
  """The streaming sampler of a `Sampler` with the continuous engine (module docstring).

  Args:
    sampler: the `Sampler` (engine "continuous"); its prepared parameters drive the pool.
    sampling: the `SamplingParams` of every request.
    batch_rows: N, the requests of one admitted batch: the pool decodes on the rows a continuous `generate` call
      of N requests would (`decode_rows`, refill rule).
    capacity: C ring slots (>= N; the caller collects a slot's request before its next one is admitted).
    every: k, decode steps per segment (>= 1).
    kv: "keep" or "recompute" (module docstring).
    prompt_len: P, the prompt slots of every row: a prompt bucket of the sampler (default its largest) that holds
      every prompt the pool will be given.

  Raises:
    ValueError: another engine, routes recorded, bad capacity / every / kv.
  """

  def __init__(
      self,
      sampler,
      sampling: SamplingParams,
      *,
      batch_rows: int,
      capacity: int,
      every: int,
      kv: str = "keep",
      prompt_len: int | None = None,
  ):
    engine = sampler.engine
    if type(engine) is not ContinuousEngine or sampler.record_routes:
      raise ValueError(
          f"the streaming sampler runs the continuous engine without recorded routes, got engine {engine.name!r} "
          f"(record_routes={sampler.record_routes}); set sampling.engine='continuous' (or unset it)"
      )
    if kv not in KV_MODES or every < 1 or capacity < batch_rows:
      raise ValueError(f"kv={kv!r} (one of {KV_MODES}), every={every} (>= 1), capacity={capacity} (>= {batch_rows})")
    core = engine.core
    self.sampler, self.sampling, self.kv, self.every = sampler, sampling, kv, int(every)
    self.capacity, self.rows_per_batch = int(capacity), int(batch_rows)
    self.rows, self.refill = engine.rows_and_refill(batch_rows)
    self.p_len = int(prompt_len or sampler.prompt_buckets[-1])
    r = sampling.max_new_tokens
    with sampler.mesh_context():
      pool = cb.init_state(core.config, self.rows, capacity, self.p_len + r, r, core.pad_id, False, sampling.truncates)
      self.pool = _placed(pool)  # distinct buffers: the segments donate them
      self.version_map = _placed(jnp.full((capacity, r), -1, jnp.int32))
    self.tokens = np.full((capacity, self.p_len), core.pad_id, np.int32)
    self.segs = np.zeros((capacity, self.p_len), np.int32)
    self.groups = np.zeros(capacity, np.int32)
    self.keys = np.zeros((capacity, 2), np.uint32)
    self.group_ids = np.zeros(capacity, np.int64)  # the caller's (int64) group id of each slot's request
    self.sample_index = np.zeros(capacity, np.int32)
    self.owner = np.full(capacity, -1, np.int64)  # the request in each slot, -1 = free
    self.cache_missing = False  # restored without the KV cache: the next `swap` rebuilds the live rows'
    self.nxt = 0  # requests started (global count)
    self.avail = 0  # requests admitted (global count)
    self._live: set[int] = set()
    self._segment = jax.jit(
        functools.partial(_segment, engine),
        static_argnames=("sampling", "p_len", "refill", "every"),
        donate_argnums=(1, 2),
    )
    self._recompute = jax.jit(functools.partial(_recompute, core), static_argnames=("p_len",), donate_argnums=(1,))
    self._clear = jax.jit(_clear, static_argnames=("pad_id",), donate_argnums=(0, 1))
    self._take = jax.jit(_take)
    self.core = core

  # ------------------------------------------------------------------------------------------------ requests
  def admit(self, prompts: Sequence[Sequence[int]], seed: int, group_size: int, group_ids: Sequence[int]) -> range:
    """Admits `group_size` requests per prompt (prompt-major, `Sampler.generate`'s keys and group ids) at the end of
    the stream; returns their global request ids.

    Raises:
      ValueError: a prompt longer than the prompt bucket, or a ring slot still holding an uncollected request.
    """
    n0 = len(prompts)
    ids = range(self.avail, self.avail + n0 * group_size)
    slots = np.asarray(ids) % self.capacity
    if (self.owner[slots] >= 0).any():
      raise ValueError(
          f"StreamPool.admit: ring slots of requests {ids.start}..{ids.stop - 1} still hold uncollected requests; "
          f"collect them first or build the pool with more than capacity={self.capacity} slots"
      )
    groups = np.repeat(np.asarray(group_ids, np.int64), group_size)
    samples = np.tile(np.arange(group_size, dtype=np.int32), n0)
    with self.sampler.mesh_context():
      base = jax.random.key(seed)
      keys = jax.vmap(lambda g, s: jax.random.fold_in(jax.random.fold_in(base, g), s))(
          groups.astype(np.uint32), samples.astype(np.uint32)
      )
      keys = np.asarray(jax.random.key_data(keys)).astype(np.uint32)
    for j, slot in enumerate(slots):
      prompt = np.asarray(prompts[j // group_size], np.int32)
      if prompt.size > self.p_len:
        raise ValueError(f"prompt {j // group_size} has {prompt.size} tokens > the prompt bucket {self.p_len}")
      self.tokens[slot] = self.core.pad_id
      self.tokens[slot, self.p_len - prompt.size :] = prompt
      self.segs[slot] = 0
      self.segs[slot, self.p_len - prompt.size :] = 1
    self.groups[slots] = groups.astype(np.int32)
    self.group_ids[slots], self.sample_index[slots], self.keys[slots] = groups, samples, keys
    self.owner[slots] = np.asarray(ids)
    self.avail = ids.stop
    return ids

  # ------------------------------------------------------------------------------------------------ decoding
  def segment(self, state, version: int) -> SegmentStats:
    """One segment under the prepared parameters `state` (a `PreparedParams`' state) stamped `version`."""
    requests = (self.tokens, self.segs, self.groups, self.keys)
    with self.sampler.mesh_context():
      self.pool, self.version_map, nxt, stats = self._segment(
          state,
          self.pool,
          self.version_map,
          requests,
          np.int32(self.nxt),  # host values: the same global value on every process
          np.int32(self.avail),
          np.int32(version),
          sampling=self.sampling,
          p_len=self.p_len,
          refill=self.refill,
          every=self.every,
      )
    self.nxt = int(nxt)
    self._update_live()
    return SegmentStats(*(int(x) for x in np.asarray(stats)))

  def _update_live(self) -> None:
    """The live requests from the decode rows' [B] flags (whole on every process: collective when several)."""
    done, req = multihost.to_host((self.pool.done, self.pool.req))
    self._live = {int(self.owner[s]) for s in np.asarray(req)[~np.asarray(done)]}

  def swap(self, state) -> None:
    """The rows that continue run on the prepared parameters `state` from the next segment on; with
    kv="recompute", or after a restore without the KV cache (`cache_missing`), their caches are recomputed under
    `state` now."""
    if (self.kv == "recompute" or self.cache_missing) and self._live:
      with self.sampler.mesh_context():
        self.pool = self._recompute(state, self.pool, (self.tokens, self.segs), p_len=self.p_len)
    self.cache_missing = False

  @property
  def live(self) -> int:
    """Requests being decoded (started, not finished)."""
    return len(self._live)

  def finished(self, ids: Sequence[int]) -> bool:
    """Whether every request of `ids` has been started and has stopped."""
    return all(g < self.nxt and g not in self._live for g in ids)

  def collect(self, ids: Sequence[int], temperature: float, own_rows: bool = False) -> GenerationBatch:
    """The finished requests `ids` as a `GenerationBatch` (prompt-major as admitted, prompts left-padded to the
    smallest prompt bucket that holds them; `token_version` [N, R] the version that drew each token,
    `policy_version` the smallest over all of them) and their slots freed. With `own_rows` in a multi-process run,
    only this process's rows (`multihost.process_rows(N)`: whole groups when the batch's prompts split over the
    processes), read from its own devices (`Sampler.generate(own_rows=True)`). Collective in a multi-process run.

    Raises:
      ValueError: a request of `ids` not finished or not in the ring.
    """
    ids = np.asarray(ids, np.int64)
    slots = ids % self.capacity
    if not self.finished(ids.tolist()) or (self.owner[slots] != ids).any():
      raise ValueError(f"StreamPool.collect: requests {ids.tolist()} are not all finished and uncollected")
    p = self.pool
    out = (p.tokens, p.logp, p.entropy, p.mask, p.stopped, p.kept_logp_threshold)
    devices = None if self.sampler.mesh is None else self.sampler.mesh.devices
    with self.sampler.mesh_context():
      taken, first = self._take(out, self.version_map, slots)
      (tok, logp, ent, mask, stopped, kept, ver), mine = rows_to_host(taken, len(ids), devices, own_rows)
      first = int(first)
      self.pool, self.version_map = self._clear(self.pool, self.version_map, slots, self.core.pad_id)
    self.owner[slots] = -1
    slots = slots[mine]
    # the prompts left-padded to their own bucket, as `Sampler.generate` returns a call of these prompts
    p = bucket(int(self.segs[ids % self.capacity].sum(1).max()), self.sampler.prompt_buckets) or self.p_len
    return GenerationBatch.from_decoded(
        self.tokens[slots, self.p_len - p :].copy(),
        self.segs[slots, self.p_len - p :],
        tok,
        logp,
        ent,
        mask,
        stopped,
        group_ids=self.group_ids[slots].copy(),
        sample_index=self.sample_index[slots].copy(),
        policy_version=first if first != np.iinfo(np.int32).max else -1,
        temperature=self.sampling.logprob_temperature,
        kept_logp_threshold=kept,
        token_version=np.where(mask, ver, -1).astype(np.int32),
    )

  # ------------------------------------------------------------------------------------------------ checkpoints
  def _host_state(self) -> dict[str, np.ndarray]:
    host = {"tokens": self.tokens, "segs": self.segs, "groups": self.groups, "keys": self.keys}
    host.update(group_ids=self.group_ids, sample_index=self.sample_index, owner=self.owner)
    return {**{f"host_{k}": v.copy() for k, v in host.items()}, "counts": np.asarray([self.nxt, self.avail])}

  def _device_tree(self, with_kv: bool) -> tuple:
    """(pool, version_map) as the checkpoint holds them: without the cache's keys and values unless `with_kv`."""
    pool = self.pool if with_kv else self.pool._replace(cache=_without_kv(self.pool.cache))
    return pool, self.version_map

  def _device_leaves(self, with_kv: bool) -> list:
    """The checkpoint's array leaves as the pool keeps them (`_placed`): global arrays, or host values in several
    processes."""
    return jax.tree.leaves(self._device_tree(with_kv))

  def state_dict(self, with_kv: bool = True) -> dict:
    """Everything the pool holds, for a checkpoint (`load_state_dict` restores it): the device arrays (the KV cache
    unless `with_kv` is False, the rows' state) as the pool's own global arrays, which orbax writes shard by shard
    from the process that holds each (nothing is gathered: at the paper's scale the cache is terabytes), and the host
    state (the ring, the same on every process) as numpy."""
    return {**{f"device_{i}": a for i, a in enumerate(self._device_leaves(with_kv))}, **self._host_state()}

  def checkpoint_template(self, with_kv: bool = True) -> dict:
    """The abstract `state_dict(with_kv)` a checkpoint restores into: the device arrays as `jax.ShapeDtypeStruct`s
    on the pool's own shardings (each process reads back only its shards), the host state as numpy of its shapes."""
    dev = {
        f"device_{i}": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array)
        else np.zeros_like(a)  # a host value (several processes, after a whole restore): read back whole
        for i, a in enumerate(self._device_leaves(with_kv))
    }
    return {**dev, **{k: np.zeros_like(v) for k, v in self._host_state().items()}}

  def load_state_dict(self, d: dict, with_kv: bool = True) -> None:
    """Restores `state_dict(with_kv)`: device leaves as global arrays on the pool's shardings
    (`checkpoint_template`), or as numpy read whole (a one-process checkpoint restored without the template).
    Without the KV cache the pool keeps its own keys and values (a new pool's are zeros) and sets `cache_missing`:
    the next `swap` rebuilds every live row's cache under the parameters it is given. Exact (bit for bit) where the
    uninterrupted pool recomputes at that swap too (`kv="recompute"`, the parameters moved); otherwise the rows'
    keys and values become those of the swap's parameters: the ones drawn earlier under an older version (`"keep"`),
    or recomputed in one pass instead of token by token (no version change: equal up to fp32 summation order)."""
    treedef = jax.tree.structure(self._device_tree(with_kv))
    n = treedef.num_leaves
    with self.sampler.mesh_context():
      leaves = [d[f"device_{i}"] for i in range(n)]
      leaves = _placed([a if isinstance(a, jax.Array) else np.asarray(a) for a in leaves])
      pool, self.version_map = jax.tree.unflatten(treedef, leaves)
    if not with_kv:
      pool = pool._replace(cache=KVCache(self.pool.cache.k, self.pool.cache.v, pool.cache.segment_ids))
    self.pool, self.cache_missing = pool, not with_kv
    for k in ("tokens", "segs", "groups", "keys", "group_ids", "sample_index", "owner"):
      setattr(self, k, np.asarray(d[f"host_{k}"]).astype(getattr(self, k).dtype))
    self.nxt, self.avail = (int(x) for x in np.asarray(d["counts"]))
    self._update_live()
