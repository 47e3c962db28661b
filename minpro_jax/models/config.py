"""Model configuration for the Qwen3 / Llama decoder family, with named presets.

Preset values are copied from the published Hugging Face `config.json` of each model
(Qwen/Qwen3-*, Qwen/Qwen3-30B-A3B, HuggingFaceTB/SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "linear", "llama3")
_REMAT = ("none", "block", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload")
_ATTENTION_IMPLS = ("auto", "xla", "blockwise", "splash", "cudnn")
_MOE_IMPLS = ("dense", "ragged")
_ACT_QUANT = ("none", "fp8", "e4m3_tensor", "e5m2_token", "e5m2_tensor")  # models.quant.ACT_QUANT


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one decoder-only transformer of the Qwen3/Llama family.

  Attributes:
    vocab_size: number of token embeddings (V).
    hidden_size: model width (D).
    intermediate_size: SwiGLU width of dense MLP blocks (F).
    num_layers: number of decoder blocks (L).
    num_heads: query heads (H).
    num_kv_heads: key/value heads (K); H must be a multiple of K (grouped-query attention).
    head_dim: per-head width.
    rope_theta: RoPE base frequency.
    rope_scaling: None or a dict like HF's `rope_scaling` ({"rope_type": "linear"|"llama3", ...}).
    rms_norm_eps: epsilon of every RMSNorm.
    qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3: True, Llama: False).
    tie_embeddings: LM head is the transposed token embedding.
    num_experts: 0 for dense MLPs; > 0 makes every block a mixture of experts (Qwen3-MoE).
    num_experts_per_tok: top-k experts per token.
    moe_intermediate_size: width of each expert's SwiGLU.
    norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
    router_aux_loss_coef: the checkpoint's load-balancing loss weight (HF `router_aux_loss_coef`), kept for
      the `config.json` round trip; the model never reads it (the learner's weight is
      `minpro_jax.rl.learner.LossConfig.router_aux_coef`).
    moe_impl: "ragged" (default: tokens sorted by expert and `jax.lax.ragged_dot`; compute proportional to
      top-k) or "dense" (every expert on every token, masked; the simple reference the ragged path is tested
      against).
    max_position_embeddings: longest sequence the RoPE tables are meant for (informational).
    architecture: "qwen3", "qwen3_moe" or "llama" (what `config.json` calls `model_type`).
    param_dtype: storage dtype of parameters ("float32" or "bfloat16").
    dtype: compute dtype of activations and matmuls ("float32" or "bfloat16"). Log-softmax is always fp32.
    remat: what the backward pass of each decoder block recomputes (`jax.checkpoint` policies): "none" (keep
      every activation), "block" (keep only the block's input, recompute the rest), "dots_saveable" (keep
      every matmul output, recompute the elementwise rest), "dots_with_no_batch_dims_saveable" (keep the
      matmul outputs without batch dimensions: the projections, not attention's scores), "offload" (those
      projection outputs are moved to pinned host memory in the forward and back for the backward).
    attention_impl: how attention runs over the tokens' own keys (the learner, scoring, the sampler's prefill;
      `models.attention_dispatch`): "xla" ([T, T] scores in causal query blocks), "blockwise" (FlashAttention
      in plain JAX with a recomputing backward, O(T · block) memory), "splash" (the Pallas TPU kernel; interpret
      mode elsewhere), "cudnn" (cuDNN flash attention, GPU, bf16/fp16) or "auto" (splash on TPU, cudnn on GPU
      for bf16/fp16, else blockwise from AUTO_BLOCKWISE_MIN_TOKENS tokens on and xla below). Decode steps
      attend to the KV cache.
    attn_block_size: query and key block of "blockwise" and "splash" (an int >= 1; splash rounds it up to a
      multiple of 128; blocks are cut to the sequence).
    scan_layers: run the stacked layers with `nnx.scan` (fast compile for deep models) instead of a Python loop.
    stack_layers: True (default, what checkpoints and the learner use): every per-layer parameter has a
      leading `layers` axis. False: one separate `DecoderLayer` per layer (an `nnx.List`) and a per-layer
      KV cache; the sampler converts to this layout (`minpro_jax.models.unstack_layer_params`) because
      XLA:CPU copies every slice of a stacked weight or cache out of the stack at each decode step.
    fuse_qkv: inference layout (needs stack_layers=False): each attention block holds one `qkv_proj`
      [D, K, H/K + 2, head_dim] (per KV head: its query heads, then its key, then its value) instead of
      q/k/v_proj, so attention runs 1 input matmul per token instead of 3. The sampler converts to it
      (`minpro_jax.models.fuse_qkv_params`); checkpoints and the learner never use it.
    attn_causal_blocks: without a KV cache (the learner, scoring), attention splits the T queries into at
      most this many blocks, each of at least 64 queries, and scores each block only against the keys up to
      its last query (`models.attention_core`): (n + 1) / (2n) of the T x T work, n = 4: 62.5 %. The
      skipped keys are masked anyway, so real tokens' outputs are unchanged up to float rounding (padding
      rows, which nothing reads, differ). 1, or T < 128, scores the full T x T
      matrix. The KV-cache path (the sampler) always scores all cache slots.
    act_quant: "none", or "fp8" to fake-quantize every matmul input of attention and MLP/experts to e4m3
      (dynamic per-token scale; `minpro_jax.models.quant`); "e4m3_tensor", "e5m2_token", "e5m2_tensor" for
      that format and a per-token or per-tensor scale. Used by the sampler's simulated FP8 mode.

  Raises:
    ValueError: on construction (and `replace`), naming the field: a size <= 0, num_heads not a multiple of
      num_kv_heads, top-k outside [1, num_experts] or moe_intermediate_size <= 0 for a MoE, an unknown dtype /
      remat / moe_impl / act_quant / RoPE scaling type, scan_layers without stack_layers, fuse_qkv with
      stack_layers, attn_causal_blocks or attn_block_size not an int >= 1, an unknown attention_impl.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rope_scaling: Mapping[str, Any] | None = None
  rms_norm_eps: float = 1e-6
  qk_norm: bool = True
  tie_embeddings: bool = False
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.001
  moe_impl: str = "ragged"
  max_position_embeddings: int = 40960
  architecture: str = "qwen3"
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = False
  stack_layers: bool = True
  fuse_qkv: bool = False
  attn_causal_blocks: int = 4
  act_quant: str = "none"
  attention_impl: str = "auto"
  attn_block_size: int = 512

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    for name in positive:
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.num_experts == 0 and self.intermediate_size <= 0:
      raise ValueError("ModelConfig.intermediate_size must be > 0 for a dense model")
    if self.num_experts:
      if not 0 < self.num_experts_per_tok <= self.num_experts:
        raise ValueError(
            f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must lie in [1, num_experts="
            f"{self.num_experts}]"
        )
      if self.moe_intermediate_size <= 0:
        raise ValueError("ModelConfig.moe_intermediate_size must be > 0 when num_experts > 0")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")
    if self.remat not in _REMAT:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; choose one of {_REMAT}")
    if self.scan_layers and not self.stack_layers:
      raise ValueError("ModelConfig.scan_layers=True needs stack_layers=True (nnx.scan runs stacked layers)")
    if self.fuse_qkv and self.stack_layers:
      raise ValueError(
          "ModelConfig.fuse_qkv=True is the sampler's per-layer inference layout; it needs " "stack_layers=False"
      )
    if not isinstance(self.attn_causal_blocks, int) or self.attn_causal_blocks < 1:
      raise ValueError(
          f"ModelConfig.attn_causal_blocks={self.attn_causal_blocks} must be an int >= 1 "
          "(1 = one full T x T score matrix)"
      )
    if self.attention_impl not in _ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}; choose one of {_ATTENTION_IMPLS}")
    if not isinstance(self.attn_block_size, int) or self.attn_block_size < 1:
      raise ValueError(f"ModelConfig.attn_block_size={self.attn_block_size} must be an int >= 1")
    if self.act_quant not in _ACT_QUANT:
      raise ValueError(f"ModelConfig.act_quant={self.act_quant!r}; choose one of {_ACT_QUANT}")
    if self.moe_impl not in _MOE_IMPLS:
      raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r}; choose one of {_MOE_IMPLS}")
    if self.rope_scaling is not None:
      kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
      if kind not in _ROPE_TYPES:
        raise ValueError(f"ModelConfig.rope_scaling type {kind!r} is not supported; choose one of {_ROPE_TYPES}")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **changes) -> "ModelConfig":
    """Returns a copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Exact parameter count of the model this config builds."""
    d, hd = self.hidden_size, self.head_dim
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + (2 * hd if self.qk_norm else 0)
    if self.is_moe:
      mlp = d * self.num_experts + self.num_experts * 3 * d * self.moe_intermediate_size
    else:
      mlp = 3 * d * self.intermediate_size
    per_layer = attn + mlp + 2 * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.num_layers * per_layer + self.vocab_size * d + d + head


# Published configs (HF config.json). Qwen3 dense: no attention bias, qk-norm, rope 1e6, eps 1e-6.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        tie_embeddings=True,
        max_position_embeddings=2048,
    ),
    "tiny-moe": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        architecture="qwen3_moe",
        max_position_embeddings=2048,
    ),
    "tiny-llama": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        qk_norm=False,
        tie_embeddings=True,
        architecture="llama",
        max_position_embeddings=2048,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "qwen3-4b": ModelConfig(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=False,
    ),
    "qwen3-14b": ModelConfig(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=40,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=False,
    ),
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        tie_embeddings=False,
        architecture="qwen3_moe",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        qk_norm=False,
        tie_embeddings=True,
        architecture="llama",
        max_position_embeddings=8192,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, optionally with fields overridden.

  Raises:
    ValueError: unknown preset name (the message lists the known ones).
  """
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
