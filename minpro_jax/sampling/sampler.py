"""`Sampler`: batched, KV-cached, jit-compiled generation with explicit parameter versions.

Flow of one `generate` call:
  1. Prompts are expanded to N = len(prompts) * group_size rows, left-padded to the smallest prompt bucket
     P >= longest prompt, and the rows padded to a batch bucket (extra rows start done and are dropped).
  2. The parameter State is converted once to the inference precision (`fp32`, `bf16`, or simulated `fp8`,
     see `minpro_jax.models.quant`), to per-layer arrays (`unstack_layer_params`) and to one fused q/k/v
     matrix per layer (`fuse_qkv_params`) by a small jitted function. The sampler's model runs its
     layers unrolled with a per-layer KV cache (XLA:CPU copies a stacked weight's or cache's slice out of
     the stack inside a loop), and fused q/k/v makes a layer's matmuls per token 5 instead of 7. The copy
     holds one parameter-sized buffer while `generate` runs; `prepare_params` does this step alone and
     returns a `PreparedParams` that later `generate` calls reuse (once per parameter version).
  3. Jitted prefill: the prompts run through the model into a fresh KV cache of P + max_new_tokens slots
     (segment id 1 on real tokens, 0 on pads, so pads are never attended to; RoPE positions count real
     tokens only), and response index 0 is sampled from the last prompt position.
  4. Jitted decode: a `lax.while_loop` feeds one token per row per step (cache slot P + i - 1, position
     len(prompt) + i - 1), samples index i, and exits as soon as every row has stopped. Its carry (KV cache
     and outputs) is donated, and nothing goes back to the host until the loop ends.

Steps 3-4 are the static sampler (`continuous=False`): every row of the call runs until the slowest stops.
The default, `continuous=True`, runs the same requests on a fixed number of decode rows and refills a row
with the next waiting prompt as soon as it stops, with decode attention over the live cache length only
(`minpro_jax.sampling.continuous`); every response is the one the static sampler gives, token for token
(log-probs up to fp32 rounding of the batch's matmuls).

The graphdef is static and the parameters are a traced argument, so new parameter values with the same
shapes, dtypes and shardings never recompile (`Sampler.trace_count` counts traces for tests).

Randomness: row r of prompt group g, sample s gets key_row = fold_in(fold_in(key(seed), g), s) and step i
uses fold_in(key_row, i), so a row's draws do not depend on what else is in the batch.

Behavior log-probs: see `minpro_jax.sampling.methods` (log-softmax at the sampling temperature, T = 1 for
greedy, renormalised over the top-k / top-p set when the sampling truncates, with that set's threshold).
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.inference_layout import fuse_qkv_params, fused_qkv_keeps_sharding, unstack_layer_params
from minpro_jax.models.quant import (
    FP8_FORMATS,
    FP8_WEIGHT_SCALES,
    PRECISIONS,
    act_quant_mode,
    precision_config,
    prepare_inference_params,
)
from minpro_jax.models.rope import rope_tables
from minpro_jax.models.transformer import KVCache, Transformer, keys_head_dim_major
from minpro_jax.runtime.host_batch import process_prompts, rows_to_host
from minpro_jax.runtime.inference_mesh import layout_name, param_shardings, reshard
from minpro_jax.runtime.multihost import settle, to_host
from minpro_jax.runtime.sharding import DEFAULT_RULES, use_mesh
from minpro_jax.sampling import continuous as cb
from minpro_jax.sampling import paged_continuous as pc
from minpro_jax.sampling.batch import FINISH_LENGTH, FINISH_STOP, GenerationBatch
from minpro_jax.sampling.loop import LoopState, decode_loop, init_loop_state, sample_step
from minpro_jax.sampling.methods import SamplingParams
from minpro_jax.sampling.prepared import PreparedParams, param_shapes, signature_diff

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
  i = bisect.bisect_left(buckets, n)
  return buckets[i] if i < len(buckets) else None


class Sampler:
  """Generates responses for token prompts with a `Transformer` of a given config.

  Args:
    model_config: the `ModelConfig` of the policy (the learner's; the sampler derives its own precision).
    precision: "fp32", "bf16" (params and compute in bfloat16) or "fp8" (simulated FP8 weights of every
      dense layer except embedding / LM head, by default e4m3 with a per-tensor scale amax / 448, plus dynamic
      FP8 activations per `fp8_activations`; compute in fp32). Independent of the learner's precision.
    prompt_buckets: increasing prompt lengths P that prompts are left-padded to (one compile per bucket).
    batch_buckets: increasing row counts the batch is padded to; beyond the largest, multiples of it.
    mesh: optional device mesh; prefill/decode then run under `use_mesh(mesh, rules)` so activations and
      the cache follow the logical-axis rules, and `prepare_params` lays the converted parameters out on it by
      `rules` (`minpro_jax.runtime.inference_mesh.reshard`, one layer at a time). The learner's mesh, or the
      sampler's own over the same devices (`inference_mesh.sampler_layout`, `config.sampling.mesh`).
    rules: logical-axis rules for `mesh` (default `DEFAULT_RULES`; `inference_mesh.INFERENCE_RULES` for the
      sampler's own layout: weights split over tensor, replicated over data).
    pad_id: token id used for padding (never attended to or scored).
    fp8_activations: with precision "fp8", how matmul inputs are fake-quantized (dynamic scale): "token" or
      True (one scale per token), "tensor" (one per matmul input of the whole batch), "none" or False.
    fp8_weight_scale: with precision "fp8", the weight scales: "tensor" (per layer and tensor), "channel" (per
      output channel) or "block128" (per 128 x 128 tile; `models.quant.fake_quant_weights`).
    fp8_format: with precision "fp8", "e4m3" (float8_e4m3fn, max 448) or "e5m2" (max 57344), for weights and
      activations.
    fuse_qkv: run attention's q/k/v projections as one matmul (`ModelConfig.fuse_qkv`; the conversion
      happens in `prepare_params`, after the FP8 rounding). Same tokens and log-probs up to the matmul's
      summation order. Ignored (no fusion) on a mesh whose head split does not divide the KV-head count,
      where the fused matrix could not be split like the unfused ones (`fused_qkv_keeps_sharding`);
      `self.config.fuse_qkv` says what runs. False keeps the learner's separate projections.
    continuous: True (default) runs `generate` with continuous batching on at most `decode_rows` rows and
      live-length decode attention; False runs today's static sampler (all rows until the slowest stops,
      attention over the whole cache). Both return the same responses.
    decode_rows: the continuous sampler's number of decode rows (rounded up to a batch bucket, and never
      more than the call's row bucket).
    refill_rows: the continuous sampler refills once this many rows are done (or fewer when fewer prompts
      wait); None: max(1, rows // 8).
    in_loop_refill: True (default, the faster on this project's CPU, benchmarks/README.md): the whole call is
      one jitted `while_loop` whose iterations either prefill refill_rows waiting prompts into done rows or run
      a decode step; False: decode chunks end when refill_rows rows are done and the host refills them (one
      prefill of those rows). Same responses either way.
    logits_processor: optional jit-traceable `f(logits [B, V] float32, response index [B] int32, group id [B]
      int32) -> logits [B, V]` applied to the raw logits before every draw, in both samplers (group id: the
      row's `group_ids` entry cast to int32; 0 on the static sampler's padding rows). The behavior log-probs are those of the processed logits. For scripted stops (benchmarks), like a
      `transformers` LogitsProcessor. Must be hashable (it is a static part of the compiled functions).
    record_routes: MoE only: return the experts every response token was routed to in every layer
      (`GenerationBatch.routes`, for router replay in the learner).
    paged_kv: a `PagedKV` runs the continuous sampler on a paged KV cache (`sampling.paged_continuous`; needs
      continuous and in_loop_refill); None (default): the dense per-row cache.

  Raises:
    ValueError: unknown precision or fp8 option, empty / unsorted buckets, decode_rows or refill_rows < 1, paged_kv
      without continuous and in_loop_refill, record_routes for a dense model.
  """

  def __init__(
      self,
      model_config: ModelConfig,
      *,
      precision: str = "fp32",
      prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
      batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
      mesh: jax.sharding.Mesh | None = None,
      rules=None,
      pad_id: int = 0,
      fp8_activations: bool | str = True,
      fp8_weight_scale: str = "tensor",
      fp8_format: str = "e4m3",
      fuse_qkv: bool = True,
      continuous: bool = True,
      decode_rows: int = 64,
      refill_rows: int | None = None,
      logits_processor=None,
      in_loop_refill: bool = True,
      record_routes: bool = False,
      paged_kv: pc.PagedKV | None = None,
  ):
    if precision not in PRECISIONS:
      raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")
    if fp8_weight_scale not in FP8_WEIGHT_SCALES or fp8_format not in FP8_FORMATS:
      raise ValueError(
          f"fp8_weight_scale={fp8_weight_scale!r}, fp8_format={fp8_format!r}; choose from {FP8_WEIGHT_SCALES} "
          f"and {tuple(FP8_FORMATS)}"
      )
    act_quant_mode(fp8_activations, fp8_format)  # raises on an unknown value
    fp8_act = ("token" if fp8_activations else "none") if isinstance(fp8_activations, bool) else fp8_activations
    for name, b in (("prompt_buckets", prompt_buckets), ("batch_buckets", batch_buckets)):
      b = tuple(b)
      if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
        raise ValueError(f"{name} must be a non-empty strictly increasing tuple of positive ints, got {b}")
    if int(decode_rows) < 1 or (refill_rows is not None and int(refill_rows) < 1):
      raise ValueError(f"decode_rows ({decode_rows}) and refill_rows ({refill_rows}) must be >= 1")
    if record_routes and not model_config.is_moe:
      raise ValueError("record_routes=True needs a MoE model (router replay); this model has no experts")
    if paged_kv is not None and not (continuous and in_loop_refill):
      raise ValueError("paged_kv needs continuous=True and in_loop_refill=True")
    self.record_routes = bool(record_routes)
    self.paged_kv = paged_kv
    self.continuous = bool(continuous)
    self.in_loop_refill = bool(in_loop_refill)
    self.logits_processor = logits_processor
    self.decode_rows = int(decode_rows)
    self.refill_rows = None if refill_rows is None else int(refill_rows)
    self.model_config = model_config
    self.precision = precision
    self.fp8_weight_scale, self.fp8_format = fp8_weight_scale, fp8_format
    # the learner-layout config (what `params` look like after the precision cast) and the sampler's own
    # unrolled, per-layer config (what prefill / decode run)
    self._input_config = precision_config(model_config, precision, fp8_activations=fp8_act, fp8_format=fp8_format)
    # no remat: inference keeps no activations for a backward, and a remat block cannot write the KV cache
    self._per_layer_config = self._input_config.replace(stack_layers=False, scan_layers=False, remat="none")
    fuse = bool(fuse_qkv) and fused_qkv_keeps_sharding(self._input_config, mesh, rules)
    self.config = self._per_layer_config.replace(fuse_qkv=fuse)
    self.prompt_buckets = tuple(prompt_buckets)
    self.batch_buckets = tuple(batch_buckets)
    self.mesh = mesh
    self.rules = rules
    self.pad_id = int(pad_id)
    self._signature = (precision, fp8_act, fp8_weight_scale, fp8_format, fuse, layout_name(mesh, rules), model_config)
    self.trace_count = 0  # incremented each time prefill or decode is traced (tests assert no recompiles)
    with nnx.use_eager_sharding(False):
      abstract_in = nnx.eval_shape(lambda: Transformer(self._input_config, rngs=nnx.Rngs(0)))
      self._graphdef, abstract_out = nnx.split(nnx.eval_shape(lambda: Transformer(self.config, rngs=nnx.Rngs(0))))
    self._abstract_leaves = param_shapes(nnx.split(abstract_in)[1])
    # where `prepare_params` puts every converted parameter ({key path: NamedSharding}; None: one device)
    self.param_shardings = None if mesh is None else param_shardings(abstract_out, mesh, rules or DEFAULT_RULES)
    # the static sampler's jitted parts (public for compile-only tools: `minpro_jax.aot` lowers them)
    self.jitted_prepare = jax.jit(self._prepare_impl)
    self.jitted_prefill = jax.jit(self._prefill_impl, static_argnames=("sampling",))
    self.jitted_decode = jax.jit(self._decode_impl, static_argnames=("sampling", "cache_offset"), donate_argnums=(1,))
    self._c_init = jax.jit(self._c_init_impl, static_argnames=("rows", "num_requests", "slots", "sampling"))
    self._c_refill = jax.jit(self._c_refill_impl, static_argnames=("sampling",), donate_argnums=(1,))
    self._c_all = jax.jit(self._c_all_impl, static_argnames=("sampling", "p_len", "rows", "refill"))
    self._c_decode = jax.jit(self._c_decode_impl, static_argnames=("sampling", "p_len"), donate_argnums=(1,))
    self._c_paged = jax.jit(
        lambda *a, **k: pc.run(self, *a, **k), static_argnames=("sampling", "p_len", "rows", "refill", "unit")
    )

  # ----------------------------------------------------------------------------------------- jitted parts
  def _prepare_impl(self, state):
    state = prepare_inference_params(
        state, self.precision, self._input_config, weight_scale=self.fp8_weight_scale, fmt=self.fp8_format
    )
    if self._input_config.stack_layers:
      state = unstack_layer_params(state, self._input_config)
    return fuse_qkv_params(state, self._per_layer_config) if self.config.fuse_qkv else state

  def _prefill_impl(
      self, state, tokens_bp, segment_bp, row_keys, active_b, row_group=None, *, sampling: SamplingParams
  ):
    self.trace_count += 1
    model = nnx.merge(self._graphdef, state)
    b, p = tokens_bp.shape
    positions = jnp.where(segment_bp > 0, jnp.cumsum(segment_bp, axis=1) - 1, 0).astype(jnp.int32)
    cache = KVCache.zeros(self.config, b, p + sampling.max_new_tokens)
    out = model(tokens_bp, positions, segment_bp, cache=cache, cache_index=0, return_hidden=True)
    logits = model.logits(out.out[:, -1:])[:, 0]
    if self.logits_processor is not None:
      group = jnp.zeros((b,), jnp.int32) if row_group is None else row_group
      logits = self.logits_processor(logits, jnp.zeros((b,), jnp.int32), group)
    carry = (out.cache, positions[:, -1] + 1, jnp.zeros((b,), jnp.int32) if row_group is None else row_group)
    route_shape = (self.config.num_layers, self.config.num_experts_per_tok) if self.record_routes else None
    st = init_loop_state(
        row_keys, active_b, sampling.max_new_tokens, carry, self.pad_id, route_shape, sampling.truncates
    )
    return sample_step(st, logits, sampling, self.pad_id)

  def _decode_impl(self, state, loop_state: LoopState, *, sampling: SamplingParams, cache_offset: int):
    self.trace_count += 1
    model = nnx.merge(self._graphdef, state)

    # cos/sin of every position a row can reach (prompt bucket + max_new_tokens), built once outside the
    # loop; each step gathers its rows (see `rope_tables`)
    cos_s, sin_s = rope_tables(jnp.arange(cache_offset + sampling.max_new_tokens)[None], self.config)

    def step_fn(carry, tokens_b, step):
      cache, next_pos, group = carry
      pos = (next_pos + step - 1)[:, None]
      rope = (cos_s[0][pos], sin_s[0][pos])
      out = model(
          tokens_b[:, None], pos, jnp.ones_like(pos), cache=cache, cache_index=cache_offset + step - 1, rope=rope
      )
      logits = out.out[:, 0]
      if self.logits_processor is not None:
        logits = self.logits_processor(logits, jnp.full(group.shape, step, jnp.int32), group)
      routes = (out.routes[:, 0],) if self.record_routes else ()
      return logits, (out.cache, next_pos, group), *routes

    return decode_loop(step_fn, loop_state, sampling, self.pad_id)

  def _c_init_impl(self, *, rows, num_requests, slots, sampling: SamplingParams):
    r, routes, truncates = sampling.max_new_tokens, self.record_routes, sampling.truncates
    return cb.init_state(self.config, rows, num_requests, slots, r, self.pad_id, routes, truncates)

  def _c_refill_impl(
      self, state, st, tokens_mp, segs_mp, rows_m, reqs_m, groups_m, keys_m, *, sampling: SamplingParams
  ):
    self.trace_count += 1
    model = nnx.merge(self._graphdef, state)

    def prefill(tokens, positions, segs):
      cache = KVCache.zeros(self.config, tokens.shape[0], tokens.shape[1])
      out = model(tokens, positions, segs, cache=cache, cache_index=0, return_hidden=True)
      return model.logits(out.out[:, -1:])[:, 0], out.cache

    hd_major = keys_head_dim_major(self.config.jnp_dtype)
    return cb.refill(
        st,
        prefill,
        tokens_mp,
        segs_mp,
        rows_m,
        reqs_m,
        groups_m,
        keys_m,
        sampling,
        self.pad_id,
        hd_major,
        self.logits_processor,
    )

  def _c_step_fn(self, model, num_positions: int):
    """The continuous decode step: one token per row at its own cache slot and position, attending to the live
    length of the cache; RoPE tables are built once for every position a row can reach."""
    cos_s, sin_s = rope_tables(jnp.arange(num_positions)[None], self.config)

    def step_fn(cache, tokens_b, slot_b, pos_b, live_len):
      pos = pos_b[:, None]
      rope = (cos_s[0][pos], sin_s[0][pos])
      out = model(
          tokens_b[:, None], pos, jnp.ones_like(pos), cache=cache, cache_index=slot_b, rope=rope, live_len=live_len
      )
      return out.out[:, 0], out.cache, *((out.routes[:, 0],) if self.record_routes else ())

    return step_fn

  def _c_decode_impl(self, state, st, need, *, sampling: SamplingParams, p_len: int):
    self.trace_count += 1
    model = nnx.merge(self._graphdef, state)
    step_fn = self._c_step_fn(model, p_len + sampling.max_new_tokens)

    return cb.decode_until(st, step_fn, need, sampling, self.pad_id, p_len, self.logits_processor)

  def _c_all_impl(self, state, requests, *, sampling: SamplingParams, p_len: int, rows: int, refill: int):
    self.trace_count += 1
    model = nnx.merge(self._graphdef, state)
    n = requests[0].shape[0]
    slots = p_len + sampling.max_new_tokens
    routes, truncates = self.record_routes, sampling.truncates
    st = cb.init_state(self.config, rows, n, slots, sampling.max_new_tokens, self.pad_id, routes, truncates)
    step_fn = self._c_step_fn(model, p_len + sampling.max_new_tokens)

    def prefill(tokens, positions, segs):
      cache = KVCache.zeros(self.config, tokens.shape[0], tokens.shape[1])
      out = model(tokens, positions, segs, cache=cache, cache_index=0, return_hidden=True)
      return model.logits(out.out[:, -1:])[:, 0], out.cache

    hd_major = keys_head_dim_major(self.config.jnp_dtype)
    st = cb.decode_with_refills(
        st, step_fn, prefill, requests, refill, sampling, self.pad_id, p_len, hd_major, self.logits_processor
    )
    return st.outputs()

  def _generate_continuous(self, state, tokens, segs, row_keys, row_group, n, sampling: SamplingParams, group_size=1):
    """The continuous-batching decode of the N request rows `tokens` / `segs` [N, P] -> outputs [N, R]."""
    p_len = tokens.shape[1]
    rows, refill_at = self.continuous_rows(n)
    keys = (
        np.asarray(jax.random.key_data(row_keys))
        if jnp.issubdtype(row_keys.dtype, jax.dtypes.prng_key)
        else np.asarray(row_keys)
    )
    keys = keys.astype(np.uint32)
    if self.paged_kv is not None:
      return pc.generate(self, state, tokens, segs, row_group, keys, n, sampling, group_size)
    if self.in_loop_refill:
      requests = (tokens, segs, row_group.astype(np.int32), keys)
      return self._c_all(state, requests, sampling=sampling, p_len=p_len, rows=rows, refill=refill_at)
    st = settle(self._c_init(rows=rows, num_requests=n, slots=p_len + sampling.max_new_tokens, sampling=sampling))
    done = np.ones(rows, bool)
    nxt = 0  # next waiting request
    while True:
      free = np.flatnonzero(done)[: n - nxt]
      if free.size:
        m = min(_bucket(free.size, self.batch_buckets) or rows, rows)
        take = np.arange(nxt, nxt + free.size)
        pad = m - free.size
        at = np.concatenate([free, np.full(pad, rows)]).astype(np.int32)
        reqs = np.concatenate([take, np.full(pad, n)]).astype(np.int32)
        src = np.concatenate([take, np.full(pad, take[-1])])
        groups = row_group[src].astype(np.int32)
        st = settle(self._c_refill(state, st, tokens[src], segs[src], at, reqs, groups, keys[src], sampling=sampling))
        nxt += free.size
      waiting = n - nxt
      need = min(refill_at, waiting) if waiting else rows + 1
      st = self._c_decode(state, st, np.int32(need), sampling=sampling, p_len=p_len)
      done = to_host(st.done)
      if not waiting and done.all():
        break
    return st.outputs()

  def continuous_rows(self, num_requests: int) -> tuple[int, int]:
    """(decode rows, rows per refill) the continuous sampler runs a call of `num_requests` rows on: `decode_rows`
    rounded up to a batch bucket but never more than the call's own bucket, and `refill_rows` (default rows // 8)
    capped at the rows."""
    n = int(num_requests)
    rows = min(_bucket(self.decode_rows, self.batch_buckets) or self.decode_rows, _bucket(n, self.batch_buckets) or n)
    return rows, min(self.refill_rows or max(1, rows // 8), rows)

  # ------------------------------------------------------------------------------------------- host side
  def mesh_context(self):
    """The context prefill / decode run in: `use_mesh(mesh, rules)`, or nothing without a mesh."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return use_mesh(self.mesh, self.rules or DEFAULT_RULES)

  def _check_state(self, state):
    got = param_shapes(state)
    if got == self._abstract_leaves:
      return
    if len(got) != len(self._abstract_leaves):
      detail = f"{len(got)} parameter arrays, the config's model has {len(self._abstract_leaves)}"
    else:
      (path, shape), (_, want) = next((g, w) for g, w in zip(got, self._abstract_leaves) if g != w)
      detail = f"parameter {path} has shape {shape}, the config's model expects {want}"
    raise ValueError(
        f"params do not match model_config: {detail}; build the Sampler with the ModelConfig "
        "of the model whose parameters you pass"
    )

  def prepare_params(self, params) -> PreparedParams:
    """Converts policy parameters once for this sampler (precision cast, per-layer layout, the sampler's mesh).

    Args:
      params: an `nnx.State` of the policy (the learner's layout and dtype) or a `Transformer`; a
        `PreparedParams` of this sampler is returned unchanged.

    Returns:
      A `PreparedParams` that `generate` accepts without converting again.

    Raises:
      ValueError: params that do not fit the sampler's `ModelConfig` (names the first mismatching parameter),
        or a `PreparedParams` made by a sampler with another precision or config.
    """
    if isinstance(params, PreparedParams):
      if params.signature != self._signature:
        diff = signature_diff(params.signature, self._signature)
        raise ValueError(
            f"params were prepared by a Sampler with another {diff}; call prepare_params of this "
            "Sampler on the raw parameters"
        )
      return params
    state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
    self._check_state(state)
    if self.param_shardings is None:
      return PreparedParams(settle(self.jitted_prepare(state)), self._signature)
    return PreparedParams(reshard(self.jitted_prepare(state), self.param_shardings), self._signature)

  def generate(
      self,
      params,
      prompts: Sequence[Sequence[int]],
      sampling: SamplingParams,
      seed: int | jax.Array = 0,
      *,
      group_size: int = 1,
      group_ids: Sequence[int] | None = None,
      policy_version: int | None = None,
      own_rows: bool = False,
  ) -> GenerationBatch:
    """Samples `group_size` responses for every prompt.

    Args:
      params: an `nnx.State` of the policy parameters (from `nnx.split(model)`), a `Transformer`, or the
        `PreparedParams` of `prepare_params` (converted once, reused across calls).
      prompts: list of N0 non-empty token-id lists (ints in [0, vocab_size)).
      sampling: `SamplingParams`.
      seed: int seed or a PRNG key.
      group_size: G >= 1 samples per prompt; rows are ordered prompt-major (prompt0 x G, prompt1 x G, ...).
      group_ids: N0 ints, one per prompt (default 0..N0-1); every sample of a prompt carries it.
      policy_version: optional int, the version (number of optimizer updates) of the params, stamped on
        the batch (None: -1 = unversioned).
      own_rows: in a multi-process run, return only this process's rows (whole groups, prompts
        `host_batch.process_prompts(N0)`), read from its own devices (`host_batch.rows_to_host`) instead of
        all-gathered; every process passes the same prompts. The same batch as False in one process.

    Returns:
      A `GenerationBatch` of N0 * G rows (with `own_rows`, this process's N0 * G / processes rows).

    Raises:
      ValueError: empty prompt list or prompt, token ids outside the vocabulary, a prompt longer than the
        largest prompt bucket, bad group_size / group_ids / sampling, params that do not fit the config.
    """
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    version = -1 if policy_version is None else int(policy_version)
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
      raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    prompts = self._check_prompts(prompts)
    n0 = len(prompts)
    if own_rows:
      process_prompts(n0)  # raises unless the prompts split into whole groups over the processes
    if group_ids is None:
      group_ids = np.arange(n0, dtype=np.int64)
    else:
      group_ids = np.asarray(group_ids)
      if group_ids.shape != (n0,) or not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"group_ids must be {n0} ints (one per prompt), got {group_ids!r}")
      group_ids = group_ids.astype(np.int64)

    n = n0 * group_size
    lens = np.repeat([len(p) for p in prompts], group_size)
    p_len = _bucket(int(lens.max()), self.prompt_buckets)
    rows = _bucket(n, self.batch_buckets) or -(-n // self.batch_buckets[-1]) * self.batch_buckets[-1]
    tokens = np.full((rows, p_len), self.pad_id, np.int32)
    segs = np.zeros((rows, p_len), np.int32)
    for r in range(rows):
      prompt = prompts[min(r, n - 1) // group_size]  # padding rows copy the last row (then are dropped)
      tokens[r, p_len - len(prompt) :] = prompt
      segs[r, p_len - len(prompt) :] = 1
    row_group = np.repeat(group_ids, group_size)
    row_sample = np.tile(np.arange(group_size, dtype=np.int32), n0)
    pad_rows = rows - n
    g_all = np.concatenate([row_group, np.zeros(pad_rows, np.int64)]).astype(np.uint32)
    s_all = np.concatenate([row_sample, np.zeros(pad_rows, np.int32)]).astype(np.uint32)
    active = np.arange(rows) < n

    state = self.prepare_params(params).state
    with self.mesh_context():  # the keys too: a caller's mesh (the learner's, on other devices) must not hold them
      if isinstance(seed, (int, np.integer)):
        base = jax.random.key(seed)
      else:  # a key array, wherever it lives
        base = jax.random.wrap_key_data(np.asarray(jax.random.key_data(seed)), impl=jax.random.key_impl(seed))
      row_keys = jax.vmap(lambda g, s: jax.random.fold_in(jax.random.fold_in(base, g), s))(g_all, s_all)
      if self.continuous:
        out = self._generate_continuous(state, tokens[:n], segs[:n], row_keys[:n], row_group, n, sampling, group_size)
      else:
        st = settle(
            self.jitted_prefill(state, tokens, segs, row_keys, active, g_all.astype(np.int32), sampling=sampling)
        )
        out = self.jitted_decode(state, st, sampling=sampling, cache_offset=p_len).outputs()
      devices = None if self.mesh is None else self.mesh.devices
      (tok, logp, ent, mask, stopped, routes, kept), mine = rows_to_host(out, n, devices, own_rows)
    return GenerationBatch(
        prompt_tokens=tokens[mine],
        prompt_mask=segs[mine].astype(bool),
        response_tokens=tok,
        response_mask=mask,
        behavior_logp=logp,
        entropy=ent,
        lengths=mask.sum(-1).astype(np.int32),
        finish_reason=np.where(stopped, FINISH_STOP, FINISH_LENGTH),
        group_ids=row_group[mine],
        sample_index=row_sample[mine],
        policy_version=version,
        temperature=sampling.logprob_temperature,
        routes=routes,
        kept_logp_threshold=kept,
    )

  def _check_prompts(self, prompts) -> list[list[int]]:
    if prompts is None or len(prompts) == 0:
      raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    v = self.config.vocab_size
    max_p = self.prompt_buckets[-1]
    for i, p in enumerate(prompts):
      arr = np.asarray(p)
      if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {arr.shape}")
      if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prompts[{i}] must hold int token ids, got dtype {arr.dtype}")
      if arr.min() < 0 or arr.max() >= v:
        raise ValueError(f"prompts[{i}] has token ids outside [0, vocab_size={v})")
      if arr.size > max_p:
        raise ValueError(
            f"prompts[{i}] has length {arr.size} > the largest prompt bucket {max_p} (cache "
            "size); truncate the prompt or add a larger bucket to Sampler(prompt_buckets=...)"
        )
      out.append(arr.astype(np.int32).tolist())
    return out
