"""jax's Pallas TPU paged-attention kernels against `models.paged_attention`: run in TPU interpret mode on CPU,
and the kernel the TPU path calls (`pallas_decode_attention`) compiled for a TPU topology with libtpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpu_helpers import run_with_libtpu

from minpro_jax.models.paged_attention import paged_decode_attention, pallas_decode_attention

K, H, HD = 2, 4, 8  # KV heads, query heads (G = 2), head_dim


def _bf16_exact(x):
  # interpret mode runs the kernels' fp32 dots as the TPU's default precision would: inputs that bf16 holds
  # exactly keep the comparison at fp32 rounding (measured 2026-12-03: 7e-3 apart on plain fp32 normals)
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def test_pallas_paged_attention_kernel_in_interpret_mode():
  """jax's Pallas TPU `paged_attention` kernel (TPU interpret mode on CPU) equals `paged_decode_attention` on
  the same pages: the kernel's layout is [K, num_pages, page_size, hd] per k / v and it takes pre-scaled q."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  rng = np.random.default_rng(6)
  ps, maxp = 4, 4
  kv = _bf16_exact(rng.standard_normal((24, 2 * K, ps, HD)))  # the pool's heads-major pages
  lengths = jnp.array([5, 16, 9], jnp.int32)
  table = jnp.asarray(rng.permutation(24)[:12].reshape(3, maxp), jnp.int32)
  q = _bf16_exact(rng.standard_normal((3, H, HD)) * 0.5)
  want = paged_decode_attention(q, kv, lengths, table, sm_scale=0.5)
  k_pages, v_pages = (jnp.transpose(kv[:, i::2], (1, 0, 2, 3)) for i in (0, 1))
  with pltpu.force_tpu_interpret_mode():
    got = paged_attention(q * 0.5, k_pages, v_pages, lengths, table, pages_per_compute_block=2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


RPA_INTERPRET_ERROR = (
    "jax 0.10.2's ragged_paged_attention does not run on CPU in either Pallas interpret mode: under "
    "pltpu.force_tpu_interpret_mode() it fails with \"AttributeError: 'ReshapeTransform' object has no attribute "
    "'indices'\" (the kernel reshapes its VMEM KV buffer ref, which the TPU interpreter cannot read), and with "
    "pallas_call(interpret=True) with \"AttributeError: 'TypedInt' object has no attribute 'shape'\""
)


@pytest.mark.skipif(jax.__version_info__ <= (0, 10, 2), reason=RPA_INTERPRET_ERROR)
def test_pallas_ragged_paged_attention_kernel_in_interpret_mode():
  """The kernel the TPU path calls (`pallas_decode_attention`), in TPU interpret mode, against the reference."""
  rng = np.random.default_rng(7)
  kv = _bf16_exact(rng.standard_normal((24, 2 * K, 4, HD)))
  lengths = jnp.array([5, 16, 9], jnp.int32)
  table = jnp.asarray(rng.permutation(24)[:12].reshape(3, 4), jnp.int32)
  q = _bf16_exact(rng.standard_normal((3, H, HD)))
  want = paged_decode_attention(q, kv, lengths, table)
  with pltpu.force_tpu_interpret_mode():
    got = pallas_decode_attention(q, kv, lengths, table)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


_TPU_COMPILE = r"""
import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from minpro_jax.models.paged_attention import pallas_decode_attention
from minpro_jax.runtime.sharding import make_mesh, use_mesh

topology = topologies.get_topology_desc(
    platform="tpu", topology_name="v5p:2x2x1", chip_config_name="default", chips_per_host_bounds=(2, 2, 1),
    num_slices=1,
)
# one chip (a Mosaic kernel is not partitioned automatically); the mesh tells Pallas the TPU generation
mesh = make_mesh({"data": 1}, devices=topology.devices[:1])
rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
rows, h, kh, hd, ps, pages, per_row = 64, 32, 8, 128, 64, 4096, 128  # Qwen3-8B's heads, 8k tokens per row
for name, dt in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
  arg = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=rep)
  fn = functools.partial(pallas_decode_attention, num_kv_pages_per_block=8, num_queries_per_block=32)
  with use_mesh(mesh):
    compiled = jax.jit(fn).lower(
        arg((rows, h, hd), dt), arg((pages, 2 * kh, ps, hd), dt), arg((rows,), jnp.int32), arg((rows, per_row), jnp.int32)
    ).compile()
  kernels = set()
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      kernels.add(re.sub(r"\.\d+$", "", line.split(" = ")[0].strip().lstrip("%")))
  print(f"RESULT dtype={name} kernels={','.join(sorted(kernels))}")
# a block of more pages than a row's table holds (the sampler's KV_BLOCK_TOKENS default on short rows) is capped
fn = functools.partial(pallas_decode_attention, num_kv_pages_per_block=64, num_queries_per_block=8)
with use_mesh(mesh):
  jax.jit(fn).lower(
      arg((8, h, hd), jnp.bfloat16), arg((64, 2 * kh, ps, hd), jnp.bfloat16), arg((8,), jnp.int32),
      arg((8, 3), jnp.int32)
  ).compile()
print("RESULT dtype=capped kernels=compiled")
"""


def test_ragged_paged_attention_compiles_for_a_tpu_topology_on_the_pool_layout():
  """The pool's layout and the decode call compile (nothing run) into jax's ragged paged attention kernel for a
  v5p chip, bf16 and fp32, at Qwen3-8B's heads (32 query, 8 KV, head_dim 128), 64 rows, pages of 64 tokens; a block
  of 64 pages on rows of 3 pages compiles (capped at the row's pages, which the kernel requires)."""
  results = {r["dtype"]: r["kernels"] for r in run_with_libtpu(_TPU_COMPILE, timeout=240)}
  want = {"bf16": "ragged_paged_attention_kernel", "fp32": "ragged_paged_attention_kernel", "capped": "compiled"}
  assert results == want, results
