"""GGUF (llama.cpp) checkpoints -> `Transformer`, for the Llama and Qwen3 architectures.

Tensors are dequantized with `gguf.quants.dequantize` (any quant type the `gguf` package knows), renamed to
the Hugging Face names and fed through the same loader as safetensors checkpoints
(`hf_io.load_from_source`), so the name/shape checks and the placement onto a mesh are shared.

RoPE convention: llama.cpp's `convert_hf_to_gguf.py` permutes the rows of Llama's q/k projections per head
from HF's rotate-half order (i, i + hd/2) to interleaved pairs (2i, 2i + 1) (`LlamaModel.permute`). We
undo that permutation so the model keeps HF's single rotate-half RoPE. Qwen3 GGUFs use llama.cpp's NEOX
rope (rotate-half) and are stored unpermuted. GGUF tensor data comes as numpy [out, in] (GGML dims
reversed), i.e. HF's `nn.Linear.weight` layout.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from minpro_jax.data.tokenizers import smollm2_gguf_path  # noqa: F401  (re-exported: one implementation)
from minpro_jax.models.config import ModelConfig
from minpro_jax.models.hf_io import DictSource, load_from_source
from minpro_jax.models.transformer import Transformer

SUPPORTED_GGUF_ARCHS = ("llama", "qwen3")

_LAYER_NAMES = {  # GGUF blk.{l}.X -> HF model.layers.{l}.Y
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute(w, n_head, n_head_kv)`: per head, interleaved row pairs -> rotate-half.

  Args:
    w_out_in: [n_heads * head_dim, D] q or k projection as stored in a llama GGUF.
    n_heads: heads of this projection (query heads for q, KV heads for k).
  """
  rows = w_out_in.shape[0]
  return w_out_in.reshape(n_heads, rows // n_heads // 2, 2, *w_out_in.shape[1:]).swapaxes(1, 2).reshape(w_out_in.shape)


def permute_rope_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's `permute` (HF rotate-half rows -> interleaved pairs); used to write test GGUFs."""
  rows = w_out_in.shape[0]
  return w_out_in.reshape(n_heads, 2, rows // n_heads // 2, *w_out_in.shape[1:]).swapaxes(1, 2).reshape(w_out_in.shape)


def _reader(path_or_reader):
  if isinstance(path_or_reader, (str, os.PathLike)):
    from gguf import GGUFReader

    if not os.path.isfile(path_or_reader):
      raise FileNotFoundError(f"GGUF file not found: {path_or_reader}")
    return GGUFReader(os.fspath(path_or_reader))
  return path_or_reader


def gguf_config(reader, **overrides) -> ModelConfig:
  """`ModelConfig` from the metadata of a GGUF file (its path or an open `gguf.GGUFReader`).

  Raises:
    FileNotFoundError: the path is not a file.
    ValueError: `general.architecture` is not llama/qwen3, a required key is missing, or RoPE scaling is set.
  """
  reader = _reader(reader)

  def get(key, default: Any = KeyError):
    f = reader.fields.get(key)
    if f is None:
      if default is KeyError:
        raise ValueError(f"GGUF metadata has no {key!r}")
      return default
    return f.contents()

  arch = get("general.architecture")
  if arch not in SUPPORTED_GGUF_ARCHS:
    raise ValueError(f"GGUF `general.architecture`={arch!r} is not supported; supported: {SUPPORTED_GGUF_ARCHS}")
  if get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
    raise ValueError(f"GGUF `{arch}.rope.scaling.type`={get(f'{arch}.rope.scaling.type')!r} is not supported")
  tensors = {t.name: t for t in reader.tensors}
  d = int(get(f"{arch}.embedding_length"))
  heads = int(get(f"{arch}.attention.head_count"))
  head_dim = int(get(f"{arch}.attention.key_length", d // heads))
  if int(get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
    raise ValueError(f"GGUF `{arch}.rope.dimension_count` != head_dim {head_dim}: partial RoPE is not supported")
  vocab = get(f"{arch}.vocab_size", None)
  vocab = int(vocab) if vocab is not None else int(tensors["token_embd.weight"].data.shape[0])
  eps = float(f"{float(get(f'{arch}.attention.layer_norm_rms_epsilon')):.7g}")  # stored as f32: 1e-5 not 9.99e-6
  kw = dict(
      vocab_size=vocab,
      hidden_size=d,
      intermediate_size=int(get(f"{arch}.feed_forward_length")),
      num_layers=int(get(f"{arch}.block_count")),
      num_heads=heads,
      num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
      head_dim=head_dim,
      rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
      rms_norm_eps=eps,
      qk_norm=arch == "qwen3",
      tie_embeddings="output.weight" not in tensors,
      max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
      architecture=arch,
  )
  kw.update(overrides)
  return ModelConfig(**kw)


def gguf_to_hf_tensors(reader, config: ModelConfig) -> dict[str, np.ndarray]:
  """Dequantized float32 tensors of a GGUF under their Hugging Face names (q/k un-permuted for llama).

  Raises:
    ValueError: a GGUF tensor has no HF counterpart (the message names it).
  """
  from gguf.quants import dequantize

  out = {}
  for t in reader.tensors:
    if t.name in _GLOBAL_NAMES:
      name = _GLOBAL_NAMES[t.name]
    else:
      parts = t.name.split(".", 2)
      if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {t.name!r} has no counterpart in the {config.architecture} model")
      name = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape([int(s) for s in reversed(t.shape)])
    if config.architecture == "llama" and name.endswith("self_attn.q_proj.weight"):
      w = unpermute_rope_rows(w, config.num_heads)
    elif config.architecture == "llama" and name.endswith("self_attn.k_proj.weight"):
      w = unpermute_rope_rows(w, config.num_kv_heads)
    out[name] = w
  return out


def load_gguf(
    path_or_reader, *, mesh: jax.sharding.Mesh | None = None, rules=None, **config_overrides
) -> tuple[Transformer, ModelConfig]:
  """Loads a llama- or qwen3-architecture GGUF into a `Transformer`.

  Args:
    path_or_reader: a `.gguf` path or an open `gguf.GGUFReader` (pass the reader to share one parse with
      `minpro_jax.data.tokenizers.load_gguf_tokenizer`).
    mesh: target mesh (None = first device). rules: logical-axis rules.
    **config_overrides: `ModelConfig` fields (param_dtype, dtype, remat, scan_layers, ...).

  Returns:
    (model, config). Quantized weights are dequantized to float32 (then cast to `param_dtype`); they
    approximate the original checkpoint only as well as the quantization does.

  Raises:
    FileNotFoundError: no such file. ValueError: unsupported architecture or metadata, or a missing,
    wrongly shaped or unknown tensor (named in the message).
  """
  reader = _reader(path_or_reader)
  config = gguf_config(reader, **config_overrides)
  tensors = gguf_to_hf_tensors(reader, config)
  return load_from_source(DictSource(tensors), config, mesh=mesh, rules=rules), config
