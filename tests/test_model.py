"""Model correctness: sharding layouts, chunked log-probs, KV cache, scan/remat, bf16, MoE, masking, bad input.

Runs on the 8 virtual CPU devices of conftest.py, fp32 with highest matmul precision.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import KVCache, ModelConfig, get_preset, segment_positions, token_logprobs
from minpro_jax.models.attention_core import causal_block_attention, masked_attention
from minpro_jax.models.dense import dense
from minpro_jax.models.hf_io import (
    DictSource,
    hf_tensor_shapes,
    load_from_source,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from minpro_jax.models.inference_layout import fuse_qkv_params, unstack_layer_params
from minpro_jax.models.moe import MoE
from minpro_jax.models.quant import fake_quant_weights
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.sharding import make_mesh, use_mesh


def _random_weights(config, seed):
  """HF-named random weights: norm scales around 1, matrices ~ N(0, 1/fan_in), so every path matters."""
  rng = np.random.RandomState(seed)
  out = {}
  for name, shape in hf_tensor_shapes(config).items():
    w = 1.0 + 0.2 * rng.randn(*shape) if len(shape) == 1 else rng.randn(*shape) / np.sqrt(shape[-1])
    out[name] = w.astype(np.float32)
  return out


def _model(name="tiny", seed=0, mesh=None, **overrides):
  """A randomised model built through the streaming loader (fast: no init compile), optionally on a mesh."""
  config = get_preset(name, **overrides)
  return load_from_source(DictSource(_random_weights(config, seed)), config, mesh=mesh)


_fwd = nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s).out)


def _tokens(b=8, t=10, v=512, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, v, (b, t)), jnp.int32)


def _left_pad_segments(b=8, t=10):
  seg = np.ones((b, t), np.int32)
  for i in range(b):
    seg[i, : i % 4] = 0
  return jnp.asarray(seg)


# ------------------------------------------------------------------------------------------------ sharding

LAYOUTS = [
    ("tiny", {"data": 8}),
    ("tiny", {"fsdp": 8}),
    ("tiny", {"tensor": 2, "data": 4}),
    ("tiny", {"tensor": 2, "fsdp": 2, "data": 2}),
    ("tiny-llama", {"fsdp": 4, "data": 2}),
    ("tiny-moe", {"expert": 4, "data": 2}),
    ("tiny-moe", {"expert": 2, "fsdp": 2, "tensor": 2}),
]


@pytest.mark.parametrize(
    "name,layout", LAYOUTS, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in l.items())}" for n, l in LAYOUTS]
)
def test_sharded_logits_equal_single_device(name, layout):
  tokens, seg = _tokens(), _left_pad_segments()
  ref = np.asarray(nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s).out)(_model(name), tokens, seg))
  mesh = make_mesh(layout)
  with use_mesh(mesh):
    model = _model(name, mesh=mesh)
    out = nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s).out)(model, tokens, seg)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)
  q = model.layers.attn.q_proj[...]
  spec = q.sharding.spec
  d_local = q.addressable_shards[0].data.shape
  if "fsdp" in layout:
    assert spec[1] == "fsdp" and d_local[1] == q.shape[1] // layout["fsdp"]
  if "tensor" in layout:
    assert spec[2] == "tensor" and d_local[2] == q.shape[2] // layout["tensor"]
  if "expert" in layout:
    g = model.layers.mlp.gate_proj[...]
    assert g.sharding.spec[1] == "expert"
    assert g.addressable_shards[0].data.shape[1] == g.shape[1] // layout["expert"]
  if set(layout) == {"data"}:
    assert all(a is None for a in spec)  # pure data parallel: weights replicated


def test_sharded_load_streams_onto_mesh(tmp_path):
  """An HF MoE checkpoint loads onto an expert x fsdp x tensor mesh with the ragged dispatch (the default for every
  source) and gives the dense dispatch's logits."""
  model = _model("tiny-moe", tie_embeddings=False, moe_impl="dense")
  save_hf_checkpoint(model, str(tmp_path))
  tokens, seg = _tokens(), _left_pad_segments()
  ref = np.asarray(_fwd(model, tokens, seg))
  mesh = make_mesh({"expert": 2, "fsdp": 2, "tensor": 2})
  loaded, _ = load_hf_checkpoint(str(tmp_path), mesh=mesh)
  assert loaded.config.moe_impl == "ragged"
  g = loaded.layers.mlp.gate_proj[...]
  assert g.sharding.mesh.shape == mesh.shape and g.sharding.spec[1:] == ("expert", "fsdp", "tensor")
  assert g.addressable_shards[0].data.shape == (2, 4, 32, 16)
  with use_mesh(mesh):
    out = nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s).out)(loaded, tokens, seg)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ log-probs


