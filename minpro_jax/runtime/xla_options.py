"""XLA options of the learner's programs (`jax.jit(..., compiler_options=...)`), per platform.

On TPU, XLA may partition a matmul whose weight is FSDP-sharded on its contracting dimension as a "windowed einsum"
(collective matmul): a loop over the weight's shards, each step multiplying the whole activation by one shard and
adding into a full-sized output. With the learner's long rows (a 22,528-token row per chip at the papers' lengths)
every step reads and writes that output in HBM: the Qwen3-8B score pass on v5p-64 moved 81 GB of HBM per layer and
was HBM-bound; with the all-gather of each layer's weights instead (tens of MB per chip) it moves 8 GB and is
compute-bound (benchmarks/README.md, "Packed learner rows"). So the learner's programs turn windowed einsums off on
TPU. The sampler's programs keep XLA's defaults (a decode step's activations are a few rows).
"""

from __future__ import annotations

LEARNER_TPU_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


def learner_compiler_options(mesh) -> dict[str, bool] | None:
  """The `compiler_options` of the learner's jitted programs on `mesh` (None: no mesh, or not a TPU mesh)."""
  if mesh is None or mesh.devices.flat[0].platform != "tpu":
    return None
  return dict(LEARNER_TPU_OPTIONS)
