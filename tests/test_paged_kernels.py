"""jax's Pallas TPU paged-attention kernel as the TPU path calls it (`models.paged_attention.pallas_decode_attention`):
run in TPU interpret mode on CPU against the plain-JAX path, and compiled for a TPU topology with libtpu."""

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from tpu_helpers import run_with_libtpu

from minpro_jax.models.paged_attention import KVPages, paged_decode_attention, pallas_decode_attention

K, H, HD = 2, 4, 8  # KV heads, query heads (G = 2), head_dim


def _bf16_exact(x):
  # interpret mode runs the kernels' fp32 dots as the TPU's default precision would: inputs that bf16 holds
  # exactly keep the comparison at fp32 rounding (measured 2026-12-03: 7e-3 apart on plain fp32 normals)
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def test_pallas_decode_attention_runs_the_kernel_in_interpret_mode():
  """The TPU path (`pallas_decode_attention`: jax's Pallas `paged_attention` on the pool's own pages) in TPU
  interpret mode equals `paged_decode_attention`: ragged rows, an idle row (zeros), a table of 5 pages padded to
  blocks of 2. (With `megacore` the interpreter hangs, 2026-12-06: the megacore split is compiled below.)"""
  rng = np.random.default_rng(6)
  ps, maxp = 4, 5
  kv = _bf16_exact(rng.standard_normal((2, K, 24, ps, HD)))
  pages = KVPages(kv[0], kv[1])
  lengths = jnp.array([5, 16, 0, 19], jnp.int32)
  table = jnp.asarray(rng.permutation(24)[:20].reshape(4, maxp), jnp.int32)
  q = _bf16_exact(rng.standard_normal((4, H, HD)) * 0.5)
  want = paged_decode_attention(q, pages, lengths, table, sm_scale=0.5)
  with pltpu.force_tpu_interpret_mode():
    got = pallas_decode_attention(q, pages, lengths, table, sm_scale=0.5, pages_per_compute_block=2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
  assert np.all(np.asarray(got)[2] == 0)


_TPU_COMPILE = r"""
import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from minpro_jax.models.paged_attention import KVPages, has_megacore, pallas_decode_attention
from minpro_jax.runtime.sharding import make_mesh, use_mesh

topology = topologies.get_topology_desc(
    platform="tpu", topology_name="v5p:2x2x1", chip_config_name="default", chips_per_host_bounds=(2, 2, 1),
    num_slices=1,
)
# one chip (a Mosaic kernel is not partitioned automatically); the mesh tells Pallas the TPU generation
mesh = make_mesh({"data": 1}, devices=topology.devices[:1])
rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
arg = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=rep)
print("RESULT case=megacore kernels=" + str(has_megacore(topology.devices[0])))
# Qwen3-8B's heads on one chip of tensor=4 (8 query, 2 KV heads, head_dim 128), 64 rows, pages of 128, 20k-token rows
rows, h, kh, hd, ps, pages, per_row = 64, 8, 2, 128, 128, 4096, 162
for name, dt in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
  fn = functools.partial(pallas_decode_attention, megacore=True)
  kv = KVPages(arg((kh, pages, ps, hd), dt), arg((kh, pages, ps, hd), dt))
  with use_mesh(mesh):
    compiled = jax.jit(fn).lower(arg((rows, h, hd), dt), kv, arg((rows,), jnp.int32), arg((rows, per_row), jnp.int32)).compile()
  kernels, page_copies = set(), 0
  for line in compiled.as_text().splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      kernels.add(re.sub(r"\.\d+$", "", line.split(" = ")[0].strip().lstrip("%")))
    page_copies += " copy(" in line and f"[{kh},{pages}," in line.replace(" ", "")
  print(f"RESULT case={name} kernels={','.join(sorted(kernels))} page_copies={page_copies}")
"""


def test_paged_attention_kernel_compiles_for_a_tpu_topology_on_the_pool_layout():
  """The pool's pages and the decode call compile (nothing run) into jax's paged attention kernel for a v5p chip
  (two cores: megacore), bf16 and fp32, at Qwen3-8B's heads on one chip of tensor=4, 64 rows, pages of 128 with
  162 pages a row (a table padded to blocks of 8), and no copy of the pages."""
  results = {r["case"]: r["kernels"] + r.get("page_copies", "") for r in run_with_libtpu(_TPU_COMPILE, timeout=240)}
  assert results == {"megacore": "True", "bf16": "paged_attention0", "fp32": "paged_attention0"}, results
