"""`models.splash_attention` against `attention_core.masked_attention` (the XLA reference): values and gradients in
fp32 in Pallas interpret mode on CPU for every mask the learner uses, the same under an 8-device mesh, and the
forward + backward compiled for a v5p topology with libtpu in a subprocess."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Jaxpr
from tpu_helpers import run_with_libtpu

from minpro_jax.models.attention_core import masked_attention
from minpro_jax.models.splash_attention import splash_attention
from minpro_jax.runtime.sharding import make_mesh, use_mesh


def _segments(kind: str, b: int, t: int) -> np.ndarray:
  """[b, t] segment ids; rows alternate between the two patterns of `kind`."""
  seg = np.ones((2, t), np.int32)
  if kind == "left_padding":
    seg[0, :10] = 0
    seg[1, :3] = 0
  elif kind == "right_padding":
    seg[0, t - 7 :] = 0
    seg[1, t // 2 :] = 0
  elif kind == "packed":
    seg[:] = np.concatenate([np.full(12, 1), np.full(15, 2), np.full(t - 27, 3)])
    seg[1, -4:] = 0
  return seg[np.arange(b) % 2]


def _reference(q, k, v, seg):
  t = q.shape[3]
  mask = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
  mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  return masked_attention(q, k, v, mask, keys_hd_major=False, dtype=jnp.float32)


def _operands(b, kh, g, t, hd, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, kh, g, t, hd)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, kh, t, hd)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, kh, t, hd)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(b, kh, g, t, hd)), jnp.float32)
  return q, k, v, w


def _grads(f, q, k, v, w):
  return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)


# (mask, (K, G), T, block_size): T = 37 is below the 128-slot minimum block, so the block is cut to 128 and T padded;
# T = 200 with 128-slot blocks pads to 256 and runs 2 x 2 blocks, the upper-right one skipped by the causal mask.
_CASES = [
    ("causal", (2, 2), 37, 512),
    ("left_padding", (2, 2), 37, 512),
    ("right_padding", (2, 2), 37, 512),
    ("packed", (2, 2), 37, 512),
    ("packed", (1, 4), 37, 512),
    ("left_padding", (1, 4), 200, 128),
    ("packed", (2, 2), 200, 128),
]
_IDS = ["causal-gqa", "left_padding-gqa", "right_padding-gqa", "packed-gqa", "packed-mqa", "two_blocks-mqa"]
_IDS += ["two_blocks-gqa"]


@pytest.mark.parametrize("kind, heads, t, block_size", _CASES, ids=_IDS)
def test_values_and_gradients_equal_xla_in_interpret_mode(kind, heads, t, block_size):
  kh, g = heads
  seg = jnp.asarray(_segments(kind, 2, t))
  q, k, v, w = _operands(2, kh, g, t, 8)
  w = w * (seg != 0)[:, None, None, :, None]  # a loss that reads only real rows, as the learner's does

  def splash(q, k, v):
    return splash_attention(q, k, v, seg, seg, block_size=block_size, interpret=True)

  def xla(q, k, v):
    return _reference(q, k, v, seg)

  got = np.asarray(splash(q, k, v))
  assert got.shape == q.shape and got.dtype == np.float32
  assert np.isfinite(got).all()  # padding rows too
  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(got * real, np.asarray(xla(q, k, v)) * real, atol=1e-5)
  for got, want in zip(_grads(splash, q, k, v, w), _grads(xla, q, k, v, w)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_close_to_fp32():
  seg = jnp.asarray(_segments("packed", 2, 37))
  q, k, v, _ = _operands(2, 2, 2, 37, 8, seed=2)
  got = splash_attention(q.astype(jnp.bfloat16), k, v, seg, seg, dtype=jnp.bfloat16, interpret=True)
  assert got.dtype == jnp.bfloat16
  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(np.asarray(got, np.float32) * real, np.asarray(_reference(q, k, v, seg)) * real, atol=3e-2)


def _shard_map_out_spec(f, *args):
  """The output PartitionSpec of the one shard_map in f's jaxpr (searched through nested jaxprs)."""

  def find(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "shard_map":
        yield eqn.params["out_specs"]
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)
        if isinstance(inner, Jaxpr):
          yield from find(inner)

  specs = list(find(jax.make_jaxpr(f)(*args).jaxpr))
  assert len(specs) == 1 and len(specs[0]) == 1, specs
  return specs[0][0]