def test_chunked_logprobs_equal_dense_and_log_softmax():
  model = _model("tiny")
  tokens, seg = _tokens(t=13), _left_pad_segments(t=13)
  lp = nnx.jit(token_logprobs, static_argnames=("chunk_size", "return_entropy", "temperature"))
  dense = lp(model, tokens, seg, chunk_size=1024, return_entropy=True)
  chunked = lp(model, tokens, seg, chunk_size=5, return_entropy=True)  # 12 = 5 + 5 + 2 (padded)
  np.testing.assert_allclose(np.asarray(chunked.logp), np.asarray(dense.logp), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(chunked.entropy), np.asarray(dense.entropy), atol=1e-5, rtol=0)
  logits = np.asarray(_fwd(model, tokens, seg), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  logp = logits - logz[..., None]
  want = np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(chunked.logp)[:, 1:], want, atol=1e-5, rtol=0)
  ent = -(np.exp(logp) * logp).sum(-1)[:, :-1]
  np.testing.assert_allclose(np.asarray(chunked.entropy)[:, 1:], ent, atol=1e-5, rtol=0)
  # temperature: scores the tempered distribution
  hot = lp(model, tokens, seg, chunk_size=4, temperature=0.7).logp
  lt = logits / 0.7
  lt = lt - (np.log(np.exp(lt - lt.max(-1, keepdims=True)).sum(-1)) + lt.max(-1))[..., None]
  want_t = np.take_along_axis(lt[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(hot)[:, 1:], want_t, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ cache / scan / remat


@pytest.mark.parametrize("name,scan", [("tiny", False), ("tiny-moe", True)])
def test_cache_decode_equals_full_forward(name, scan):
  model = _model(name, scan_layers=scan)
  tokens, seg = _tokens(b=4, t=9), _left_pad_segments(b=4, t=9)
  full = np.asarray(_fwd(model, tokens, seg))
  pos = segment_positions(seg)
  cache = KVCache.zeros(model.config, 4, 12)
  step = nnx.jit(lambda m, x, p, s, c, i: m(x, p, s, cache=c, cache_index=i))
  out = step(model, tokens[:, :5], pos[:, :5], seg[:, :5], cache, jnp.int32(0))
  steps = [np.asarray(out.out)]
  cache = out.cache
  for i in range(5, 9):
    out = step(model, tokens[:, i : i + 1], pos[:, i : i + 1], seg[:, i : i + 1], cache, jnp.int32(i))
    cache = out.cache
    steps.append(np.asarray(out.out))
  got = np.concatenate(steps, axis=1)
  real = np.asarray(seg).astype(bool)
  np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(cache.segment_ids)[:, :9], np.asarray(seg))


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_unstacked_layers_equal_stacked_with_and_without_cache(name):
  """`unstack_layer_params` + a stack_layers=False model: same logits, same cached decode, per-layer cache."""
  model = _model(name)
  flat_config = model.config.replace(stack_layers=False)
  state = jax.jit(lambda s: unstack_layer_params(s, model.config))(nnx.split(model)[1])
  with nnx.use_eager_sharding(False):
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(flat_config, rngs=nnx.Rngs(0))))[0]
  flat = nnx.merge(graphdef, state)
  assert len(flat.layers) == model.config.num_layers
  np.testing.assert_array_equal(np.asarray(flat.layers[1].attn.q_proj[...]), np.asarray(model.layers.attn.q_proj[1]))
  tokens, seg = _tokens(b=4, t=9), _left_pad_segments(b=4, t=9)
  np.testing.assert_allclose(np.asarray(_fwd(flat, tokens, seg)), np.asarray(_fwd(model, tokens, seg)), atol=1e-6)
  pos = segment_positions(seg)
  step = nnx.jit(lambda m, x, p, s, c, i: m(x, p, s, cache=c, cache_index=i))
  outs = {}
  for m in (model, flat):
    cache = KVCache.zeros(m.config, 4, 12)
    out = step(m, tokens[:, :8], pos[:, :8], seg[:, :8], cache, jnp.int32(0))
    out = step(m, tokens[:, 8:], pos[:, 8:], seg[:, 8:], out.cache, jnp.int32(8))
    outs[m.config.stack_layers] = out
  assert isinstance(outs[False].cache.k, tuple) and outs[False].cache.k[0].shape == (
      4,
      2,
      16,
      12,
  )  # fp32: [B, K, hd, S]
  np.testing.assert_allclose(np.asarray(outs[False].out), np.asarray(outs[True].out), atol=1e-6)
  for i in range(model.config.num_layers):
    np.testing.assert_allclose(np.asarray(outs[False].cache.k[i]), np.asarray(outs[True].cache.k[i]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(outs[False].cache.v[i]), np.asarray(outs[True].cache.v[i]), atol=1e-6)
  with pytest.raises(ValueError, match="stack_layers"):
    flat(tokens, cache=KVCache.zeros(model.config, 4, 12))
  with pytest.raises(ValueError, match="rope tables"):
    flat(tokens, rope=(jnp.zeros((4, 9, 3)), jnp.zeros((4, 9, 3))))
  with pytest.raises(ValueError, match="stacked config"):
    unstack_layer_params(state, flat_config)
  with pytest.raises(ValueError, match="scan_layers=True needs stack_layers=True"):
    model.config.replace(stack_layers=False, scan_layers=True)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-llama"])
def test_fused_qkv_holds_the_same_weights_and_gives_the_same_outputs(name):
  """`fuse_qkv_params`: each q/k/v value lands where the fused forward reads it (KV head k's query heads
  k*G .. k*G+G-1, then its key, then its value), and the fused model equals the unfused one, with and
  without a cache."""
  model = _model(name)
  c = model.config
  flat_config = c.replace(stack_layers=False)
  flat_state = jax.jit(lambda s: unstack_layer_params(s, c))(nnx.split(model)[1])
  fused_state = jax.jit(lambda s: fuse_qkv_params(s, flat_config))(flat_state)
  graphdefs = {}
  for fuse in (False, True):
    with nnx.use_eager_sharding(False):
      graphdefs[fuse] = nnx.split(
          nnx.eval_shape(lambda fuse=fuse: Transformer(flat_config.replace(fuse_qkv=fuse), rngs=nnx.Rngs(0)))
      )[0]
  flat, fused = nnx.merge(graphdefs[False], flat_state), nnx.merge(graphdefs[True], fused_state)
  g = c.num_heads // c.num_kv_heads
  for i in range(c.num_layers):
    qkv = np.asarray(fused.layers[i].attn.qkv_proj[...])
    assert qkv.shape == (c.hidden_size, c.num_kv_heads, g + 2, c.head_dim)
    q = np.asarray(model.layers.attn.q_proj[i])
    for k in range(c.num_kv_heads):
      for j in range(g):
        np.testing.assert_array_equal(qkv[:, k, j], q[:, k * g + j])
      np.testing.assert_array_equal(qkv[:, k, g], np.asarray(model.layers.attn.k_proj[i])[:, k])
      np.testing.assert_array_equal(qkv[:, k, g + 1], np.asarray(model.layers.attn.v_proj[i])[:, k])
    assert not hasattr(fused.layers[i].attn, "q_proj")
  tokens, seg = _tokens(b=4, t=9), _left_pad_segments(b=4, t=9)
  np.testing.assert_allclose(np.asarray(_fwd(fused, tokens, seg)), np.asarray(_fwd(model, tokens, seg)), atol=1e-5)
  pos = segment_positions(seg)
  step = nnx.jit(lambda m, x, p, s, cache, i: m(x, p, s, cache=cache, cache_index=i))
  outs = []
  for m in (flat, fused):
    out = step(m, tokens[:, :8], pos[:, :8], seg[:, :8], KVCache.zeros(m.config, 4, 12), jnp.int32(0))
    outs.append(step(m, tokens[:, 8:], pos[:, 8:], seg[:, 8:], out.cache, jnp.int32(8)))
  np.testing.assert_allclose(np.asarray(outs[1].out), np.asarray(outs[0].out), atol=1e-5)
  for i in range(c.num_layers):
    np.testing.assert_allclose(np.asarray(outs[1].cache.k[i]), np.asarray(outs[0].cache.k[i]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs[1].cache.v[i]), np.asarray(outs[0].cache.v[i]), atol=1e-5)


def test_fused_qkv_bad_input():
  model = _model("tiny")
  with pytest.raises(ValueError, match="fuse_qkv=True.*needs stack_layers=False"):
    model.config.replace(fuse_qkv=True)
  with pytest.raises(ValueError, match="per-layer, unfused config.*unstack_layer_params first"):
    fuse_qkv_params(nnx.split(model)[1], model.config)
  flat_config = model.config.replace(stack_layers=False)
  with pytest.raises(ValueError, match=r"has keys .*expected the per-layer indices 0..1; a stacked State"):
    fuse_qkv_params(nnx.split(model)[1], flat_config)
  flat = unstack_layer_params(nnx.split(model)[1], model.config)
  with pytest.raises(
      ValueError, match=r"layers\[0\]\.attn\.q_proj has shape \(64, 4, 16\), the config gives " r"\(64, 8, 8\)"
  ):
    fuse_qkv_params(flat, flat_config.replace(num_heads=8, head_dim=8))
  fused = fuse_qkv_params(flat, flat_config)
  with pytest.raises(ValueError, match=r"layers\[0\]\.attn has no q_proj .*already fused"):
    fuse_qkv_params(fused, flat_config)
  with pytest.raises(ValueError, match=r"fused projection \(.*qkv_proj.*\); quantize the unfused State"):
    fake_quant_weights(fused, num_stacked_axes=0)


def _loss(model, tokens, seg):
  return -jnp.sum(token_logprobs(model, tokens, seg, chunk_size=4).logp * seg)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_scan_equals_loop_and_remat_keeps_gradients(name):
  tokens, seg = _tokens(b=4, t=8), _left_pad_segments(b=4, t=8)
  ref_model = _model(name)
  ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(_loss))(ref_model, tokens, seg)
  ref_leaves = jax.tree.leaves(ref_grads)
  assert all(float(jnp.abs(g).max()) > 0 for g in ref_leaves)
  for overrides in ({"scan_layers": True}, {"remat": "block"}, {"remat": "block", "scan_layers": True}):
    m = _model(name, **overrides)
    loss, grads = nnx.jit(nnx.value_and_grad(_loss))(m, tokens, seg)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), overrides
    for g, r in zip(jax.tree.leaves(grads), ref_leaves):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-5, err_msg=str(overrides))


