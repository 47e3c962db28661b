"""The model's memory knobs: `ModelConfig.attention_impl` (blockwise attention in the learner's forward) and the
`ModelConfig.remat` policies: the same log-probs and gradients as the plain model, and less compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.models.transformer import AUTO_BLOCKWISE_MIN_TOKENS, uses_blockwise_attention

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


def test_blockwise_attention_gives_the_learner_the_xla_log_probs_and_gradients():
  ref_logp, ref_grads = _logp_and_grads(attention_impl="xla")
  logp, grads = _logp_and_grads(attention_impl="blockwise", attn_block_size=16)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("remat", ["block", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_every_remat_policy_gives_the_gradients_of_none(remat):
  ref_logp, ref_grads = _logp_and_grads(remat="none")
  logp, grads = _logp_and_grads(remat=remat)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-6)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


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


def test_auto_picks_blockwise_from_the_threshold_on():
  cfg = get_preset("tiny")
  assert cfg.attention_impl == "auto"
  assert not uses_blockwise_attention(cfg, AUTO_BLOCKWISE_MIN_TOKENS - 1)
  assert uses_blockwise_attention(cfg, AUTO_BLOCKWISE_MIN_TOKENS)
  assert uses_blockwise_attention(cfg.replace(attention_impl="blockwise"), 8)
  assert not uses_blockwise_attention(cfg.replace(attention_impl="xla"), 10**6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"attention_impl": "splash"}, "ModelConfig.attention_impl='splash'; choose one of"),
        ({"attn_block_size": 0}, "ModelConfig.attn_block_size=0 must be an int >= 1"),
        ({"remat": "offload"}, "ModelConfig.remat='offload'; choose one of"),
    ],
)
def test_bad_memory_fields_name_the_field(fields, message):
  with pytest.raises(ValueError, match=message):
    get_preset("tiny", **fields)


def test_the_config_fields_name_themselves_in_errors(tmp_path):
  from train_helpers import make_config, tiny_overrides

  from minpro_jax import run_config
  from minpro_jax.errors import ConfigError

  for field, value in (("attention_impl", "splash"), ("remat", "offload"), ("attn_block_size", 0)):
    c = make_config(tiny_overrides(tmp_path, **{f"model.{field}": value}))
    with pytest.raises(ConfigError, match=rf"config\.model\.{field}: ModelConfig\.{field}="):
      run_config.validate_config(c)
