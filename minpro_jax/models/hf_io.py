"""Hugging Face safetensors checkpoints in and out (Qwen3, Qwen3-MoE, Llama).

Loading streams tensor by tensor onto the target sharding: the model is built abstractly
(`nnx.eval_shape`), then every parameter is created with `jax.make_array_from_callback`, whose callback
reads only the slice a device needs from the memory-mapped safetensors files
(`safe_open(...).get_slice`). No full host copy of the model ever exists, so a 30B checkpoint loads onto
a mesh with host memory of about one shard per device.

Every tensor is checked before any is read: a missing tensor, a wrong shape or an unknown/unused tensor
raises `ValueError` naming it (never a silent partial load).

Weight layout (HF `nn.Linear.weight` is [out, in]; ours is [in, ..., out], stacked over layers):
  q_proj.weight [H*hd, D] -> q_proj [L, D, H, hd]     o_proj.weight [D, H*hd] -> o_proj [L, H, hd, D]
  gate/up_proj.weight [F, D] -> [L, D, F]             down_proj.weight [D, F] -> [L, F, D]
  embed_tokens.weight [V, D] -> embed [V, D]          lm_head.weight [V, D] -> lm_head [D, V]
  mlp.gate.weight [E, D] -> router [L, D, E]          experts.{e}.gate_proj.weight [Fm, D] -> gate_proj [L, E, D, Fm]
  Qwen3-MoE experts are read in the per-expert layout of the published checkpoints (and of
  transformers 5.23 `save_pretrained`, which converts back to it) or the fused 3-D layout of transformers
  v5 modules (experts.gate_up_proj [E, 2*Fm, D], experts.down_proj [E, D, Fm]); export writes per-expert.
Reference: transformers `modeling_qwen3.py`, `modeling_qwen3_moe.py`, `modeling_llama.py` (5.23).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.sharding import DEFAULT_RULES, use_mesh

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")
_ARCH_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Buffers some old checkpoints carry; recomputed from the config, so safe to skip.
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling) from a legacy (`rope_theta` + `rope_scaling`) or v5 (`rope_parameters`) config."""
  params = cfg.get("rope_parameters") or {}
  theta = cfg.get("rope_theta", params.get("rope_theta"))
  if theta is None:
    raise ValueError("config.json has neither `rope_theta` nor `rope_parameters.rope_theta`")
  scaling = cfg.get("rope_scaling")
  if scaling is None and params.get("rope_type", "default") != "default":
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
    scaling = None
  return float(theta), (dict(scaling) if scaling else None)


