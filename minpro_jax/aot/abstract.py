"""Ahead-of-time compilation helpers: TPU topologies as devices, and a model's parameters as sharded abstract values.

Nothing here allocates device memory: programs are lowered on `jax.ShapeDtypeStruct`s carrying `NamedSharding`s and
compiled for the devices of a topology (`jax.experimental.topologies`; TPU needs libtpu importable, which a CPU-only
machine can have: `pip install "jax[tpu]"`), so `compiled.memory_analysis()` reports per-device bytes of a slice
this machine does not have.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.transformer import Transformer
from minpro_jax.runtime.sharding import DEFAULT_RULES, use_mesh


def tpu_topology_devices(topology: str, chips_per_host: tuple[int, int, int]) -> list:
  """The devices of a TPU slice, e.g. ("v5p:2x2x2", (2, 2, 1)): 8 chips on 2 hosts.

  Raises:
    RuntimeError (from JAX): libtpu is not importable.
  """
  from jax.experimental import topologies

  desc = topologies.get_topology_desc(
      platform="tpu",
      topology_name=topology,
      chip_config_name="default",
      chips_per_host_bounds=chips_per_host,
      num_slices=1,
  )
  return list(desc.devices)


def abstract_params(config: ModelConfig, mesh: jax.sharding.Mesh, rules=None):
  """(graphdef, params) of `Transformer(config)`: params an `nnx.State` of `jax.ShapeDtypeStruct`s sharded on `mesh`
  by the logical-axis `rules` (None: the default; what `init_model(config, mesh=mesh, rules=rules)` would create,
  without creating it)."""
  with use_mesh(mesh, rules or DEFAULT_RULES):
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)), state
    )
  return graphdef, params
