"""The run's device programs, lowered on abstract values at a config's real shapes (nothing is allocated).

  update   one learner update (`Learner.update`): micro-batch accumulation over a mini-batch of M rows, the
           configured loss, AdamW; the `TrainState` donated, as the trainer runs it.
  score    the learner's teacher-forced log-probs of a whole step's N rollouts (`Learner.score`).
  prefill  the sampler's prompt pass with its KV cache (the static sampler's `_prefill`).
  decode   the sampler's decode loop to `max_new_tokens` (its `_decode`, the cache donated).
  sample   the sampler call the trainer makes for one step (`sampling.continuous=True`, not compiled by default):
           the continuous sampler's whole call on its decode rows, with the dense cache or, with
           `sampling.kv_cache="paged"`, the page pool (`lower_continuous`).

Shapes follow the trainer: N = prompts_per_step * group_size rollouts of L = data.max_prompt_tokens +
sampling.max_new_tokens tokens, mini-batches of M = N / num_updates_per_step rows in micro-batches of
`learner_micro_batch(c)`; the sampler's rows are N rounded up to a batch bucket (the trainer samples a step in
one `generate` call) unless `sampler_rows` says otherwise. Batch inputs are replicated on the mesh, because the
trainer passes host arrays; the model's activations are sharded inside by the logical-axis rules.

The model's architecture is the config's: a scratch preset (vocabulary `tokenizer.vocab_size` for a trained
sentencepiece tokenizer), a Hugging Face folder's config.json, or a GGUF file's metadata; a `model.source=hf` whose
folder is absent uses `model.preset` (the paper configs name theirs), so no weights are needed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.aot.abstract import abstract_params
from minpro_jax.aot.packed import static_rows
from minpro_jax.errors import ConfigError
from minpro_jax.models.config import PRESETS, ModelConfig, get_preset
from minpro_jax.rl import packing
from minpro_jax.rl.learner import Learner, ScoreInputs, TrainState, UpdateInputs
from minpro_jax.run import run_config, sampler_setup
from minpro_jax.run.sampler_setup import decode_rows, paged_kernel
from minpro_jax.runtime.inference_mesh import sampler_layout
from minpro_jax.runtime.sharding import use_mesh
from minpro_jax.sampling.rows import tree_bytes_per_device
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS, Sampler

PROGRAMS = ("update", "score", "prefill", "decode", "sample")
DEFAULT_PROGRAMS = ("update", "score", "prefill", "decode")
STOP_ID = 2  # a placeholder stop id: which id stops a row does not change any shape or buffer


@dataclasses.dataclass(frozen=True)
class RunShapes:
  """The shapes one global step runs at (see the module docstring)."""

  rollouts: int  # N
  mini_batch: int  # M
  micro_batch: int
  prompt_len: int  # P
  response_len: int  # R
  sampler_rows: int

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.response_len


def run_shapes(c, sampler_rows: int | None = None) -> RunShapes:
  """The `RunShapes` of config `c`; `sampler_rows` overrides the sampler's row count.

  Raises:
    ConfigError: sampler_rows < 1 (naming `--sampler-rows`).
  """
  n = c.prompts_per_step * c.group_size
  if sampler_rows is None:
    top = DEFAULT_BATCH_BUCKETS[-1]  # what `Sampler.generate` pads a call of n rows to
    sampler_rows = next((b for b in DEFAULT_BATCH_BUCKETS if b >= n), -(-n // top) * top)
  if sampler_rows < 1:
    raise ConfigError(f"--sampler-rows={sampler_rows}: must be >= 1")
  return RunShapes(
      rollouts=n,
      mini_batch=n // c.num_updates_per_step,
      micro_batch=run_config.learner_micro_batch(c),
      prompt_len=c.data.max_prompt_tokens,
      response_len=c.sampling.max_new_tokens,
      sampler_rows=int(sampler_rows),
  )


def model_config(c) -> tuple[ModelConfig, str]:
  """(the `ModelConfig` config `c` trains, where its architecture came from).

  Raises:
    ConfigError: a checkpoint path that is absent with no preset to fall back on, naming `config.model.path`.
    FileFormatError: a config.json or GGUF file that does not parse.
  """
  overrides = run_config.model_overrides(c)
  m = c.model
  if m.source == "hf":
    if os.path.isfile(os.path.join(m.path, "config.json")):
      return run_config.hf_model_config(m.path).replace(**overrides), f"{m.path}/config.json"
    if m.preset == "tiny" or m.preset not in PRESETS:
      raise ConfigError(
          f"config.model.path: {m.path!r} has no config.json; point it at a Hugging Face folder, or set "
          f"--config.model.preset to one of {sorted(PRESETS)} to compile that architecture"
      )
    return get_preset(m.preset, **overrides), f"preset {m.preset} ({m.path}/config.json not found)"
  if m.source == "gguf":
    # the loader of the config's model source, only for that source (a GGUF file, a trained tokenizer)
    from minpro_jax.models.gguf_io import gguf_config
    from minpro_jax.run.run_setup import smollm2_gguf_path

    path = m.path or smollm2_gguf_path()
    return gguf_config(path, **overrides), path
  vocab = c.tokenizer.vocab_size if c.tokenizer.kind == "train_spm" else _tokenizer_vocab(c)
  return get_preset(m.preset, vocab_size=vocab, **dict(m.overrides), **overrides), f"preset {m.preset}"


def _tokenizer_vocab(c) -> int:
  # the loader of the config's model source, only for that source (a GGUF file, a trained tokenizer)
  from minpro_jax.run.run_setup import build_tokenizer

  return build_tokenizer(c, []).vocab_size


def check_mesh_fits_model(mesh_shape: dict[str, int], cfg: ModelConfig) -> None:
  """The head and expert splits a mesh implies must divide the model's.

  Raises:
    ConfigError: naming `--mesh`, the axis and the model's count.
  """
  t, e = mesh_shape.get("tensor", 1), mesh_shape.get("expert", 1)
  for what, count, size, axis in (
      ("attention heads", cfg.num_heads, t, "tensor"),
      ("KV heads", cfg.num_kv_heads, t, "tensor"),
      ("experts", cfg.num_experts or e, e, "expert"),
  ):
    if count % size:
      raise ConfigError(
          f"--mesh: {axis}={size} does not divide the model's {count} {what}; choose a divisor of {count}"
      )


class Lowered(NamedTuple):
  """A program ready to compile: `lower()` returns a `jax.stages.Lowered` (lowering is lazy, so the caller can
  time it); `shapes` describes its main input."""

  name: str
  lower: Callable[[], Any]
  shapes: str


def _replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def _on(abstract, shardings: dict[str, NamedSharding]) -> Any:
  """`abstract` (a tree of ShapeDtypeStructs) with each leaf moved to the sharding `shardings` names for its key path
  (`Sampler.param_shardings`); a leaf already laid out so keeps its own."""

  def place(path, x):
    s = shardings[jax.tree_util.keystr(path)]
    return x if x.sharding.is_equivalent_to(s, len(x.shape)) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

  return jax.tree_util.tree_map_with_path(place, abstract)


def _with_shardings(lowered, compiled) -> Any:
  """The abstract outputs of a compiled program: shapes of `lowered`, shardings of `compiled`."""
  return jax.tree.map(
      lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
      lowered.out_info,
      compiled.output_shardings,
  )


class RunPrograms:
  """Builds the run's programs for one model config on one mesh (the learner and sampler the trainer would).

  Args:
    c: the run config (`configs/default.py` layout), validated by the caller.
    cfg: its `ModelConfig` (`model_config(c)`, with any remat override applied).
    mesh: the mesh to compile for (its devices may be abstract TPU devices).
    shapes: `run_shapes(c)`.
    hbm_bytes: one device's HBM (the slice's chip figure) for `sampling.decode_rows="auto"`, which then counts the
      learner's `TrainState` as resident (`minpro_jax.sampling.rows`); None or 0 (CPU): "auto" is 64 rows.
    sampler_only: the mesh is the sampler's own devices of a split (`minpro_jax.aot.split_step`): its layout spans
      them with no learner state beside it, as the trainer's sampler with `config.sampling.devices`.

  Raises:
    ConfigError: `config.sampling.devices` set: the programs of a device split are not compiled yet.
  """

  def __init__(
      self, c, cfg: ModelConfig, mesh, shapes: RunShapes, hbm_bytes: float | None = None, sampler_only: bool = False
  ):
    if c.sampling.devices:  # not the shared-device programs, silently
      raise ConfigError(
          f"--config.sampling.devices={c.sampling.devices}: the compile-only tool compiles the programs of sampler and "
          "learner sharing every device only; drop the override, or cost the split with `python -m minpro_jax.aot "
          "--budget` (each side on its own chips: docs/aot.md, the overlapped step)"
      )
    self.c, self.cfg, self.mesh, self.shapes = c, cfg, mesh, shapes
    self.replay = bool(c.loss.router_replay)
    self.record_routes = bool(c.loss.router_replay or c.sampling.record_routes) and cfg.is_moe
    self.rules = run_config.learner_rules(c)  # the learner's logical-axis rules (config.mesh.rules)
    graphdef, self.params = abstract_params(cfg, mesh, self.rules)
    self.learner = Learner(
        nnx.merge(graphdef, self.params),
        run_config.loss_config(c),
        run_config.optimizer_config(c),
        micro_batch_size=shapes.micro_batch,
        mesh=mesh,
        row_tokens=packing.row_tokens(c),
    )
    # the learner's rows: one sample each, or with learner.row_tokens the packed rows (`minpro_jax.aot.packed`)
    packed = static_rows(c, shapes)
    self.update_rows, self.score_rows, self.learner_width = packed or (
        shapes.mini_batch,
        shapes.rollouts,
        shapes.seq_len,
    )
    self.sampling = sampler_setup.sampling_params(c, (STOP_ID,))
    # the trainer's sampler layout: the learner's mesh, or the sampler's own (config.sampling.mesh)
    own = list(mesh.devices.flat) if sampler_only else None
    smesh, srules = sampler_layout(c.sampling.mesh, mesh, cfg, own)
    srules = sampler_setup.sampler_rules_of(c, srules)
    self.sampler = Sampler(
        cfg,
        precision=c.sampling.precision,
        **sampler_setup.sampler_fp8_options(c),
        prompt_buckets=(shapes.prompt_len,),
        batch_buckets=(shapes.sampler_rows,),
        mesh=smesh,
        rules=srules,
        engine="static",
        record_routes=self.record_routes,
    )
    # the sampler the trainer builds: its engine (`sampler_setup.engine_options`), KV cache and decode rows
    rows, paged_kv = sampler_setup.sampler_decode_rows(c), paged_kernel(sampler_setup.sampler_paged_kv(c), cfg)
    resident = tree_bytes_per_device(self.train_state()) if rows == "auto" and hbm_bytes and not sampler_only else 0
    self.decode_rows = decode_rows(c, cfg, paged_kv=paged_kv, prompt_len=shapes.prompt_len, mesh=smesh,
                                   rules=srules, hbm_bytes=hbm_bytes, other_resident_bytes=resident)  # fmt: skip
    self.trainer_sampler = Sampler(
        cfg,
        precision=c.sampling.precision,
        **sampler_setup.sampler_fp8_options(c),
        prompt_buckets=(shapes.prompt_len,),
        mesh=smesh,
        rules=srules,
        engine=sampler_setup.engine_options(c, paged_kv, self.decode_rows),
        record_routes=self.record_routes,
    )
    self._prepared = None
    self._prefill_out = None

  def programs(self, names=DEFAULT_PROGRAMS) -> list[Lowered]:
    s, rows = self.shapes, self.trainer_sampler.engine.decode_rows(self.shapes.rollouts)
    kv = "paged KV" if self.trainer_sampler.engine.name == "paged" else "dense KV"
    table = {
        "update": Lowered(
            "update", self._lower_update, f"{self.update_rows}x{self.learner_width} (micro-batch {s.micro_batch})"
        ),
        "score": Lowered(
            "score", self._lower_score, f"{self.score_rows}x{self.learner_width} (micro-batch {s.micro_batch})"
        ),
        "prefill": Lowered("prefill", self._lower_prefill, f"{s.sampler_rows}x{s.prompt_len}"),
        "decode": Lowered("decode", self._lower_decode, f"{s.sampler_rows}x{s.response_len} steps"),
        "sample": Lowered(
            "sample", lambda: self.lower_continuous(s.rollouts), f"{s.rollouts} requests on {rows} rows, {kv}"
        ),
    }
    return [table[n] for n in names]

  def remember(self, name: str, lowered, compiled) -> None:
    """Keeps what a compiled program tells later ones: the prefill's output layout is the decode's input."""
    if name == "prefill":
      self._prefill_out = _with_shardings(lowered, compiled)

  # ------------------------------------------------------------------------------------------ learner
  def _rows(self, n: int) -> dict[str, Any]:
    """Abstract `UpdateInputs` fields of n rows of the learner's width (replicated, as the trainer passes host
    arrays)."""
    shape, m = (n, self.learner_width), self.mesh
    out = {
        "tokens": _replicated(m, shape, jnp.int32),
        "segment_ids": _replicated(m, shape, jnp.int32),
        "positions": _replicated(m, shape, jnp.int32),
        "response_mask": _replicated(m, shape, jnp.bool_),
        "behavior_logp": _replicated(m, shape, jnp.float32),
        "learner_logp": _replicated(m, shape, jnp.float32),
        # packed, per token (`packing.pack`); else per sample
        "advantages": _replicated(m, shape if self.learner.row_tokens else (n,), jnp.float32),
        "routes": None,
        # truncated sampling: the learner renormalises over the sampler's kept sets (`models.logprobs`)
        "kept_logp_threshold": _replicated(m, shape, jnp.float32) if self.sampling.truncates else None,
    }
    if self.replay:
      out["routes"] = _replicated(m, (*shape, self.cfg.num_layers, self.cfg.num_experts_per_tok), jnp.int16)
    return out

  def train_state(self) -> TrainState:
    """The abstract `TrainState`: each optimizer leaf that mirrors a parameter (AdamW's moments) sharded like it,
    as the trainer's eager `optimizer.init` on sharded parameters leaves them; other leaves replicated."""
    by_path = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(self.params)[0]}
    replicated = NamedSharding(self.mesh, P())

    def place(path, x):
      key = jax.tree_util.keystr(path)
      twin = max((k for k in by_path if key.endswith(k)), key=len, default=None)
      same = twin is not None and by_path[twin].shape == x.shape
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_path[twin].sharding if same else replicated)

    opt_state = jax.tree_util.tree_map_with_path(place, jax.eval_shape(self.learner.optimizer.init, self.params))
    scalar = _replicated(self.mesh, (), jnp.int32)
    return TrainState(params=self.params, opt_state=opt_state, step=scalar, skipped=scalar)

  def _lower_update(self):
    state = self.train_state()
    inputs = UpdateInputs(**self._rows(self.update_rows))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    with use_mesh(self.mesh, self.rules):
      lr_scale = _replicated(self.mesh, (), jnp.float32)
      mb = min(self.shapes.micro_batch, self.update_rows)
      # the previous update's float32 gradient (the gradient-cosine metric), sharded like the parameters
      grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), state.params)
      return self.learner.jitted_update(shardings).lower(state, inputs, mb, lr_scale, grads)

  def _lower_score(self):
    rows = self._rows(self.score_rows)
    inputs = ScoreInputs(*(rows[f] for f in ScoreInputs._fields))
    mb = min(self.shapes.micro_batch, self.score_rows)
    with use_mesh(self.mesh, self.rules):
      return self.learner.jitted_score.lower(self.params, inputs, mb)

  # ------------------------------------------------------------------------------------------ sampler
  def prepared_params(self):
    """The abstract sampler parameters (precision cast, per-layer layout) as its `prepare_params` lays them out
    (`Sampler.param_shardings`, on the sampler's mesh)."""
    if self._prepared is None:
      with use_mesh(self.mesh, self.rules):
        lowered = self.sampler.jitted_prepare.lower(self.params)
        self._prepared = _on(_with_shardings(lowered, lowered.compile()), self.sampler.param_shardings)
    return self._prepared

  def _prefill_args(self):
    b, p, m = self.shapes.sampler_rows, self.shapes.prompt_len, self.sampler.mesh
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
    return (
        self.prepared_params(),
        _replicated(m, (b, p), jnp.int32),
        _replicated(m, (b, p), jnp.int32),
        jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(m, P())),
        _replicated(m, (b,), jnp.bool_),
        _replicated(m, (b,), jnp.int32),
    )

  def lower_prepare(self):
    """`Sampler.prepare_params` on the learner's parameters: the once-per-version transfer from the learner's layout
    and dtype to the sampler's, as one program (the sampler moves it to its layout a layer at a time)."""
    shardings = jax.tree.map(lambda x: x.sharding, self.prepared_params())
    with use_mesh(self.mesh, self.rules):
      return jax.jit(self.sampler.prepare_fn, out_shardings=shardings).lower(self.params)

  def lower_continuous(self, num_requests: int, sampling=None, unit: int = 1):
    """The continuous engine's whole call (the program the trainer runs: the paged engine's `program` with
    `sampling.kv_cache="paged"`, else the continuous engine's) on `num_requests` prompts of the prompt bucket, with
    the decode rows and refill size of the engine's `rows_and_refill`; a paged call with `unit` samples per shared
    prefill (`paged_continuous.share_unit`; the trainer's host side picks it from its prompts)."""
    s, p, n = self.trainer_sampler, self.shapes.prompt_len, int(num_requests)
    engine = s.engine
    if not hasattr(engine, "program"):
      raise ConfigError(
          f"program 'sample' compiles a continuous engine's whole call; the {engine.name!r} engine has none: compile "
          "prefill,decode"
      )
    m = s.mesh
    rows, refill = engine.rows_and_refill(n)
    requests = (
        _replicated(m, (n, p), jnp.int32),
        _replicated(m, (n, p), jnp.int32),
        _replicated(m, (n,), jnp.int32),
        _replicated(m, (n, 2), jnp.uint32),
    )
    kw = dict(sampling=sampling or self.sampling, p_len=p, rows=rows, refill=refill)
    with s.mesh_context():
      if engine.name != "paged":
        return engine.program.lower(self.prepared_params(), requests, **kw)
      return engine.program.lower(self.prepared_params(), requests, unit=unit, **kw)

  def _lower_prefill(self):
    args = self._prefill_args()
    with self.sampler.mesh_context():
      return self.sampler.engine.prefill.lower(*args, sampling=self.sampling)

  def _loop_state(self):
    """The abstract decode-loop state the prefill hands to decode."""
    if self._prefill_out is None:
      lowered = self._lower_prefill()
      self._prefill_out = _with_shardings(lowered, lowered.compile())
    return self._prefill_out

  def _lower_decode(self):
    state, loop_state = self.prepared_params(), self._loop_state()
    with self.sampler.mesh_context():
      return self.sampler.engine.decode.lower(
          state, loop_state, sampling=self.sampling, cache_offset=self.shapes.prompt_len
      )
