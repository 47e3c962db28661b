"""Qwen3 / Qwen3-MoE / Llama decoder in Flax NNX, its configs, log-prob function and checkpoint converters."""

from minpro_jax.models.config import PRESETS, ModelConfig, get_preset
from minpro_jax.models.inference_layout import fuse_qkv_params, fused_qkv_keeps_sharding, unstack_layer_params
from minpro_jax.models.logprobs import TokenLogprobs, logprobs_from_hidden, token_logprobs
from minpro_jax.models.transformer import KVCache, ModelOutput, Transformer, init_model, segment_positions

__all__ = [
    "PRESETS",
    "ModelConfig",
    "get_preset",
    "TokenLogprobs",
    "logprobs_from_hidden",
    "token_logprobs",
    "KVCache",
    "ModelOutput",
    "Transformer",
    "init_model",
    "segment_positions",
    "fuse_qkv_params",
    "fused_qkv_keeps_sharding",
    "unstack_layer_params",
]