def config_from_hf(config_json: Mapping[str, Any], **overrides) -> ModelConfig:
  """`ModelConfig` from a Hugging Face `config.json` dict (legacy or transformers-v5 keys).

  Args:
    config_json: the parsed `config.json`.
    **overrides: `ModelConfig` fields to set afterwards (e.g. param_dtype="bfloat16", dtype, remat,
      scan_layers, moe_impl). Without `param_dtype`, the checkpoint's `torch_dtype`/`dtype` is kept when it
      is float32/bfloat16/float16, else float32.

  Raises:
    ValueError: `model_type` is not one of qwen3 / qwen3_moe / llama (the message lists them), or the
      config uses a feature this model does not implement (attention/MLP bias, sliding window, activation
      other than silu, dense layers inside a MoE model, unsupported RoPE scaling).
  """
  c = dict(config_json)
  mt = c.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"config.json field `model_type`={mt!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
  for key in ("attention_bias", "mlp_bias"):
    if c.get(key):
      raise ValueError(f"config.json field `{key}`=True is not supported (the model has no biases)")
  if c.get("use_sliding_window"):
    raise ValueError("config.json field `use_sliding_window`=True is not supported (full attention only)")
  if any(t != "full_attention" for t in c.get("layer_types") or ()):
    raise ValueError(f"config.json field `layer_types`={c['layer_types']} is not supported (full attention only)")
  if c.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json field `hidden_act`={c['hidden_act']!r} is not supported; only 'silu'")
  if c.get("pretraining_tp", 1) != 1:
    raise ValueError(f"config.json field `pretraining_tp`={c['pretraining_tp']} is not supported; only 1")
  heads = int(c["num_attention_heads"])
  theta, scaling = _rope(c)
  dtype = c.get("torch_dtype") or c.get("dtype") or "float32"
  kw: dict[str, Any] = dict(
      vocab_size=int(c["vocab_size"]),
      hidden_size=int(c["hidden_size"]),
      intermediate_size=int(c.get("intermediate_size") or 0),
      num_layers=int(c["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(c.get("num_key_value_heads") or heads),
      head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      qk_norm=mt != "llama",
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      max_position_embeddings=int(c.get("max_position_embeddings", 40960)),
      architecture=mt,
      param_dtype=dtype if dtype in _SUPPORTED_DTYPES else "float32",
  )
  if mt == "qwen3_moe":
    if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
      raise ValueError(
          "config.json fields `decoder_sparse_step`/`mlp_only_layers` make some layers dense; "
          "only all-MoE models (decoder_sparse_step=1, mlp_only_layers=[]) are supported"
      )
    kw.update(
        num_experts=int(c.get("num_experts") or c.get("num_local_experts") or 0),
        num_experts_per_tok=int(c["num_experts_per_tok"]),
        moe_intermediate_size=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
    )
    if kw["num_experts"] <= 0:
      raise ValueError("config.json of a qwen3_moe model needs `num_experts` (or `num_local_experts`) > 0")
  kw.update(overrides)
  return ModelConfig(**kw)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The `config.json` dict transformers needs to build the same model (legacy key names, which both
  transformers 4.x and 5.x and serving stacks read).

  The model type follows the blocks the model has: a `qwen3` preset given experts (`num_experts > 0`, e.g. a scratch
  MoE) is written as `qwen3_moe`, a `qwen3_moe` without experts as `qwen3`.

  Raises:
    ValueError: a `llama` model with experts (transformers has no such architecture).
  """
  c = config
  model_type = c.architecture
  if c.architecture != "llama":
    model_type = "qwen3_moe" if c.is_moe else "qwen3"
  elif c.is_moe:
    raise ValueError("a llama model with experts (num_experts > 0) has no Hugging Face architecture to export to")
  out: dict[str, Any] = {
      "architectures": [_ARCH_CLASS[model_type]],
      "model_type": model_type,
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      "rope_theta": c.rope_theta,
      "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
      "tie_word_embeddings": c.tie_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
      "torch_dtype": c.param_dtype,
  }
  if model_type == "llama":
    out.update(mlp_bias=False, pretraining_tp=1)
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
  if model_type == "qwen3_moe":
    out.update(
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        router_aux_loss_coef=c.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )
  return out


# ----------------------------------------------------------------------------------------------------------
# The name/layout map


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How one of our parameters is stored in HF tensors.

  Our array = [loop axes...] + per-tensor block. Each loop axis ("l" layer, "e" expert) selects a tensor
  by name. The HF tensor's axis j is the row-major merge of split axes `groups[j]`; split axes in `fixed`
  are pinned to one index (the gate/up halves of a fused tensor); the remaining split axes, transposed by
  `perm` (ours axis i = split axis perm[i]), give our block.
  """

  path: tuple[str, ...]
  name: str
  loop: tuple[str, ...]
  groups: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]
  fixed: tuple[tuple[int, int], ...] = ()

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(g) for g in self.groups)

  def names(self, config: ModelConfig) -> Iterable[tuple[tuple[int, ...], str]]:
    sizes = {"l": config.num_layers, "e": config.num_experts}
    for idx in itertools.product(*[range(sizes[a]) for a in self.loop]):
      yield idx, self.name.format(**dict(zip(self.loop, idx)))


