"""Simulated FP8 (e4m3) helpers: exact values on representable inputs, error bounds, which weights change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.quant import (
    fake_quant_e4m3,
    fake_quant_weights,
    maybe_quant_act,
    precision_config,
    prepare_inference_params,
)


def test_fake_quant_values():
  # amax 448 -> scale 1: e4m3-representable values are exact; 17 is not (3 mantissa bits): rounds to 16.
  x = jnp.array([448.0, -448.0, 1.0, 0.5, 0.0, -0.001953125, 17.0, 19.0])
  np.testing.assert_array_equal(np.asarray(fake_quant_e4m3(x)), [448, -448, 1, 0.5, 0, -0.001953125, 16, 20])
  # per-tensor scale: multiply by 2 -> same grid times 2
  np.testing.assert_array_equal(np.asarray(fake_quant_e4m3(2 * x)), 2 * np.asarray(fake_quant_e4m3(x)))
  assert np.all(np.asarray(fake_quant_e4m3(jnp.zeros(4))) == 0)  # no 0/0


def test_fake_quant_relative_error_bound():
  x = jax.random.normal(jax.random.key(0), (4096,))
  q = np.asarray(fake_quant_e4m3(x))
  x = np.asarray(x)
  normal = np.abs(x) / (np.abs(x).max() / 448.0) >= 2.0**-6  # inside e4m3's normal range
  rel = np.abs(q - x)[normal] / np.abs(x)[normal]
  assert rel.max() <= 2.0**-4 + 1e-7 and rel.mean() > 1e-3  # half an ulp of 3 mantissa bits; not identity


def test_per_token_activation_scale():
  x = jnp.array([[1.0, 17.0], [1000.0, 17000.0]])
  q = np.asarray(maybe_quant_act(x, "fp8"))
  np.testing.assert_allclose(q[1] / q[0], 1000.0, rtol=1e-6)  # each row scaled by its own amax
  assert maybe_quant_act(x, "none") is x
  with pytest.raises(ValueError, match="act_quant"):
    maybe_quant_act(x, "int8")


def test_weights_quantized_except_embedding_and_norms():
  state = nnx.split(init_model(get_preset("tiny"), 0))[1]
  q = fake_quant_weights(state)
  flat, qflat = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(q))
  changed = {
      "/".join(map(str, k)) for k in flat if not np.array_equal(np.asarray(flat[k][...]), np.asarray(qflat[k][...]))
  }
  assert {
      "layers/attn/q_proj",
      "layers/attn/k_proj",
      "layers/attn/v_proj",
      "layers/attn/o_proj",
      "layers/mlp/gate_proj",
      "layers/mlp/up_proj",
      "layers/mlp/down_proj",
  } == changed
  # one scale per layer: layer 1 quantized alone equals its slice of the stacked result
  w = flat[("layers", "attn", "q_proj")][...]
  np.testing.assert_array_equal(
      np.asarray(fake_quant_e4m3(w[1])), np.asarray(qflat[("layers", "attn", "q_proj")][...][1])
  )


def test_precision_config_and_cast():
  cfg = get_preset("tiny")
  assert precision_config(cfg, "bf16").dtype == "bfloat16"
  assert precision_config(cfg, "fp8").act_quant == "fp8"
  assert precision_config(cfg, "fp8", fp8_activations=False).act_quant == "none"
  state = nnx.split(init_model(cfg, 0))[1]
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(prepare_inference_params(state, "bf16")))
  with pytest.raises(ValueError, match="precision"):
    precision_config(cfg, "fp4")


def test_fp8_scales_are_per_layer_in_both_layouts():
  """fp8 of the stacked State then unstacking == unstacking then fp8 of the per-layer State (one scale per
  layer and tensor either way), and layers with different ranges get different scales."""
  from minpro_jax.models.inference_layout import unstack_layer_params

  cfg = get_preset("tiny")
  state = nnx.split(init_model(cfg, seed=1))[1]
  state["layers"]["mlp"]["up_proj"].value = (
      state["layers"]["mlp"]["up_proj"][...] * jnp.array([1.0, 7.0])[:, None, None]
  )
  flat_cfg = cfg.replace(stack_layers=False)
  a = unstack_layer_params(prepare_inference_params(state, "fp8", cfg), cfg)
  b = prepare_inference_params(unstack_layer_params(state, cfg), "fp8", flat_cfg)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):  # equal up to 1 ulp (x / s * s order of rounding)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=3e-7, atol=0)
  up0, up1 = (np.asarray(a["layers"][i]["mlp"]["up_proj"][...]) for i in (0, 1))
  grid = lambda w: np.unique(np.abs(w)).size
  assert grid(up0) <= 256 and grid(up1) <= 256  # e4m3 has at most 2^7 magnitudes (+ scale): quantized
  assert np.abs(up1).max() > 5 * np.abs(up0).max()  # not one shared scale squashing layer 0
