"""`models.blockwise_attention` against `attention_core.masked_attention` (the XLA reference): values and gradients
in fp32 for every mask the model uses, memory that grows linearly in T, and the model running on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.models.attention_core import masked_attention
from minpro_jax.models.blockwise_attention import blockwise_attention

T = 37  # not a multiple of any block below


def _segments(kind: str, b: int = 2, t: int = T) -> np.ndarray:
  seg = np.ones((b, t), np.int32)
  if kind == "left_padding":
    seg[0, :10] = 0
    seg[1, :3] = 0
  elif kind == "right_padding":
    seg[0, 30:] = 0
    seg[1, 20:] = 0
  elif kind == "packed":
    seg[:] = np.concatenate([np.full(12, 1), np.full(15, 2), np.full(t - 27, 3)])
    seg[1, -4:] = 0
  return seg


def _reference(q, k, v, q_seg, kv_seg, q_offset=0):
  t, s = q.shape[3], k.shape[2]
  slot = q_offset + jnp.arange(t)
  mask = (jnp.arange(s)[None, :] <= slot[:, None])[None]
  mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  return masked_attention(q, k, v, mask, keys_hd_major=False, dtype=jnp.float32)


def _operands(b, kh, g, t, s, hd, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, kh, g, t, hd)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, kh, s, hd)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, kh, s, hd)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(b, kh, g, t, hd)), jnp.float32)
  return q, k, v, w


_MASKS = ["causal", "left_padding", "right_padding", "packed"]
_CASES = [(kind, (2, 2), (8, 8)) for kind in _MASKS] + [(kind, (1, 4), (16, 8)) for kind in _MASKS]
_CASES += [("left_padding", (2, 1), (8, 16)), ("packed", (2, 2), (64, 64))]


@pytest.mark.parametrize(
    "kind, heads, blocks",
    _CASES,
    ids=[f"{k}-{n}" for k, n in zip([c[0] for c in _CASES], ["gqa"] * 4 + ["mqa"] * 4 + ["mha", "t_below_block"])],
)
def test_values_and_gradients_equal_xla(kind, heads, blocks):
  kh, g = heads
  seg = jnp.asarray(_segments(kind))
  q, k, v, w = _operands(2, kh, g, T, T, 8)
  w = w * (seg != 0)[:, None, None, :, None]  # a loss that reads only real rows, as the learner's does

  def blockwise(q, k, v):
    return blockwise_attention(q, k, v, seg, seg, block_q=blocks[0], block_k=blocks[1])

  def xla(q, k, v):
    return _reference(q, k, v, seg, seg)

  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(np.asarray(blockwise(q, k, v)) * real, np.asarray(xla(q, k, v)) * real, atol=1e-5)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v) for f in (blockwise, xla)]
  for got, want in zip(*grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_queries_after_a_prefix_of_cached_keys():
  """q_offset > 0: 9 queries at slots 28..36 over 37 key slots (a prefill after a cached prefix)."""
  q, k, v, w = _operands(2, 2, 2, 9, T, 8, seed=1)
  kv_seg = jnp.asarray(_segments("left_padding"))
  q_seg = kv_seg[:, -9:]

  def blockwise(q, k, v):
    return blockwise_attention(q, k, v, q_seg, kv_seg, q_offset=T - 9, block_q=4, block_k=8)

  def xla(q, k, v):
    return _reference(q, k, v, q_seg, kv_seg, q_offset=T - 9)

  np.testing.assert_allclose(np.asarray(blockwise(q, k, v)), np.asarray(xla(q, k, v)), atol=1e-5)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v) for f in (blockwise, xla)]
  for got, want in zip(*grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_close_to_fp32():
  seg = jnp.asarray(_segments("packed"))
  q, k, v, _ = _operands(2, 2, 2, T, T, 8, seed=2)
  got = blockwise_attention(q.astype(jnp.bfloat16), k, v, seg, seg, block_q=8, block_k=8, dtype=jnp.bfloat16)
  want = _reference(q, k, v, seg, seg)
  assert got.dtype == jnp.bfloat16
  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(np.asarray(got, np.float32) * real, np.asarray(want) * real, atol=3e-2)


def _attention_grad_temp_bytes(t: int, impl: str) -> int:
  q = jax.ShapeDtypeStruct((1, 2, 2, t, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 2, t, 64), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def loss(q, k, v, s):
    if impl == "blockwise":
      return jnp.sum(blockwise_attention(q, k, v, s, s))
    return jnp.sum(_reference(q, k, v, s, s))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_forward_and_backward_memory_grow_linearly_in_t():
  """Compiled (nothing run) on the CPU backend: one attention's forward + backward at T = 16,384 needs at most
  4.5x the temporaries of T = 4,096 with blockwise; XLA's [T, S] scores need about 16x."""
  small, large = (_attention_grad_temp_bytes(t, "blockwise") for t in (4096, 16384))
  assert 0 < large <= 4.5 * small, (small, large)
  xla_small, xla_large = (_attention_grad_temp_bytes(t, "xla") for t in (4096, 16384))
  assert xla_large >= 12 * xla_small  # the quadratic reference it replaces
  assert large < xla_large / 50


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_q": 0}, "block_q=0"),
        ({"q_offset": -1}, "q_offset=-1"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
  q, k, v, _ = _operands(1, 1, 1, 4, 4, 8)
  seg = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=message):
    blockwise_attention(q, k, v, seg, seg, **kwargs)
  with pytest.raises(ValueError, match="segment ids"):
    blockwise_attention(q, k, v, seg[:, :3], seg)