def _names(spec, dim: int) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec splits dimension `dim` over (trailing replicated dims may be dropped)."""
  entry = tuple(spec)[dim] if dim < len(tuple(spec)) else None
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


@pytest.mark.parametrize(
    "b, kh, batch_axes, head_axes",
    [(4, 2, ("data", "fsdp"), ("tensor",)), (2, 1, (), ())],
    ids=["sharded", "indivisible_replicated"],
)
def test_mesh_equals_single_device(b, kh, batch_axes, head_axes):
  """8 CPU devices, data=2, tensor=2, fsdp=2: B=4 splits over data x fsdp (expert, of size 1, is left out) and K=2
  over tensor; B=2 and K=1 divide neither and stay replicated."""
  assert len(jax.devices()) == 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"
  t = 37
  seg = jnp.asarray(_segments("packed", b, t))
  q, k, v, w = _operands(b, kh, 2, t, 8, seed=3)
  w = w * (seg != 0)[:, None, None, :, None]

  def f(q, k, v, seg):
    return splash_attention(q, k, v, seg, seg, interpret=True)

  def loss(q, k, v, seg):
    return jnp.sum(f(q, k, v, seg) * w)

  want = f(q, k, v, seg)
  want_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, seg)
  with use_mesh(make_mesh({"data": 2, "tensor": 2, "fsdp": 2})):
    spec = _shard_map_out_spec(jax.jit(f), q, k, v, seg)
    got = jax.jit(f)(q, k, v, seg)
    got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, seg)
  assert (_names(spec, 0), _names(spec, 1)) == (batch_axes, head_axes), spec
  real = np.asarray(seg != 0)[:, None, None, :, None]
  np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=1e-6)
  for g_got, g_want in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), atol=1e-6)


_TPU_COMPILE = r"""
import re
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from minpro_jax.models.splash_attention import splash_attention
from minpro_jax.runtime.sharding import make_mesh, use_mesh

topology = topologies.get_topology_desc(
    platform="tpu", topology_name="v5p:2x2x1", chip_config_name="default", chips_per_host_bounds=(2, 2, 1),
    num_slices=1,
)
mesh = make_mesh({"fsdp": 4}, devices=topology.devices)


def loss(q, k, v, seg):
  return jnp.sum(splash_attention(q, k, v, seg, seg, dtype=jnp.bfloat16).astype(jnp.float32))


b, kh, g, hd = 4, 8, 4, 128
for t in (8192, 16384):
  q = jax.ShapeDtypeStruct((b, kh, g, t, hd), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, kh, t, hd), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
  start = time.perf_counter()
  with use_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
  seconds = time.perf_counter() - start
  kernels = set()
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      kernels.add(re.sub(r"\.\d+$", "", line.split(" = ")[0].strip().lstrip("%")))
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(f"RESULT t={t} compile_s={seconds:.1f} temp_bytes={temp} kernels={','.join(sorted(kernels))}")
"""


def test_forward_and_backward_compile_for_a_tpu_topology():
  """Compiled (nothing run) for a v5p 2x2x1 slice with fsdp=4: bf16, B=4, K=8, G=4, hd=128, T = 8,192 and 16,384.
  The optimized HLO runs the splash forward, dkv and dq kernels as Mosaic custom calls, and the temporaries grow
  linearly in T (the fused backward, with a dq per key block, would grow quadratically)."""
  results = {int(r["t"]): r for r in run_with_libtpu(_TPU_COMPILE, timeout=240)}
  assert set(results) == {8192, 16384}, results
  for fields in results.values():
    assert set(fields["kernels"].split(",")) == {
        "splash_mqa_fwd_segmented_residuals",
        "splash_mqa_dkv_segmented_no_residuals",
        "splash_mqa_dq_segmented_no_residuals",
    }, fields["kernels"]
  small, large = (int(results[t]["temp_bytes"]) for t in (8192, 16384))
  assert 0 < large <= 2.5 * small, (small, large)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"q": (1, 1, 1, 4)}, "qg_bkgth"),
        ({"k": (1, 1, 4, 16)}, "k_bksh"),
        ({"k": (1, 1, 5, 8), "v": (1, 1, 5, 8)}, "S must equal T"),
        ({"v": (1, 1, 4, 16)}, "v_bksh"),
        ({"q_seg": (1, 3)}, "q_segment_bt"),
        ({"kv_seg": (2, 4)}, "kv_segment_bs"),
        ({"block_size": 100}, "block_size=100"),
    ],
)
def test_bad_arguments_name_the_argument(change, message):
  args = {"q": (1, 1, 1, 4, 8), "k": (1, 1, 4, 8), "v": (1, 1, 4, 8), "q_seg": (1, 4), "kv_seg": (1, 4)}
  args.update(change)
  block_size = args.pop("block_size", 512)
  q, k, v = (jnp.zeros(args[n], jnp.float32) for n in ("q", "k", "v"))
  q_seg, kv_seg = (jnp.ones(args[n], jnp.int32) for n in ("q_seg", "kv_seg"))
  with pytest.raises(ValueError, match=message):
    splash_attention(q, k, v, q_seg, kv_seg, block_size=block_size, interpret=True)