# bf16 compute (fp32 log-softmax) vs fp32 on the randomised tiny models (logits std ~1, |logp| ~ 6.5 nats).
# Measured on this batch (64 real tokens): max |dlogp| 0.044 (tiny) / 0.079 (tiny-moe, where bf16 rounding can
# flip near-tied top-k routing), mean 0.0093 / 0.0105; bf16 has an 8-bit mantissa (rel. error 2^-9 per rounding).
# Bounds: ~2x the measured max, and a mean bound that catches a systematic error the max bound would hide.
BF16_LOGP_MAX_ATOL = {"tiny": 0.1, "tiny-moe": 0.16}
BF16_LOGP_MEAN_ATOL = 0.02


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_bf16_compute_close_to_fp32(name):
  tokens, seg = _tokens(), _left_pad_segments()
  real = np.asarray(seg).astype(bool)
  ref = np.asarray(token_logprobs(_model(name), tokens, seg).logp)
  for overrides in ({"dtype": "bfloat16"}, {"dtype": "bfloat16", "param_dtype": "bfloat16"}):
    model = _model(name, **overrides)
    got = token_logprobs(model, tokens, seg)
    assert got.logp.dtype == jnp.float32  # log-softmax stays fp32
    assert model.layers.attn.q_proj[...].dtype == model.config.jnp_param_dtype
    err = np.abs(np.asarray(got.logp) - ref)[real]
    assert 0 < err.max() <= BF16_LOGP_MAX_ATOL[name], (overrides, err.max())
    assert err.mean() <= BF16_LOGP_MEAN_ATOL, (overrides, err.mean())