def _specs(config: ModelConfig, fused_experts: bool = False) -> list[_Spec]:
  """Specs of every parameter of `config`'s model, in HF checkpoint order."""
  c = config
  d, h, k, hd, v = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
  lay = "model.layers.{l}."
  t = (1, 0)
  specs = [_Spec(("embed",), "model.embed_tokens.weight", (), ((v,), (d,)), (0, 1))]
  specs += [
      _Spec(("layers", "input_norm", "scale"), lay + "input_layernorm.weight", ("l",), ((d,),), (0,)),
      _Spec(("layers", "attn", "q_proj"), lay + "self_attn.q_proj.weight", ("l",), ((h, hd), (d,)), (2, 0, 1)),
      _Spec(("layers", "attn", "k_proj"), lay + "self_attn.k_proj.weight", ("l",), ((k, hd), (d,)), (2, 0, 1)),
      _Spec(("layers", "attn", "v_proj"), lay + "self_attn.v_proj.weight", ("l",), ((k, hd), (d,)), (2, 0, 1)),
      _Spec(("layers", "attn", "o_proj"), lay + "self_attn.o_proj.weight", ("l",), ((d,), (h, hd)), (1, 2, 0)),
  ]
  if c.qk_norm:
    specs += [
        _Spec(("layers", "attn", "q_norm", "scale"), lay + "self_attn.q_norm.weight", ("l",), ((hd,),), (0,)),
        _Spec(("layers", "attn", "k_norm", "scale"), lay + "self_attn.k_norm.weight", ("l",), ((hd,),), (0,)),
    ]
  specs.append(
      _Spec(("layers", "post_attn_norm", "scale"), lay + "post_attention_layernorm.weight", ("l",), ((d,),), (0,))
  )
  if c.is_moe:
    e, fm = c.num_experts, c.moe_intermediate_size
    specs.append(_Spec(("layers", "mlp", "router"), lay + "mlp.gate.weight", ("l",), ((e,), (d,)), t))
    if fused_experts:
      fused = lay + "mlp.experts.gate_up_proj"
      specs += [
          _Spec(("layers", "mlp", "gate_proj"), fused, ("l",), ((e,), (2, fm), (d,)), (0, 2, 1), ((1, 0),)),
          _Spec(("layers", "mlp", "up_proj"), fused, ("l",), ((e,), (2, fm), (d,)), (0, 2, 1), ((1, 1),)),
          _Spec(("layers", "mlp", "down_proj"), lay + "mlp.experts.down_proj", ("l",), ((e,), (d,), (fm,)), (0, 2, 1)),
      ]
    else:
      ex = lay + "mlp.experts.{e}."
      specs += [
          _Spec(("layers", "mlp", "gate_proj"), ex + "gate_proj.weight", ("l", "e"), ((fm,), (d,)), t),
          _Spec(("layers", "mlp", "up_proj"), ex + "up_proj.weight", ("l", "e"), ((fm,), (d,)), t),
          _Spec(("layers", "mlp", "down_proj"), ex + "down_proj.weight", ("l", "e"), ((d,), (fm,)), t),
      ]
  else:
    f = c.intermediate_size
    specs += [
        _Spec(("layers", "mlp", "gate_proj"), lay + "mlp.gate_proj.weight", ("l",), ((f,), (d,)), t),
        _Spec(("layers", "mlp", "up_proj"), lay + "mlp.up_proj.weight", ("l",), ((f,), (d,)), t),
        _Spec(("layers", "mlp", "down_proj"), lay + "mlp.down_proj.weight", ("l",), ((d,), (f,)), t),
    ]
  specs.append(_Spec(("final_norm", "scale"), "model.norm.weight", (), ((d,),), (0,)))
  if not c.tie_embeddings:
    specs.append(_Spec(("lm_head",), "lm_head.weight", (), ((v,), (d,)), t))
  return specs


# ----------------------------------------------------------------------------------------------------------
# Tensor sources


