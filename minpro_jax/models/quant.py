"""Simulated ("fake") FP8 quantisation and the sampler's inference-precision conversions.

This is how the sampler's policy mu differs from the learner's pi at equal weights, as in MIPU (arXiv
2606.29526); the scheme mirrors vLLM's FP8 path. Every dense-layer weight (attention q/k/v/o, MLP
gate/up/down, MoE experts and router; NOT the embedding or LM head, NOT norms) is rounded to float8_e4m3fn
with a per-tensor scale amax / 448 and dequantized back; optionally each matmul input is quantized
dynamically per token the same way. Compute stays in the model's compute dtype. The e4m3 format (max finite
448) is that of Micikevicius et al. 2022, "FP8 Formats for Deep Learning".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minpro_jax.models.config import ModelConfig

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
PRECISIONS = ("fp32", "bf16", "fp8")
# Parameter paths (last key) that are dense-layer weights; stacked layers keep a leading L axis.
DENSE_WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router")
FUSED_WEIGHT_NAMES = ("qkv_proj",)  # the sampler's fused layout (models/inference_layout.py)


def fake_quant_e4m3(x: jax.Array, axis=None) -> jax.Array:
  """Quantize-dequantize x to float8_e4m3fn with scale amax(|x|, axis) / 448 (round to nearest even).

  Args:
    x: any float array.
    axis: reduction axes of the scale (None = one scale per tensor; -1 = per row/token).

  Returns:
    Array of x's shape and dtype holding e4m3-representable values times the scale. All-zero slices stay 0.
  """
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=axis is not None)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  q = (x32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)
  return (q * scale).astype(x.dtype)


def maybe_quant_act(x: jax.Array, mode: str) -> jax.Array:
  """Dynamic activation fake-quant at a matmul input: "none" -> x; "fp8" -> per-token e4m3 (last axis).

  Raises:
    ValueError: `mode` is neither "none" nor "fp8".
  """
  if mode == "none":
    return x
  if mode == "fp8":
    return fake_quant_e4m3(x, axis=-1)
  raise ValueError(f"act_quant={mode!r}; choose 'none' or 'fp8'")


def _path_name(path) -> str:
  for k in reversed(path):
    name = getattr(k, "key", getattr(k, "name", None))
    if isinstance(name, str) and name not in ("value", "raw_value"):
      return name
  return ""


def fake_quant_weights(state, *, num_stacked_axes: int = 1):
  """Per-tensor e4m3 fake-quant of every dense-layer weight of a Transformer param State.

  Stacked layer weights [L, ...] get one scale per layer (per tensor of each layer), i.e. the amax is taken
  over all axes but the first `num_stacked_axes`. Embedding, LM head and norm scales are returned unchanged.

  Raises:
    ValueError: the State has a fused `qkv_proj`: one scale over the fused matrix is not the per-tensor FP8
      of the model; quantize first, then fuse (as `Sampler.prepare_params` does).
  """

  def q(path, x):
    if _path_name(path) in FUSED_WEIGHT_NAMES:
      raise ValueError(
          f"fake_quant_weights got a fused projection ({jax.tree_util.keystr(path)}); quantize the "
          "unfused State, then fuse it (minpro_jax.models.fuse_qkv_params)"
      )
    if _path_name(path) not in DENSE_WEIGHT_NAMES:
      return x
    axes = tuple(range(num_stacked_axes, x.ndim))
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return ((x32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(q, state)


def precision_config(config: ModelConfig, precision: str, *, fp8_activations: bool = True) -> ModelConfig:
  """The config of the sampler's forward for `precision` ("fp32" | "bf16" | "fp8").

  fp32 and bf16 set both `dtype` and `param_dtype`; fp8 computes in fp32 with fp8 fake-quantized weights
  (`prepare_inference_params`) and, when `fp8_activations`, `act_quant="fp8"`.

  Raises:
    ValueError: `precision` is not one of `PRECISIONS`.
  """
  if precision == "fp32":
    return config.replace(dtype="float32", param_dtype="float32")
  if precision == "bf16":
    return config.replace(dtype="bfloat16", param_dtype="bfloat16")
  if precision == "fp8":
    extra = {"act_quant": "fp8" if fp8_activations else "none"} if hasattr(config, "act_quant") else {}
    return config.replace(dtype="float32", param_dtype="float32", **extra)
  raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")


def prepare_inference_params(state, precision: str, config: ModelConfig | None = None):
  """The parameter State in the sampler's precision: cast (fp32 / bf16) and fake-quantized (fp8).

  `config` (the model's) tells whether layer weights are stacked ([L, ...], one fp8 scale per layer
  and tensor) or per-layer arrays; default stacked.

  Raises:
    ValueError: `precision` is not one of `PRECISIONS`, or (fp8) the State is already fused
      (`fake_quant_weights`).
  """
  stacked = 1 if config is None or config.stack_layers else 0
  if precision == "fp32":
    return jax.tree.map(lambda x: x.astype(jnp.float32), state)
  if precision == "bf16":
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
  if precision == "fp8":
    return fake_quant_weights(jax.tree.map(lambda x: x.astype(jnp.float32), state), num_stacked_axes=stacked)
  raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")