# ------------------------------------------------------------------------------------------------ MoE


def test_ragged_moe_equals_dense_moe():
  tokens, seg = _tokens(), _left_pad_segments()
  dense = _model("tiny-moe", moe_impl="dense")
  ragged = _model("tiny-moe", moe_impl="ragged")
  run = nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s))
  a, b = run(dense, tokens, seg), run(ragged, tokens, seg)
  np.testing.assert_allclose(np.asarray(b.out), np.asarray(a.out), atol=1e-5, rtol=0)
  np.testing.assert_allclose(float(b.router_aux_loss), float(a.router_aux_loss), rtol=1e-6)
  ga = nnx.jit(nnx.grad(_loss))(dense, tokens, seg)
  gb = nnx.jit(nnx.grad(_loss))(ragged, tokens, seg)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-5)


MOE_LAYOUTS = [{"fsdp": 8}, {"expert": 4, "data": 2}, {"expert": 2, "fsdp": 2, "tensor": 2}, {"tensor": 2, "data": 4}]


@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in l.items()) for l in MOE_LAYOUTS])
def test_sharded_ragged_moe_gradients_equal_single_device(layout):
  """The per-device routing (tokens sorted on their own device, experts split over `expert`, their width over
  `tensor`) gives the single-device loss and every parameter's gradient."""
  tokens, seg = _tokens(), _left_pad_segments()
  want_loss, want = nnx.jit(nnx.value_and_grad(_loss))(_model("tiny-moe"), tokens, seg)
  mesh = make_mesh(layout)
  with use_mesh(mesh):
    got_loss, got = nnx.jit(nnx.value_and_grad(_loss))(_model("tiny-moe", mesh=mesh), tokens, seg)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-5)