class TensorSource:
  """Read access to named tensors: `shapes` {name: shape} and `read(name, slices)` -> np.ndarray."""

  shapes: dict[str, tuple[int, ...]]

  def read(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
    raise NotImplementedError


class DictSource(TensorSource):
  """In-memory numpy tensors (used by the GGUF loader and tests)."""

  def __init__(self, tensors: Mapping[str, np.ndarray]):
    self.tensors = dict(tensors)
    self.shapes = {k: tuple(np.shape(a)) for k, a in self.tensors.items()}

  def read(self, name, slices):
    return np.asarray(self.tensors[name][slices])


class SafetensorsSource(TensorSource):
  """Memory-mapped safetensors files of a HF folder (single file or sharded with an index)."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
      weight_map, files = None, ["model.safetensors"]
    else:
      raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    self._handles = {fn: stack.enter_context(safe_open(os.path.join(path, fn), framework="numpy")) for fn in files}
    self._file_of: dict[str, str] = {}
    for fn, h in self._handles.items():
      for key in h.keys():
        if weight_map is not None and weight_map.get(key) != fn:
          raise ValueError(
              f"tensor {key!r} is in {fn} but model.safetensors.index.json maps it to " f"{weight_map.get(key)!r}"
          )
        self._file_of[key] = fn
    if weight_map is not None:
      missing = sorted(set(weight_map) - set(self._file_of))
      if missing:
        raise ValueError(f"model.safetensors.index.json lists tensors absent from their files: {missing[:5]}")
    self.shapes = {k: tuple(self._handles[fn].get_slice(k).get_shape()) for k, fn in self._file_of.items()}

  def read(self, name, slices):
    return np.asarray(self._handles[self._file_of[name]].get_slice(name)[slices])


# ----------------------------------------------------------------------------------------------------------
# Loading


def _norm(s: slice | None, n: int) -> tuple[int, int]:
  start, stop, step = (s or slice(None)).indices(n)
  if step != 1:
    raise ValueError(f"strided shard index {s} is not supported")
  return start, stop


def _read_block(source: TensorSource, spec: _Spec, name: str, our_index: tuple) -> np.ndarray:
  """Our block [our_index] of tensor `name`, reading only the rows/columns it needs."""
  fixed = dict(spec.fixed)
  split_sizes = [s for g in spec.groups for s in g]
  free = [i for i in range(len(split_sizes)) if i not in fixed]
  split_rng: list[tuple[int, int]] = [(0, 0)] * len(split_sizes)
  for ours_axis, split_axis in enumerate(spec.perm):
    split_rng[free[split_axis]] = _norm(our_index[ours_axis], split_sizes[free[split_axis]])
  for i, val in fixed.items():
    split_rng[i] = (val, val + 1)
  hf_slices, reshape, post, pos = [], [], [], 0
  for g in spec.groups:
    (a0, b0), rest = split_rng[pos], g[1:]
    inner = math.prod(rest)
    hf_slices.append(slice(a0 * inner, b0 * inner))
    reshape += [b0 - a0, *rest]
    post += [slice(None)] + [slice(*split_rng[pos + 1 + j]) for j in range(len(rest))]
    pos += len(g)
  block = source.read(name, tuple(hf_slices)).reshape(reshape)[tuple(post)]
  block = block.reshape([block.shape[i] for i in free])
  return np.transpose(block, spec.perm)


def _target_sharding(sds, mesh):
  if mesh is None:
    return SingleDeviceSharding(jax.devices()[0])
  spec = list(getattr(sds.sharding, "spec", P()))
  spec += [None] * (len(sds.shape) - len(spec))
  for i, ax in enumerate(spec):  # replicate dims the mesh axis does not divide (as `constrain` does)
    names = ax if isinstance(ax, tuple) else (ax,)
    if ax is not None and sds.shape[i] % math.prod(mesh.shape[a] for a in names):
      spec[i] = None
  return NamedSharding(mesh, P(*spec))


def _check_tensors(source: TensorSource, config: ModelConfig, specs: list[_Spec]) -> None:
  used = set()
  for spec in specs:
    for _, name in spec.names(config):
      if name not in source.shapes:
        raise ValueError(f"checkpoint is missing tensor {name!r} (needed for {'.'.join(spec.path)})")
      if source.shapes[name] != spec.hf_shape:
        raise ValueError(f"tensor {name!r} has shape {source.shapes[name]}, expected {spec.hf_shape} from the config")
      used.add(name)
  unused = sorted(
      n
      for n in set(source.shapes) - used
      if not n.endswith(_IGNORABLE_SUFFIXES) and not (config.tie_embeddings and n == "lm_head.weight")
  )
  if unused:
    raise ValueError(
        f"checkpoint has {len(unused)} tensors the {config.architecture} model does not use, e.g. "
        f"{unused[:5]}; refusing a partial load (wrong model_type or config?)"
    )


def load_from_source(
    source: TensorSource, config: ModelConfig, *, mesh: jax.sharding.Mesh | None = None, rules=None
) -> Transformer:
  """Builds a `Transformer` from HF-named tensors, streaming each shard of each parameter to its device.

  Args:
    source: the tensors (`SafetensorsSource`, `DictSource`).
    config: the model config (e.g. from `config_from_hf`).
    mesh: target mesh; None puts every parameter on the first device.
    rules: logical-axis rules (default `minpro_jax.runtime.sharding.DEFAULT_RULES`).

  Raises:
    ValueError: a tensor is missing, has the wrong shape, or is not used by the model.
  """
  fused = config.is_moe and "model.layers.0.mlp.experts.gate_up_proj" in source.shapes
  specs = _specs(config, fused_experts=fused)
  _check_tensors(source, config, specs)
  if mesh is None:
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  else:
    with use_mesh(mesh, rules or DEFAULT_RULES):
      abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  by_path = {s.path: s for s in specs}
  for path, var in nnx.to_flat_state(state):
    spec = by_path.get(tuple(str(p) for p in path))
    if spec is None:
      raise ValueError(f"internal: no checkpoint mapping for parameter {'.'.join(map(str, path))}")
    sds = var.get_value()
    var.set_value(
        jax.make_array_from_callback(
            sds.shape, _target_sharding(sds, mesh), _make_callback(source, spec, config, sds.shape, sds.dtype)
        )
    )
  return nnx.merge(graphdef, state)


def _make_callback(source, spec: _Spec, config, shape, dtype) -> Callable[[tuple], np.ndarray]:
  nloop = len(spec.loop)
  names = dict(spec.names(config))

  def callback(index):
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    loop_ranges = [range(*_norm(index[i], shape[i])) for i in range(nloop)]
    inner = index[nloop:]
    out = np.empty(
        [len(r) for r in loop_ranges] + [b - a for a, b in (_norm(s, n) for s, n in zip(inner, shape[nloop:]))], dtype
    )
    for pos in itertools.product(*[range(len(r)) for r in loop_ranges]):
      idx = tuple(r[p] for r, p in zip(loop_ranges, pos))
      out[pos] = _read_block(source, spec, names[idx], inner)
    return out

  return callback


def load_hf_checkpoint(
    path: str, *, mesh: jax.sharding.Mesh | None = None, rules=None, **config_overrides
) -> tuple[Transformer, ModelConfig]:
  """Loads a local Hugging Face folder (config.json + model.safetensors, or sharded safetensors with
  model.safetensors.index.json) into a `Transformer`, streaming onto `mesh`.

  Args:
    path: the folder.
    mesh: target mesh (parameters are placed by the logical-axis rules); None = first device.
    rules: logical-axis rules (default DEFAULT_RULES).
    **config_overrides: `ModelConfig` fields, e.g. param_dtype="bfloat16", dtype="bfloat16", remat="block",
      scan_layers=True, moe_impl="ragged".

  Returns:
    (model, config).

  Raises:
    FileNotFoundError: no config.json or no safetensors in `path`.
    ValueError: unsupported `model_type`/feature (see `config_from_hf`), or a missing, wrongly shaped or
      unused tensor (the message names it).
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"{path} has no config.json")
  with open(cfg_path) as f:
    config = config_from_hf(json.load(f), **config_overrides)
  with contextlib.ExitStack() as stack:
    model = load_from_source(SafetensorsSource(path, stack), config, mesh=mesh, rules=rules)
    jax.block_until_ready(nnx.state(model))  # callbacks read the mmaps: finish before closing them
  return model, config


