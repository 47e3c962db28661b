"""Simulated ("fake") FP8 quantisation and the sampler's inference-precision conversions.

This is how the sampler's policy mu differs from the learner's pi at equal weights, as in MIPU (arXiv
2606.29526); the scheme mirrors vLLM's FP8 path. Every dense-layer weight (attention q/k/v/o, MLP
gate/up/down, MoE experts and router; NOT the embedding or LM head, NOT norms) is rounded to FP8 and
dequantized back, by default float8_e4m3fn with a per-tensor scale amax / 448, or per output channel, or per
128 x 128 block (DeepSeek-V3 / vLLM block FP8), in e4m3 or e5m2; optionally each matmul input is quantized
dynamically per token or per tensor the same way. Compute stays in the model's compute dtype. The formats
(e4m3 max finite 448, e5m2 57344) are those of Micikevicius et al. 2022, "FP8 Formats for Deep Learning".

Not qwix: its `HowToQuantize(channelwise_axes, tiled_axes)` covers these scales, but a tile must divide its
axis (128-blocks fail on SmolLM2's 576-wide weights) and it quantizes by intercepting each matmul at call time
rather than converting the State once; switching needs padded tiles and qwix in requirements.txt and CI.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.models.config import ModelConfig

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
PRECISIONS = ("fp32", "bf16", "fp8")
# format -> (dtype, largest finite value)
FP8_FORMATS = {"e4m3": (jnp.float8_e4m3fn, E4M3_MAX), "e5m2": (jnp.float8_e5m2, 57344.0)}
FP8_WEIGHT_SCALES = ("tensor", "channel", "block128")
FP8_ACTIVATIONS = ("token", "tensor", "none")
BLOCK = 128  # block128: one scale per 128 x 128 (input x output) tile, as DeepSeek-V3 / vLLM block FP8
# ModelConfig.act_quant -> (format, scale axis: -1 per token, None per tensor); "fp8" is e4m3 per token
ACT_QUANT = {
    "fp8": ("e4m3", -1),
    "e4m3_tensor": ("e4m3", None),
    "e5m2_token": ("e5m2", -1),
    "e5m2_tensor": ("e5m2", None),
}
# Parameter paths (last key) that are dense-layer weights; stacked layers keep a leading L axis.
DENSE_WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router")
FUSED_WEIGHT_NAMES = ("qkv_proj",)  # the sampler's fused layout (models/inference_layout.py)
# (input axes, output axes) at the end of each weight; axes before them (layers L, experts E) are batch axes
_MATRIX_AXES = {"q_proj": (1, 2), "k_proj": (1, 2), "v_proj": (1, 2), "o_proj": (2, 1)}


def fake_quant(x: jax.Array, axis=None, fmt: str = "e4m3") -> jax.Array:
  """Quantize-dequantize x to FP8 `fmt` with scale amax(|x|, axis) / fmt_max (round to nearest even).

  Args:
    x: any float array.
    axis: reduction axes of the scale (None = one scale per tensor; -1 = per row/token).
    fmt: "e4m3" (float8_e4m3fn, max 448) or "e5m2" (float8_e5m2, max 57344).

  Returns:
    Array of x's shape and dtype holding fmt-representable values times the scale. All-zero slices stay 0.
  """
  dtype, fmax = FP8_FORMATS[fmt]
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=axis is not None)
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  return _round(x32, scale, dtype).astype(x.dtype)


def _round(x32: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  return (x32 / scale).astype(dtype).astype(jnp.float32) * scale


def fake_quant_e4m3(x: jax.Array, axis=None) -> jax.Array:
  """`fake_quant` in e4m3: scale amax(|x|, axis) / 448; axis None = per tensor, -1 = per row/token."""
  return fake_quant(x, axis, "e4m3")


def maybe_quant_act(x: jax.Array, mode: str) -> jax.Array:
  """Dynamic activation fake-quant at a matmul input (`ModelConfig.act_quant`): "none" -> x; "fp8" -> per-token
  e4m3 (last axis); "e4m3_tensor" / "e5m2_token" / "e5m2_tensor" -> that format and scale (`ACT_QUANT`). A
  per-tensor scale is one amax over the whole call's batch, padding rows included, as an engine's batch is.

  Raises:
    ValueError: unknown `mode`.
  """
  if mode == "none":
    return x
  if mode in ACT_QUANT:
    fmt, axis = ACT_QUANT[mode]
    return fake_quant(x, axis=axis, fmt=fmt)
  raise ValueError(f"act_quant={mode!r}; choose 'none' or one of {tuple(ACT_QUANT)}")


def _path_name(path) -> str:
  for k in reversed(path):
    name = getattr(k, "key", getattr(k, "name", None))
    if isinstance(name, str) and name not in ("value", "raw_value"):
      return name
  return ""


def _matrix_scale(x32: jax.Array, n_in: int, n_out: int, weight_scale: str, fmax: float) -> jax.Array:
  """The scale of a weight [batch..., in..., out...] viewed as matrices [batch..., IN, OUT]: per output
  channel (amax over IN) or per 128 x 128 tile (the last tiles padded with zeros for the amax only)."""
  batch = x32.shape[: x32.ndim - n_in - n_out]
  d_in = int(np.prod(x32.shape[len(batch) : len(batch) + n_in]))
  d_out = int(np.prod(x32.shape[x32.ndim - n_out :]))
  a = jnp.abs(x32.reshape(*batch, d_in, d_out))
  if weight_scale == "channel":
    amax = jnp.max(a, axis=-2, keepdims=True)
  else:
    p_in, p_out = -d_in % BLOCK, -d_out % BLOCK
    a = jnp.pad(a, [(0, 0)] * len(batch) + [(0, p_in), (0, p_out)])
    n_i, n_o = (d_in + p_in) // BLOCK, (d_out + p_out) // BLOCK
    tiles = jnp.max(a.reshape(*batch, n_i, BLOCK, n_o, BLOCK), axis=(-3, -1), keepdims=True)
    amax = jnp.broadcast_to(tiles, a.reshape(*batch, n_i, BLOCK, n_o, BLOCK).shape)
    amax = amax.reshape(*batch, n_i * BLOCK, n_o * BLOCK)[..., :d_in, :d_out]
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  return jnp.broadcast_to(scale, (*batch, d_in, d_out)).reshape(x32.shape)


def fake_quant_weights(state, *, num_stacked_axes: int = 1, weight_scale: str = "tensor", fmt: str = "e4m3"):
  """FP8 fake-quant of every dense-layer weight of a Transformer param State.

  weight_scale "tensor": one scale per tensor; stacked layer weights [L, ...] get one per layer, i.e. the amax is
  taken over all axes but the first `num_stacked_axes` (a MoE layer's experts share it). "channel": one scale
  per output channel; "block128": one per 128 x 128 tile of the [in, out] matrix (q/k/v [D, H, hd] as
  [D, H*hd], o [H, hd, D] as [H*hd, D]); for both, leading layer and expert axes are batch axes. Embedding, LM
  head and norm scales are returned unchanged.

  Raises:
    ValueError: unknown `weight_scale` or `fmt`; or the State has a fused `qkv_proj`: one scale over the
      fused matrix is not the FP8 of the model; quantize first, then fuse (as `Sampler.prepare_params` does).
  """
  if weight_scale not in FP8_WEIGHT_SCALES:
    raise ValueError(f"weight_scale={weight_scale!r}; choose one of {FP8_WEIGHT_SCALES}")
  if fmt not in FP8_FORMATS:
    raise ValueError(f"fmt={fmt!r}; choose one of {tuple(FP8_FORMATS)}")
  dtype, fmax = FP8_FORMATS[fmt]

  def q(path, x):
    name = _path_name(path)
    if name in FUSED_WEIGHT_NAMES:
      raise ValueError(
          f"fake_quant_weights got a fused projection ({jax.tree_util.keystr(path)}); quantize the "
          "unfused State, then fuse it (minpro_jax.models.fuse_qkv_params)"
      )
    if name not in DENSE_WEIGHT_NAMES:
      return x
    x32 = x.astype(jnp.float32)
    if weight_scale == "tensor":
      amax = jnp.max(jnp.abs(x32), axis=tuple(range(num_stacked_axes, x.ndim)), keepdims=True)
      scale = jnp.where(amax > 0, amax / fmax, 1.0)
    else:
      scale = _matrix_scale(x32, *_MATRIX_AXES.get(name, (1, 1)), weight_scale, fmax)
    return _round(x32, scale, dtype).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(q, state)


def act_quant_mode(fp8_activations: bool | str = True, fp8_format: str = "e4m3") -> str:
  """The `ModelConfig.act_quant` of the sampler's FP8 activations: "token" | "tensor" | "none" (True = "token",
  False = "none") in `fp8_format`; e4m3 per token is "fp8".

  Raises:
    ValueError: an unknown `fp8_activations` or `fp8_format`.
  """
  act = ("token" if fp8_activations else "none") if isinstance(fp8_activations, bool) else fp8_activations
  if act not in FP8_ACTIVATIONS:
    raise ValueError(f"fp8_activations={fp8_activations!r}; choose one of {FP8_ACTIVATIONS} (or True / False)")
  if fp8_format not in FP8_FORMATS:
    raise ValueError(f"fp8_format={fp8_format!r}; choose one of {tuple(FP8_FORMATS)}")
  if act == "none":
    return "none"
  return "fp8" if (fp8_format, act) == ("e4m3", "token") else f"{fp8_format}_{act}"


def precision_config(
    config: ModelConfig, precision: str, *, fp8_activations: bool | str = True, fp8_format: str = "e4m3"
) -> ModelConfig:
  """The config of the sampler's forward for `precision` ("fp32" | "bf16" | "fp8").

  fp32 and bf16 set both `dtype` and `param_dtype`; fp8 computes in fp32 with fp8 fake-quantized weights
  (`prepare_inference_params`) and activations quantized dynamically per `fp8_activations` ("token" / True,
  "tensor", "none" / False) in `fp8_format` (`act_quant_mode`).

  Raises:
    ValueError: `precision` is not one of `PRECISIONS`, or an unknown fp8 option.
  """
  if precision == "fp32":
    return config.replace(dtype="float32", param_dtype="float32")
  if precision == "bf16":
    return config.replace(dtype="bfloat16", param_dtype="bfloat16")
  if precision == "fp8":
    act = act_quant_mode(fp8_activations, fp8_format)
    extra = {"act_quant": act} if hasattr(config, "act_quant") else {}
    return config.replace(dtype="float32", param_dtype="float32", **extra)
  raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")


def prepare_inference_params(
    state, precision: str, config: ModelConfig | None = None, *, weight_scale: str = "tensor", fmt: str = "e4m3"
):
  """The parameter State in the sampler's precision: cast (fp32 / bf16) and fake-quantized (fp8).

  `config` (the model's) tells whether layer weights are stacked ([L, ...], one fp8 scale per layer
  and tensor) or per-layer arrays; default stacked. fp8 uses `weight_scale` and `fmt` (`fake_quant_weights`).

  Raises:
    ValueError: `precision` is not one of `PRECISIONS`, or (fp8) the State is already fused or an fp8 option
      is unknown (`fake_quant_weights`).
  """
  stacked = 1 if config is None or config.stack_layers else 0
  if precision == "fp32":
    return jax.tree.map(lambda x: x.astype(jnp.float32), state)
  if precision == "bf16":
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
  if precision == "fp8":
    return fake_quant_weights(
        jax.tree.map(lambda x: x.astype(jnp.float32), state),
        num_stacked_axes=stacked,
        weight_scale=weight_scale,
        fmt=fmt,
    )
  raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")