def test_sharded_ragged_moe_sorts_each_devices_tokens_only():
  """On fsdp=8 every sort in the compiled forward is over one device's N/8 * k assignments: a sort over the whole
  batch's N * k (what a global argsort partitions to) would hold every token's k copies on every chip."""
  b, t = 8, 16
  cfg = get_preset("tiny-moe")
  tokens, seg = _tokens(b=b, t=t), _left_pad_segments(b=b, t=t)
  mesh = make_mesh({"fsdp": 8})
  with use_mesh(mesh):
    hlo = nnx.jit(lambda m, x, s: m(x, segment_ids_bt=s).out).lower(_model("tiny-moe", mesh=mesh), tokens, seg)
    hlo = hlo.compile().as_text()
  sizes = {int(n) for n in re.findall(r"= \(s32\[(\d+)\][^)]*\) sort\(", hlo)}
  assert sizes == {b * t // 8 * cfg.num_experts_per_tok}, sizes


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_block_and_aux_loss_match_numpy(norm_topk):
  cfg = get_preset("tiny-moe", norm_topk_prob=norm_topk)
  with nnx.use_eager_sharding(False):
    moe = MoE(cfg, rngs=nnx.Rngs(3))
  rng = np.random.RandomState(0)
  router = rng.randn(64, 8).astype(np.float32) * 0.5
  moe.router[...] = jnp.asarray(router)
  x = rng.randn(2, 5, 64).astype(np.float32)
  valid = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
  y, aux, _ = moe(jnp.asarray(x), jnp.asarray(valid))
  wg, wu, wd = (np.asarray(moe.gate_proj[...]), np.asarray(moe.up_proj[...]), np.asarray(moe.down_proj[...]))
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  f_e, p_e, n = np.zeros(e), np.zeros(e), valid.sum()
  for bi in range(2):
    for ti in range(5):
      h = x[bi, ti].astype(np.float64)
      logits = h @ router
      p = np.exp(logits - logits.max())
      p /= p.sum()
      top = np.argsort(-p)[:k]
      w = p[top] / p[top].sum() if norm_topk else p[top]
      want = sum(wi * (((s := h @ wg[ei]) / (1 + np.exp(-s)) * (h @ wu[ei])) @ wd[ei]) for wi, ei in zip(w, top))
      np.testing.assert_allclose(np.asarray(y[bi, ti]), want, atol=1e-5, rtol=1e-5)
      if valid[bi, ti]:
        f_e[top] += 1.0 / n
        p_e += p / n
  np.testing.assert_allclose(float(aux), e * np.sum(f_e * p_e), rtol=1e-5)
  # perfectly balanced routing gives the minimum k (uniform probs: f_e = k/E, P_e = 1/E)
  moe.router[...] = jnp.zeros_like(moe.router[...])
  _, aux_uniform, _ = moe(jnp.asarray(x), jnp.asarray(valid))
  np.testing.assert_allclose(float(aux_uniform), k, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ masking


def test_dense_equals_einsum_values_and_gradients():
  """The flattened 2-D projection gives the einsum's values and gradients for every form the model uses."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(2, 3, 4, 5), jnp.float32)
  cases = [  # (w, dense kwargs, einsum of the same contraction)
      (rng.randn(5, 6), {}, "abcd,df->abcf"),
      (rng.randn(5, 2, 3), {}, "abcd,dhk->abchk"),
      (rng.randn(4, 5, 6), {"n_in": 2}, "abcd,cdf->abf"),
      (rng.randn(6, 5), {"w_transposed": True}, "abcd,fd->abcf"),
  ]
  for w, kw, eq in cases:
    w = jnp.asarray(w, jnp.float32)
    f_dense = lambda x, w: jnp.sum(jnp.sin(dense(x, w, **kw)))
    f_ref = lambda x, w: jnp.sum(jnp.sin(jnp.einsum(eq, x, w)))
    np.testing.assert_allclose(dense(x, w, **kw), jnp.einsum(eq, x, w), rtol=1e-6, atol=1e-6)
    for g, r in zip(jax.grad(f_dense, (0, 1))(x, w), jax.grad(f_ref, (0, 1))(x, w)):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  out = dense(x.astype(jnp.bfloat16), jnp.ones((5, 6), jnp.bfloat16), preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32 and out.shape == (2, 3, 4, 6)
  with pytest.raises(ValueError, match=r"contracted axes of x \(2, 3, 4, 5\) and w \(6, 5\)"):
    dense(x, jnp.ones((6, 5)))


def test_segment_positions_left_right_packed():
  seg = jnp.asarray(
      [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 2, 2, 2], [0, 3, 3, 5, 0]]  # left padding  # right padding  # packed
  )  # padding + packed
  want = [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 1, 0, 1, 2], [0, 0, 1, 0, 0]]
  np.testing.assert_array_equal(np.asarray(segment_positions(seg)), want)


def test_packed_and_padded_rows_equal_separate_sequences():
  model = _model("tiny")
  a, b = _tokens(b=1, t=4, seed=1), _tokens(b=1, t=6, seed=2)
  ref_a = np.asarray(_fwd(model, a, jnp.ones_like(a)))[0]
  ref_b = np.asarray(_fwd(model, b, jnp.ones_like(b)))[0]
  packed = jnp.concatenate([a, b], axis=1)
  out = np.asarray(_fwd(model, packed, jnp.asarray([[1] * 4 + [2] * 6])))[0]
  np.testing.assert_allclose(out[:4], ref_a, atol=1e-5, rtol=0)
  np.testing.assert_allclose(out[4:], ref_b, atol=1e-5, rtol=0)
  left = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), a], axis=1)
  out = np.asarray(_fwd(model, left, jnp.asarray([[0, 0, 0, 1, 1, 1, 1]])))[0]
  np.testing.assert_allclose(out[3:], ref_a, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ causal blocks


def _padded_packed_segments(t):
  """Left padding, packing and right padding in one [4, t] batch (t >= 130)."""
  seg = np.asarray(_left_pad_segments(b=4, t=t)).copy()
  seg[2, 70:] = 2  # two packed sequences, the second starting inside the second query block
  seg[3, 5:120] = 3  # a second segment, then right padding
  seg[3, 120:] = 0
  return jnp.asarray(seg)


def _dot_count(model, tokens, seg):
  graphdef, state = nnx.split(model)
  fwd = lambda st, x: nnx.merge(graphdef, st)(x, segment_ids_bt=seg).out
  return str(jax.make_jaxpr(fwd)(state, tokens)).count("dot_general")


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("tiny", {}),
        ("tiny-llama", {}),
        ("tiny-moe", {"moe_impl": "dense"}),
        ("tiny-moe", dict(scan_layers=True, remat="block")),
    ],
)
def test_causal_blocks_give_the_full_score_matrix_results(name, overrides):
  """attn_causal_blocks=3 at T=200 (query blocks [0, 67), [67, 133), [133, 200), keys after each skipped)
  gives the logits and the parameter gradients of the full score matrix (attn_causal_blocks=1) on every
  real token, with left padding, packing and right padding. T < 128 keeps one block."""
  t = 200
  tokens, seg = _tokens(b=4, t=t), _padded_packed_segments(t)
  real = np.asarray(seg) != 0
  scored = jnp.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0), ((0, 0), (1, 0)))  # has a prefix

  def loss(m):
    return jnp.sum(jnp.where(scored, token_logprobs(m, tokens, seg).logp, 0.0))

  full, blocked = _model(name, attn_causal_blocks=1, **overrides), _model(name, attn_causal_blocks=3, **overrides)
  bodies = 1 if full.config.scan_layers else full.config.num_layers  # layer bodies in the jaxpr
  assert _dot_count(blocked, tokens, seg) == _dot_count(full, tokens, seg) + 2 * 2 * bodies  # 3 blocks ran
  assert _dot_count(blocked, tokens[:, :127], seg[:, :127]) == _dot_count(full, tokens[:, :127], seg[:, :127])
  np.testing.assert_allclose(
      np.asarray(_fwd(blocked, tokens, seg))[real], np.asarray(_fwd(full, tokens, seg))[real], atol=1e-5, rtol=0
  )
  grads = [jax.tree.leaves(nnx.state(nnx.grad(loss)(m), nnx.Param)) for m in (blocked, full)]
  for got, want in zip(*grads, strict=True):  # fp32 rounding of sums over 800 tokens, relative to the leaf's scale
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-6 * float(np.abs(want).max()), rtol=0)


@pytest.mark.parametrize(
    "name,layout", [("tiny", {"tensor": 2, "fsdp": 2, "data": 2}), ("tiny-moe", {"expert": 2, "fsdp": 2, "tensor": 2})]
)
def test_causal_blocks_on_a_mesh_equal_single_device_full_scores(name, layout):
  """The blocked attention (T=160: 2 blocks) under a sharded mesh gives the single-device full-matrix logits."""
  tokens, seg = _tokens(b=8, t=160), _left_pad_segments(b=8, t=160)
  real = np.asarray(seg) != 0
  want = np.asarray(_fwd(_model(name, attn_causal_blocks=1), tokens, seg))
  mesh = make_mesh(layout)
  with use_mesh(mesh):
    got = np.asarray(_fwd(_model(name, mesh=mesh), tokens, seg))
  np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)


def test_causal_block_attention_matches_masked_attention_and_checks_shapes():
  """The core alone in fp32 with a random causal mask: equal to `masked_attention` on rows with a visible key."""
  b, k, g, t, hd = 2, 2, 3, 11, 8
  rng = np.random.RandomState(0)
  qg, keys, values = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((b, k, g, t, hd), (b, k, t, hd), (b, k, t, hd)))
  mask = jnp.asarray(np.tril(rng.rand(b, t, t) < 0.7))
  mask = mask.at[:, 4].set(False)  # a fully masked row (padding): unspecified output, not compared
  want = masked_attention(qg, keys, values, mask, keys_hd_major=False, dtype=jnp.float32)
  for n in (1, 2, 5, 11):
    got = causal_block_attention(qg, keys, values, mask, n, dtype=jnp.float32)
    rows = np.asarray(mask.any(-1))  # [B, T]
    np.testing.assert_allclose(
        np.asarray(got)[rows[:, None, None].repeat(k, 1).repeat(g, 2)],
        np.asarray(want)[rows[:, None, None].repeat(k, 1).repeat(g, 2)],
        atol=1e-6,
        rtol=0,
    )
  with pytest.raises(ValueError, match="use masked_attention for a KV cache"):
    causal_block_attention(qg, jnp.concatenate([keys, keys], 2), values, mask, 2, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"mask_btt must be \[B, T, T\]"):
    causal_block_attention(qg, keys, values, mask[0], 2, dtype=jnp.float32)
  with pytest.raises(ValueError, match="num_blocks=0"):
    causal_block_attention(qg, keys, values, mask, 0, dtype=jnp.float32)
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match=f"attn_causal_blocks={bad} must be an int >= 1"):
      get_preset("tiny", attn_causal_blocks=bad)


# ------------------------------------------------------------------------------------------------ bad input


def test_config_validation_errors():
  base = get_preset("tiny")
  with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
    base.replace(num_kv_heads=3)
  with pytest.raises(ValueError, match="param_dtype"):
    base.replace(param_dtype="float64")
  with pytest.raises(ValueError, match="remat"):
    base.replace(remat="full")
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    get_preset("tiny-moe", num_experts_per_tok=9)
  with pytest.raises(ValueError, match="rope_scaling"):
    base.replace(rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="hidden_size"):
    ModelConfig(vocab_size=8, hidden_size=0, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4)
  with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
    get_preset("qwen9")


def test_wrong_token_shapes_raise():
  model = _model("tiny")
  with pytest.raises(ValueError, match=r"tokens_bt must be \[B, T\]"):
    model(jnp.zeros((5,), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids_bt"):
    model(jnp.zeros((2, 5), jnp.int32), segment_ids_bt=jnp.ones((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="positions_bt"):
    model(jnp.zeros((2, 5), jnp.int32), positions_bt=jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(model, jnp.zeros((2, 5), jnp.int32), temperature=0.0)


@pytest.fixture
def checkpoint(tmp_path):
  save_hf_checkpoint(_model("tiny", tie_embeddings=False), str(tmp_path))
  return tmp_path


def _edit_tensors(path, fn):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(str(path / "model.safetensors"))
  fn(tensors)
  save_file(tensors, str(path / "model.safetensors"))


def test_checkpoint_missing_tensor_named(checkpoint):
  _edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_hf_checkpoint(str(checkpoint))


def test_checkpoint_wrong_shape_named(checkpoint):
  def f(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

  _edit_tensors(checkpoint, f)
  with pytest.raises(
      ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 64\), " r"expected \(32, 64\)"
  ):
    load_hf_checkpoint(str(checkpoint))


def test_checkpoint_unused_tensor_named(checkpoint):
  def f(t):
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)

  _edit_tensors(checkpoint, f)
  with pytest.raises(ValueError, match=r"does not use.*model\.layers\.0\.self_attn\.q_proj\.bias"):
    load_hf_checkpoint(str(checkpoint))


def test_checkpoint_unknown_model_type_named(checkpoint):
  cfg = json.load(open(checkpoint / "config.json"))
  json.dump(dict(cfg, model_type="mistral"), open(checkpoint / "config.json", "w"))
  with pytest.raises(ValueError, match="`model_type`='mistral'.*qwen3_moe"):
    load_hf_checkpoint(str(checkpoint))
  os.remove(checkpoint / "config.json")
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf_checkpoint(str(checkpoint))


def test_checkpoint_round_trip_bf16_params(checkpoint):
  model, config = load_hf_checkpoint(str(checkpoint), param_dtype="bfloat16")
  assert config.param_dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
  ref, _ = load_hf_checkpoint(str(checkpoint))
  np.testing.assert_array_equal(
      np.asarray(model.layers.attn.o_proj[...]), np.asarray(ref.layers.attn.o_proj[...].astype(jnp.bfloat16))
  )
