"""FP8 sampler options (`models.quant`): weight scales per tensor / channel / 128-block, e4m3 / e5m2, activations per
token / tensor / none; hand-computed vectors, the default equal to the per-tensor e4m3 scheme, the sampler and
config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import load_default_config

from minpro_jax.models import get_preset, init_model, token_logprobs
from minpro_jax.models.quant import act_quant_mode, fake_quant, fake_quant_weights, maybe_quant_act
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.run.run_config import ConfigError
from minpro_jax.run.sampler_setup import sampler_fp8_options
from minpro_jax.sampling import Sampler, SamplingParams

CFG = get_preset("tiny")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400]]
S = 2.0**-9  # smallest e4m3 subnormal


def _q(w, scale, name="gate_proj", fmt="e4m3", stacked=0):
  return np.asarray(
      fake_quant_weights({name: jnp.asarray(w)}, num_stacked_axes=stacked, weight_scale=scale, fmt=fmt)[name]
  )


# [in=4, out=4]: column amaxes 448, 896, 0, 224; 17 and 34 are not e4m3 (ties round to even: 16, 32)
W44 = np.array(
    [[448, 896, 0, -224], [17, 34, 0, 1], [1, 2, 0, 0.5], [0, 0, 0, 0.0025]],
    np.float32,
)


def test_tensor_and_channel_scales_by_hand():
  # per tensor: scale 896 / 448 = 2; 17 / 2 = 8.5 -> 8 -> 16; 0.0025 / 2 = 0.64 S -> S -> 2 S
  want_t = W44.copy()
  want_t[1, 0], want_t[1, 1], want_t[3, 3] = 16, 32, 2 * S
  np.testing.assert_array_equal(_q(W44, "tensor"), want_t)
  # per output channel: scales 1, 2, (0: stays 0), 0.5; 0.0025 / 0.5 = 2.56 S -> 3 S -> 1.5 S
  want_c = want_t.copy()
  want_c[3, 3] = 1.5 * S
  np.testing.assert_array_equal(_q(W44, "channel"), want_c)
  assert _q(W44, "block128")[3, 3] == 2 * S  # one 128 x 128 tile covers all of it: the per-tensor scale
  np.testing.assert_array_equal(_q(W44, "block128"), want_t)


def _w130():
  w = np.zeros((130, 3), np.float32)
  w[0, 0], w[5, 1], w[6, 2] = 448, 17, 0.0025  # input rows 0..127: tile amax 448, scale 1
  w[128, 2], w[129, 0] = 896, 34  # rows 128..129 (the padded last tile): amax 896, scale 2
  return w


def test_block128_scales_by_hand_with_a_partial_tile():
  w = _w130()
  got = _q(w, "block128")
  want = w.copy()
  want[5, 1], want[6, 2] = 16, S  # scale 1: 17 -> 16; 0.0025 = 1.28 S -> S
  want[129, 0] = 32  # scale 2: 34 / 2 = 17 -> 16
  np.testing.assert_array_equal(got, want)
  # per channel: column scales 1, 17 / 448, 2 -> 0.0025 / 2 -> 2 S; 34 at scale 1 -> 32
  ch = _q(w, "channel")
  assert ch[6, 2] == 2 * S and ch[129, 0] == 32 and ch[5, 1] == 17 and ch[128, 2] == 896
  # per tensor: scale 2 -> 17 -> 16, 0.0025 -> 2 S
  t = _q(w, "tensor")
  assert t[5, 1] == 16 and t[6, 2] == 2 * S


def test_block128_zero_tiles_and_batch_axes():
  w = _w130()
  w2 = w.copy()
  w2[128:] = 0  # layer 1's last tile is all zero
  stacked = np.stack([w, w2])  # [L, D, F]
  got = _q(stacked, "block128", stacked=1)
  np.testing.assert_array_equal(got[0], _q(w, "block128"))
  np.testing.assert_array_equal(got[1], _q(w2, "block128"))
  assert np.all(got[1, 128:] == 0) and np.all(np.isfinite(got))
  # MoE experts [L, E, D, F]: every (layer, expert) its own matrices
  experts = np.stack([stacked, 2 * stacked], axis=1)
  for scale in ("channel", "block128"):
    got = _q(experts, scale, stacked=1)
    for i in range(2):
      for e in range(2):
        np.testing.assert_array_equal(got[i, e], _q(experts[i, e], scale))


def test_multi_axis_projections_are_tiled_as_in_x_out_matrices():
  w = _w130()
  # o_proj [H, hd, D]: input H * hd = 130, output D = 3
  for scale in ("channel", "block128"):
    np.testing.assert_array_equal(_q(w.reshape(2, 65, 3), scale, "o_proj").reshape(130, 3), _q(w, scale))
  # q_proj [D, H, hd]: input D, output H * hd
  wq = np.random.RandomState(0).randn(130, 2, 96).astype(np.float32)
  for scale in ("channel", "block128"):
    np.testing.assert_array_equal(
        _q(wq, scale, "q_proj").reshape(130, 192), _q(wq.reshape(130, 192), scale, "down_proj")
    )


def test_e5m2_values_at_and_beyond_max():
  # e5m2 (2 mantissa bits, max 57344): 4.5 -> 4, 9 -> 8, 11 -> 12 (ties to even), 5 / 7 / 10 / 0.75 exact
  x = np.array([57344, -57344, 4.5, 9, 11, 5, 7, 10, 0.75, 0], np.float32)
  want = np.array([57344, -57344, 4, 8, 12, 5, 7, 10, 0.75, 0], np.float32)
  np.testing.assert_array_equal(np.asarray(fake_quant(jnp.asarray(x), fmt="e5m2")), want)
  np.testing.assert_array_equal(np.asarray(fake_quant(jnp.asarray(4 * x), fmt="e5m2")), 4 * want)  # beyond max
  np.testing.assert_array_equal(_q(x[:, None], "channel", fmt="e5m2")[:, 0], want)
  # e4m3 keeps 9 / 11 exactly once amax is 448 (3 mantissa bits), 4x beyond max scales by 4
  y = np.array([448, 9, 11, 17], np.float32)
  np.testing.assert_array_equal(np.asarray(fake_quant(jnp.asarray(4 * y))), 4 * np.array([448, 9, 11, 16]))
  assert np.all(np.asarray(fake_quant(jnp.zeros(3), fmt="e5m2")) == 0)


def test_activation_modes():
  x = jnp.asarray(np.array([[448.0, 17.0], [0.5, 0.0025]], np.float32))
  # per token: row 1's scale 0.5 / 448 puts 0.0025 at 2.24 -> 2.25 (e4m3 step 0.25 in [2, 4))
  row1 = np.float32(2.25) * (np.float32(0.5) / np.float32(448))
  np.testing.assert_array_equal(np.asarray(maybe_quant_act(x, "fp8")), np.array([[448, 16], [0.5, row1]], np.float32))
  # per tensor: one scale 1 for both rows: 0.0025 -> S
  np.testing.assert_array_equal(np.asarray(maybe_quant_act(x, "e4m3_tensor")), [[448, 16], [0.5, S]])
  np.testing.assert_array_equal(np.asarray(maybe_quant_act(x, "e5m2_token")), np.asarray(fake_quant(x, -1, "e5m2")))
  np.testing.assert_array_equal(np.asarray(maybe_quant_act(x, "e5m2_tensor")), np.asarray(fake_quant(x, None, "e5m2")))
  assert act_quant_mode() == act_quant_mode("token") == "fp8"
  assert act_quant_mode(False) == act_quant_mode("none", "e5m2") == "none"
  assert act_quant_mode("tensor", "e5m2") == "e5m2_tensor"
  with pytest.raises(ValueError, match="fp8_activations"):
    act_quant_mode("channel")
  with pytest.raises(ValueError, match="weight_scale"):
    _q(W44, "row")


def _old_fake_quant_weights(state, num_stacked_axes=1):
  """The per-tensor e4m3 weight fake-quant before the options existed (verbatim but for the fused check)."""
  names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router")

  def q(path, x):
    name = next((k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str) and k.key != "value"), "")
    if name not in names:
      return x
    axes = tuple(range(num_stacked_axes, x.ndim))
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return ((x32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(q, state)


@pytest.mark.parametrize(
    "cfg", [CFG, get_preset("tiny", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)]
)
def test_default_equals_the_old_per_tensor_scheme(cfg):
  state = nnx.split(init_model(cfg, 0))[1]
  for a, b in zip(jax.tree.leaves(fake_quant_weights(state)), jax.tree.leaves(_old_fake_quant_weights(state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def model_state():
  model = init_model(CFG, seed=3)
  return model, nnx.split(model)[1]


OPTIONS = [
    ("channel", "e4m3", "token"),
    ("block128", "e4m3", "token"),
    ("tensor", "e5m2", "token"),
    ("tensor", "e4m3", "tensor"),
    ("tensor", "e4m3", "none"),
]


@pytest.mark.parametrize("scale,fmt,act", OPTIONS)
def test_sampler_options_give_small_nonzero_mismatch(model_state, scale, fmt, act):
  model, state = model_state
  s = Sampler(CFG, precision="fp8", prompt_buckets=(16,), fp8_weight_scale=scale, fp8_format=fmt, fp8_activations=act)
  b = s.generate(state, PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), seed=0, group_size=2)
  la = RolloutBatch.from_generation(b, rewards=np.zeros(len(b)), advantages=np.zeros(len(b)))
  lp = token_logprobs(model, jnp.asarray(la.tokens), jnp.asarray(la.segment_ids), jnp.asarray(la.positions))
  m = la.response_mask
  delta = np.asarray(lp.logp)[m] - la.behavior_logp[m]
  assert 0 < np.mean(np.abs(delta)) < 0.1


def test_sampler_signature_names_the_fp8_option(model_state):
  _, state = model_state
  prepared = Sampler(CFG, precision="fp8", prompt_buckets=(16,), fp8_weight_scale="block128").prepare_params(state)
  with pytest.raises(ValueError, match=r"another fp8_weight_scale \('block128', this Sampler: 'tensor'\)"):
    Sampler(CFG, precision="fp8", prompt_buckets=(16,)).prepare_params(prepared)
  # explicit defaults are the default sampler
  default = Sampler(CFG, precision="fp8", prompt_buckets=(16,)).prepare_params(state)
  Sampler(CFG, precision="fp8", prompt_buckets=(16,), fp8_activations="token", fp8_format="e4m3").prepare_params(
      default
  )
  with pytest.raises(ValueError, match="fp8_format"):
    Sampler(CFG, precision="fp8", fp8_format="e3m4")


def test_config_fields_validated():
  c = load_default_config()
  assert sampler_fp8_options(c) == dict(fp8_weight_scale="tensor", fp8_format="e4m3", fp8_activations="token")
  c.sampling.fp8_weight_scale = "row"
  with pytest.raises(ConfigError, match=r"sampling.fp8_weight_scale.*'row'.*tensor.*channel.*block128"):
    sampler_fp8_options(c)
  c.sampling.fp8_weight_scale = "block128"  # changed from the default while precision is fp32
  with pytest.raises(ConfigError, match=r"sampling.fp8_weight_scale.*needs sampling.precision='fp8'"):
    sampler_fp8_options(c)
  c.sampling.precision = "fp8"
  c.sampling.fp8_format, c.sampling.fp8_activations = "e5m2", "tensor"
  assert sampler_fp8_options(c) == dict(fp8_weight_scale="block128", fp8_format="e5m2", fp8_activations="tensor")
  c.sampling.fp8_activations = "channel"
  with pytest.raises(ConfigError, match="sampling.fp8_activations"):
    sampler_fp8_options(c)
