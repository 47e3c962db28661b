"""The model's memory knobs: `ModelConfig.attention_impl` (blockwise attention in the learner's forward) and the
`ModelConfig.remat` policies: the same log-probs and gradients as the plain model, and less compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tpu_helpers import run_with_libtpu

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.attention_dispatch import (
    AUTO_BLOCKWISE_MIN_TOKENS,
    dot_product_attention,
    resolve_attention_impl,
)
from minpro_jax.models.blockwise_attention import blockwise_attention
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.models.transformer import KVCache, keys_head_dim_major

T = 45


def _batch(t=T):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 512, size=(2, t)), jnp.int32)
  seg = np.ones((2, t), np.int32)
  seg[0, :7] = 0  # a left-padded prompt
  seg[1, 30:] = 2  # a second packed sequence
  return tokens, jnp.asarray(seg)


def _logp_and_grads(**fields):
  model = init_model(get_preset("tiny", **fields), seed=0)
  graphdef, params = nnx.split(model)
  tokens, seg = _batch()
  # log p(token t | < t) is meaningful where t and t - 1 are real tokens of one sequence (the logprobs contract)
  keep = jnp.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0), ((0, 0), (1, 0))).astype(jnp.float32)

  def loss(p):
    lp = token_logprobs(nnx.merge(graphdef, p), tokens, seg, chunk_size=16).logp
    return jnp.sum(lp * keep), lp * keep

  (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return np.asarray(logp), jax.tree.leaves(grads)


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_memory_efficient_attention_gives_the_learner_the_xla_log_probs_and_gradients(impl):
  """splash runs its Pallas kernels in interpret mode here (T = 45 is padded to one 128-slot block)."""
  ref_logp, ref_grads = _logp_and_grads(attention_impl="xla")
  logp, grads = _logp_and_grads(attention_impl=impl, attn_block_size=16)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("remat", ["block", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload"])
def test_every_remat_policy_gives_the_gradients_of_none(remat):
  ref_logp, ref_grads = _logp_and_grads(remat="none")
  logp, grads = _logp_and_grads(remat=remat)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-6)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_prefill_at_slot_0_attends_with_attention_impl_and_fills_the_same_cache():
  """The sampler's prefill (a KV cache, cache_index 0) with blockwise attention over the prompt's own keys gives
  the logits and the cache of the full-cache xla path; the decode step after it then agrees too."""
  tokens, seg = _batch()
  outs = []
  for impl in ("xla", "blockwise"):
    model = init_model(get_preset("tiny", attention_impl=impl, attn_block_size=16), seed=0)
    cache = KVCache.zeros(model.config, 2, T + 4)
    pre = model(tokens, segment_ids_bt=seg, cache=cache, cache_index=0)
    nxt = model(tokens[:, -1:], jnp.full((2, 1), T, jnp.int32), seg[:, -1:], cache=pre.cache, cache_index=T)
    outs.append((pre, nxt))
  (a, a_next), (b, b_next) = outs
  real = np.asarray(seg != 0)
  np.testing.assert_allclose(np.asarray(b.out)[real], np.asarray(a.out)[real], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(b.cache.segment_ids), np.asarray(a.cache.segment_ids))
  k_major = keys_head_dim_major(a.cache.k.dtype)  # keys may be stored [L, B, K, hd, S]
  pairs = ((b.cache.k, a.cache.k, k_major), (b.cache.v, a.cache.v, False))
  for x, y, hd_major in pairs:  # [L, B, K, S, hd] by slot: padding slots are never read
    by_slot = [np.swapaxes(z, 3, 4) if hd_major else np.asarray(z) for z in (x, y)]
    by_slot = [z[:, :, :, :T].transpose(1, 3, 0, 2, 4)[real] for z in by_slot]  # [real slots, L, K, hd]
    np.testing.assert_allclose(*by_slot, atol=1e-5)
  np.testing.assert_allclose(np.asarray(b_next.out), np.asarray(a_next.out), atol=1e-5)


def _grad_temp_bytes(**fields) -> int:
  cfg = get_preset("tiny", num_layers=4, hidden_size=128, intermediate_size=512, **fields)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(cfg, seed=0)))
  tokens = jax.ShapeDtypeStruct((4, 512), jnp.int32)

  def loss(p, tok):
    return jnp.sum(token_logprobs(nnx.merge(graphdef, p), tok, chunk_size=128).logp)

  return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_block_and_dots_saveable_remat_lower_the_compiled_temporaries():
  """Compiled on the CPU backend (nothing run): a 4-layer model's gradient at B=4, T=512."""
  none = _grad_temp_bytes(remat="none")
  for remat in ("block", "dots_saveable"):
    assert _grad_temp_bytes(remat=remat) < none, remat