# ----------------------------------------------------------------------------------------------------------
# Export


def _to_hf(block: np.ndarray, spec: _Spec) -> np.ndarray:
  """Inverse of `_read_block` on a full (unfused) tensor."""
  return np.transpose(block, np.argsort(spec.perm)).reshape(spec.hf_shape)


def hf_state_dict(model: Transformer) -> Iterable[tuple[str, np.ndarray]]:
  """Yields (HF name, numpy array) for every tensor of the HF checkpoint of `model`, one at a time
  (each gathered to host only when yielded), in per-expert layout for MoE models."""
  config = model.config
  flat = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  for spec in _specs(config):
    arr = flat[spec.path].get_value()
    for idx, name in spec.names(config):
      yield name, _to_hf(np.asarray(jax.device_get(arr[idx] if idx else arr)), spec)


def _plain_mode(path: str) -> None:
  """Gives `path` the mode `open(path, "w")` would (0644 under the usual umask 022): safetensors writes 0600, which
  another user (a serving job, a shared model folder) cannot read."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def save_hf_checkpoint(
    model: Transformer, path: str, *, max_shard_bytes: int = 5 * 2**30, extra_config: Mapping[str, Any] | None = None
) -> list[str]:
  """Writes `model` as a Hugging Face folder that `transformers` `from_pretrained` loads.

  Args:
    model: the `Transformer` (any sharding; each tensor is gathered to host one at a time).
    path: output folder (created).
    max_shard_bytes: largest safetensors file; above it the checkpoint is split into
      model-0000i-of-0000n.safetensors with model.safetensors.index.json, as `save_pretrained` does.
    extra_config: keys merged into config.json (e.g. bos_token_id, eos_token_id from the source config);
      the model's own fields win.

  Returns:
    The safetensors file names written.
  """
  from safetensors.numpy import save_file

  config = model.config
  os.makedirs(path, exist_ok=True)
  itemsize = np.dtype(config.jnp_param_dtype).itemsize
  sizes = [(name, math.prod(spec.hf_shape) * itemsize) for spec in _specs(config) for _, name in spec.names(config)]
  shards: list[list[str]] = [[]]
  acc = 0
  for name, nbytes in sizes:
    if shards[-1] and acc + nbytes > max_shard_bytes:
      shards.append([])
      acc = 0
    shards[-1].append(name)
    acc += nbytes
  n = len(shards)
  files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  file_of = {name: files[i] for i, names in enumerate(shards) for name in names}
  tensors = hf_state_dict(model)
  for fn, names in zip(files, shards):
    shard = {}
    for name in names:
      got, arr = next(tensors)
      assert got == name, (got, name)
      shard[name] = np.ascontiguousarray(arr)
    save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
    _plain_mode(os.path.join(path, fn))
  if n > 1:
    index = {"metadata": {"total_size": sum(b for _, b in sizes)}, "weight_map": file_of}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  cfg = {**(extra_config or {}), **config_to_hf(config)}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
  return files


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{HF tensor name: shape} of the checkpoint of `config`'s model (per-expert layout for MoE)."""
  return {name: spec.hf_shape for spec in _specs(config) for _, name in spec.names(config)}
