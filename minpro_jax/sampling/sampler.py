"""`Sampler`: the front of batched, KV-cached, jit-compiled generation with explicit parameter versions.

Flow of one `generate` call:
  1. Prompts are expanded to N = len(prompts) * group_size requests, left-padded to the smallest prompt bucket
     P >= longest prompt, and the rows padded to a batch bucket (extra rows start done and are dropped).
  2. The parameter State is converted once to the inference precision (`fp32`, `bf16`, or simulated `fp8`,
     see `minpro_jax.models.quant`), to per-layer arrays (`unstack_layer_params`) and to one fused q/k/v
     matrix per layer (`fuse_qkv_params`) by a small jitted function. The sampler's model runs its
     layers unrolled with a per-layer KV cache (XLA:CPU copies a stacked weight's or cache's slice out of
     the stack inside a loop), and fused q/k/v makes a layer's matmuls per token 5 instead of 7. The copy
     holds one parameter-sized buffer while `generate` runs; `prepare_params` does this step alone and
     returns a `PreparedParams` that later `generate` calls reuse (once per parameter version).
  3. The sampler's engine decodes the requests (`minpro_jax.sampling.engines`, one module per strategy):
     `static` (prefill, then every row until the slowest stops), `continuous` (the default: a fixed number of
     decode rows refilled as rows stop, attention over the live length, one jitted loop), `host_refill` (the same,
     refilled from the host) or `paged` (the continuous loop on a paged KV cache). Every engine gives every
     request the same tokens (log-probs up to fp32 rounding of the batch's matmuls).
  4. The outputs come back to the host as a `GenerationBatch` (in a multi-process run, each process its rows).

The graphdef is static and the parameters are a traced argument, so new parameter values with the same
shapes, dtypes and shardings never recompile (`Sampler.trace_count` counts the engine's traces for tests).

Randomness: row r of prompt group g, sample s gets key_row = fold_in(fold_in(key(seed), g), s) and step i
uses fold_in(key_row, i), so a row's draws do not depend on what else is in the batch.

Behavior log-probs: see `minpro_jax.sampling.methods` (log-softmax at the sampling temperature, T = 1 for
greedy, renormalised over the top-k / top-p set when the sampling truncates, with that set's threshold).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
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
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.inference_mesh import layout_name, param_shardings, reshard
from minpro_jax.runtime.multihost import settle
from minpro_jax.runtime.row_layout import process_prompts, rows_to_host
from minpro_jax.runtime.sharding import DEFAULT_RULES, use_mesh
from minpro_jax.sampling.batch import GenerationBatch
from minpro_jax.sampling.engines import Requests, SamplerCore, engine_options
from minpro_jax.sampling.engines.base import bucket
from minpro_jax.sampling.methods import SamplingParams
from minpro_jax.sampling.prepared import PreparedParams, param_shapes, signature_diff

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


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
    engine: the decoding strategy (`minpro_jax.sampling.engines`): a registered name ("continuous", the default;
      "static", "host_refill", "paged") for its default options, or an options instance, e.g.
      `engines.Continuous(decode_rows=64, refill_rows=8)`, `engines.Paged(kv=PagedKV(page_size=64))`. Every
      engine returns the same responses.
    logits_processor: optional jit-traceable `f(logits [B, V] float32, response index [B] int32, group id [B]
      int32) -> logits [B, V]` applied to the raw logits before every draw, in every engine (group id: the
      row's `group_ids` entry cast to int32; 0 on the static sampler's padding rows). The behavior log-probs are those of the processed logits. For scripted stops (benchmarks), like a
      `transformers` LogitsProcessor. Must be hashable (it is a static part of the compiled functions).
    record_routes: MoE only: return the experts every response token was routed to in every layer
      (`GenerationBatch.routes`, for router replay in the learner).

  Attributes:
    engine: the `Engine` that decodes (built from the options with this sampler's `SamplerCore`).
    config: the sampler's own per-layer inference `ModelConfig`.

  Raises:
    ValueError: unknown precision or fp8 option, empty / unsorted buckets, an unknown engine or bad engine options,
      record_routes for a dense model.
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
      engine="continuous",
      logits_processor=None,
      record_routes: bool = False,
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
    options = engine_options(engine)
    if record_routes and not model_config.is_moe:
      raise ValueError("record_routes=True needs a MoE model (router replay); this model has no experts")
    self.record_routes = bool(record_routes)
    self.logits_processor = logits_processor
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
    with nnx.use_eager_sharding(False):
      abstract_in = nnx.eval_shape(lambda: Transformer(self._input_config, rngs=nnx.Rngs(0)))
      self._graphdef, abstract_out = nnx.split(nnx.eval_shape(lambda: Transformer(self.config, rngs=nnx.Rngs(0))))
    self._abstract_leaves = param_shapes(nnx.split(abstract_in)[1])
    # where `prepare_params` puts every converted parameter ({key path: NamedSharding}; None: one device)
    self.param_shardings = None if mesh is None else param_shardings(abstract_out, mesh, rules or DEFAULT_RULES)
    # the parameter conversion (public for compile-only tools: `minpro_jax.aot` lowers it)
    self.jitted_prepare = jax.jit(self.prepare_fn)
    core = SamplerCore(
        config=self.config,
        graphdef=self._graphdef,
        pad_id=self.pad_id,
        batch_buckets=self.batch_buckets,
        logits_processor=logits_processor,
        record_routes=self.record_routes,
        mesh=mesh,
        rules=rules,
    )
    self.engine = options.make(core)

  @property
  def trace_count(self) -> int:
    """How often the engine's programs were traced (tests assert that new parameters never retrace)."""
    return self.engine.trace_count

  # ----------------------------------------------------------------------------------------- jitted parts
  def prepare_fn(self, state):
    """The parameter conversion of `prepare_params`, traceable: the precision cast, the per-layer layout and the
    fused q/k/v (an `nnx.State` in the learner's layout -> the sampler's)."""
    state = prepare_inference_params(
        state, self.precision, self._input_config, weight_scale=self.fp8_weight_scale, fmt=self.fp8_format
    )
    if self._input_config.stack_layers:
      state = unstack_layer_params(state, self._input_config)
    return fuse_qkv_params(state, self._per_layer_config) if self.config.fuse_qkv else state

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
        `row_layout.process_prompts(N0)`), read from its own devices (`row_layout.rows_to_host`) instead of
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
    p_len = bucket(int(lens.max()), self.prompt_buckets)
    rows = bucket(n, self.batch_buckets) or -(-n // self.batch_buckets[-1]) * self.batch_buckets[-1]
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

    state = self.prepare_params(params).state
    with self.mesh_context():  # the keys too: a caller's mesh (the learner's, on other devices) must not hold them
      if isinstance(seed, (int, np.integer)):
        base = jax.random.key(seed)
      else:  # a key array, wherever it lives
        base = jax.random.wrap_key_data(np.asarray(jax.random.key_data(seed)), impl=jax.random.key_impl(seed))
      row_keys = jax.vmap(lambda g, s: jax.random.fold_in(jax.random.fold_in(base, g), s))(g_all, s_all)
      requests = Requests(tokens, segs, row_keys, g_all.astype(np.int32), n, group_size)
      out = self.engine.run(state, requests, sampling)
      devices = None if self.mesh is None else self.mesh.devices
      (tok, logp, ent, mask, stopped, routes, kept), mine = rows_to_host(out, n, devices, own_rows)
    return GenerationBatch.from_decoded(
        tokens[mine],
        segs[mine],
        tok,
        logp,
        ent,
        mask,
        stopped,
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