def test_auto_picks_the_kernel_of_the_platform():
  cfg = get_preset("tiny")
  assert cfg.attention_impl == "auto"
  assert resolve_attention_impl(cfg, AUTO_BLOCKWISE_MIN_TOKENS - 1, "cpu") == "xla"
  assert resolve_attention_impl(cfg, AUTO_BLOCKWISE_MIN_TOKENS, "cpu") == "blockwise"
  assert resolve_attention_impl(cfg, 8, "tpu") == "splash"
  assert resolve_attention_impl(cfg.replace(dtype="bfloat16"), 8, "gpu") == "cudnn"
  assert resolve_attention_impl(cfg, AUTO_BLOCKWISE_MIN_TOKENS, "gpu") == "blockwise"  # fp32: no cuDNN flash
  assert resolve_attention_impl(cfg.replace(attention_impl="blockwise"), 8, "tpu") == "blockwise"
  assert resolve_attention_impl(cfg.replace(attention_impl="xla"), 10**6, "cpu") == "xla"
  assert resolve_attention_impl(cfg, 8) == "xla"  # no mesh in context: the default backend (cpu)
  with pytest.raises(ValueError, match="attention_impl='cudnn' needs a GPU"):
    resolve_attention_impl(cfg.replace(attention_impl="cudnn", dtype="bfloat16"), 8, "cpu")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"attention_impl": "flash"}, "ModelConfig.attention_impl='flash'; choose one of"),
        ({"attn_block_size": 0}, "ModelConfig.attn_block_size=0 must be an int >= 1"),
        ({"remat": "offload_all"}, "ModelConfig.remat='offload_all'; choose one of"),
    ],
)
def test_bad_memory_fields_name_the_field(fields, message):
  with pytest.raises(ValueError, match=message):
    get_preset("tiny", **fields)


def test_the_config_fields_name_themselves_in_errors(tmp_path):
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.errors import ConfigError
  from minpro_jax.run import run_config

  for field, value in (("attention_impl", "flash"), ("remat", "offload_all"), ("attn_block_size", 0)):
    c = make_config(tiny_overrides(tmp_path, **{f"model.{field}": value}))
    with pytest.raises(ConfigError, match=rf"config\.model\.{field}: ModelConfig\.{field}="):
      run_config.validate_config(c)


_TPU_LEARNER = """
import re
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from minpro_jax.models import get_preset
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.aot.abstract import abstract_params, tpu_topology_devices
from minpro_jax.runtime.sharding import make_mesh, use_mesh

mesh = make_mesh({"fsdp": 4}, devices=tpu_topology_devices("v5p:2x2x1", (2, 2, 1)))
for remat in ("none", "offload"):
  cfg = get_preset("qwen3-0.6b", num_layers=1, vocab_size=1024, dtype="bfloat16", param_dtype="bfloat16", remat=remat)
  graphdef, params = abstract_params(cfg, mesh)
  with use_mesh(mesh):
    tokens = jax.ShapeDtypeStruct((4, 1024), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None)))
    loss = lambda p, tok: jnp.sum(token_logprobs(nnx.merge(graphdef, p), tok, chunk_size=512).logp)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
  kernels = sorted(set(re.findall(r'(splash_mqa_\\w+)', compiled.as_text())))
  m = compiled.memory_analysis()
  print(f"RESULT remat={remat} temp={m.temp_size_in_bytes} host_temp={m.host_temp_size_in_bytes} kernels={','.join(kernels)}")
"""


@pytest.mark.slow
def test_the_learner_compiles_for_tpu_with_splash_and_host_offload():
  """The learner's gradient compiled for a v5p 2x2x1 slice (fsdp=4, one Qwen3-0.6B layer, bf16, 4 x 1,024 tokens):
  attention_impl="auto" runs the splash kernels (forward, dkv, dq), and remat="offload" moves saved activations to
  host memory and lowers the chip's temporaries."""
  rows = {r["remat"]: r for r in run_with_libtpu(_TPU_LEARNER, timeout=400)}
  for row in rows.values():
    kernels = {"_".join(k.split("_")[:3]) for k in row["kernels"].split(",")}
    assert kernels == {"splash_mqa_fwd", "splash_mqa_dkv", "splash_mqa_dq"}, row
  assert int(rows["none"]["host_temp"]) == 0 < int(rows["offload"]["host_temp"])
  assert int(rows["offload"]["temp"]) < int(rows["none"]["temp"])


def test_the_cudnn_call_computes_the_model_rule():
  """`attention_dispatch.dot_product_attention` is the cuDNN path's call; with implementation="xla" (no GPU here)
  the same mask and head layout give blockwise attention's values on every real row (GQA, left padding, packing)."""
  rng = np.random.default_rng(1)
  b, kh, g, t, hd = 2, 2, 2, T, 16
  q = jnp.asarray(rng.normal(size=(b, kh, g, t, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, kh, t, hd)), jnp.float32) for _ in range(2))
  _, seg = _batch()
  got = dot_product_attention(q, k, v, seg, seg, dtype=jnp.float32, implementation="xla")
  want = blockwise_attention(q, k, v, seg, seg, block_q=16, block_k=16)
  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=1e-5)
