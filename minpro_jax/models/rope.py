"""Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's rotate-half layout, with its "linear" and
"llama3" frequency scalings (transformers `modeling_rope_utils`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minpro_jax.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """[head_dim // 2] float32 inverse frequencies, with HF's "linear" / "llama3" scaling if configured."""
  hd = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  scaling = config.rope_scaling
  if not scaling:
    return inv_freq
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "linear":
    return inv_freq / float(scaling["factor"])
  if kind == "llama3":
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return jnp.where(is_medium, smoothed, out)
  return inv_freq


def rope_tables(positions_bt: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """(cos, sin), each [B, T, head_dim // 2] float32, of the RoPE angles positions * inv_freq (HF's
  `rotary_emb`), computed once per forward and shared by every layer.

  The sampler passes tables gathered from one precomputed per `generate` instead.
  """

  def tables(positions_bt):
    angles = positions_bt.astype(jnp.float32)[..., None] * rope_inv_freq(config)
    return jnp.cos(angles), jnp.sin(angles)

  # Same function in both branches: the cond only materialises the tables, which XLA:CPU would otherwise
  # fuse into (and recompute in) every consumer, per head, in every layer, forward and backward.
  return jax.lax.cond(jnp.any(positions_bt > 0), tables, tables, positions_bt)


def apply_rope(x_bthk: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotate-half RoPE (HF layout: pairs (i, i + head_dim/2)) in fp32; returns x's dtype.

  Args:
    x_bthk: [B, T, heads, head_dim].
    rope: (cos, sin) [B, T, head_dim // 2] from `rope_tables`.
  """
  cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]
  x = x_bthk.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bthk.dtype)
