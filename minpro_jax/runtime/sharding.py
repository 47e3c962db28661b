"""Device mesh and logical-axis sharding rules.

Every parameter and key activation of the model carries *logical* axis names ("embed", "mlp",
"q_heads", ...). A rule table maps each logical name to a mesh axis (or None = replicated); a
sharding sweep edits the rules or the mesh shape in the config, never the model code (MaxText's
design). Meshes use `AxisType.Auto` so XLA's GSPMD propagates shardings.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis. Batch is split over data and fsdp (ZeRO-3 style); weights over fsdp on their
# embed dimension and over tensor on heads / mlp / vocab; experts over the expert axis.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("layers", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("expert", "expert"),
    ("norm", None),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_seq", None),
)


def make_mesh(
    shape: Sequence[int] | dict[str, int] | None = None,
    axis_names: Sequence[str] = MESH_AXES,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """Builds a `jax.sharding.Mesh` with Auto axis types.

  Args:
    shape: sizes per axis, either a sequence aligned with `axis_names` or a dict {axis: size}; one entry
      may be -1 (filled with the remaining devices). None puts every device on "data".
    axis_names: mesh axis names (default ("data", "fsdp", "tensor", "expert")).
    devices: devices to use (default: all of `jax.devices()`).

  Raises:
    ValueError: the sizes do not multiply to the number of devices, or name an unknown axis.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  axis_names = tuple(axis_names)
  if shape is None:
    sizes = [n] + [1] * (len(axis_names) - 1)
  elif isinstance(shape, dict):
    unknown = set(shape) - set(axis_names)
    if unknown:
      raise ValueError(f"mesh shape names unknown axes {sorted(unknown)}; mesh axes are {axis_names}")
    sizes = [int(shape.get(a, 1)) for a in axis_names]
  else:
    sizes = [int(s) for s in shape]
    if len(sizes) != len(axis_names):
      raise ValueError(f"mesh shape {tuple(sizes)} has {len(sizes)} entries but axis_names has {len(axis_names)}")
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {tuple(sizes)}: at most one axis may be -1")
  if -1 in sizes:
    rest = math.prod(s for s in sizes if s != -1)
    if n % rest:
      raise ValueError(f"mesh shape {tuple(sizes)} cannot be filled from {n} devices")
    sizes[sizes.index(-1)] = n // rest
  if math.prod(sizes) != n or any(s <= 0 for s in sizes):
    raise ValueError(
        f"mesh shape {dict(zip(axis_names, sizes))} needs {math.prod(sizes)} devices but {n} are available; "
        "make the product of the axis sizes equal the device count"
    )
  return Mesh(np.asarray(devices).reshape(sizes), axis_names, axis_types=(AxisType.Auto,) * len(axis_names))


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules=DEFAULT_RULES) -> Iterator[None]:
  """Context in which models are created and run sharded: sets the mesh and the logical-axis rules.

  With `mesh=None` it is a no-op, so single-device code paths need no special casing.
  """
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
    yield


def replicate_local_leaves(tree, mesh: Mesh | None):
  """`tree` with every array leaf that lives on one device (scalars made with `jnp`, optax's step counts)
  replicated on `mesh`; the other leaves are returned as they are. The identity when `mesh` is None.

  The values go through the host and a jitted identity with the replicated output sharding, not through
  `jax.device_put`: with JAX 0.10.2, `device_put` of a one-device `jax.Array` into a sharding that spans several
  processes with one device each returns an array whose shards cannot be read (`addressable_shards` raises "When
  making an array from single-device arrays ... had 2 shard(s)"), which orbax then fails to write. Like any host
  value given to jit in a multi-process run, the leaves must hold the same values on every process.
  """
  leaves, treedef = jax.tree.flatten(tree)
  local = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and isinstance(x.sharding, SingleDeviceSharding)]
  if mesh is None or not local:
    return tree
  placed = jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, P()))(jax.device_get([leaves[i] for i in local]))
  for i, x in zip(local, placed):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def check_global(tree, mesh: Mesh, what: str) -> None:
  """Raises unless every array leaf of `tree` is a global array on `mesh` that orbax can write: laid out on
  exactly the mesh's devices, with shards that read back. A few attribute reads per leaf, no device work.

  Raises:
    ConfigError: naming `config.mesh.shape`, the first leaf at fault (its path in the tree `what`, e.g. "the
      learner state") and its layout.
  """
  devices = set(mesh.devices.flat)
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(x, jax.Array):
      continue
    if x.sharding.device_set != devices:
      problem = (
          f"is laid out on {len(x.sharding.device_set)} device(s) ({x.sharding}), not on the mesh's {len(devices)}"
      )
    else:
      try:
        x.addressable_shards  # noqa: B018 - raises for an array whose shards cannot be read
        continue
      except ValueError as e:
        problem = f"has shards that cannot be read ({e})"
    raise ConfigError(
        f"config.mesh.shape: leaf {jax.tree_util.keystr(path)} of {what} {problem}, so the run could not checkpoint it "
        f"(orbax writes global arrays on the run's mesh {dict(mesh.shape)}); this is a bug in minpro_jax or JAX, "
        "not in the config: report it with the launch command and the JAX version"
    )


def logical_split(mesh_shape: dict[str, int], logical: str, rules=DEFAULT_RULES) -> tuple[tuple[str, ...], int]:
  """(the mesh axes `rules` map the logical axis `logical` to, the product of their sizes in `mesh_shape` ({axis:
  size}; a missing axis has size 1)): a dimension with that logical name splits over the devices only in multiples
  of that product."""
  axes = dict(rules).get(logical) or ()
  axes = axes if isinstance(axes, tuple) else (axes,)
  return axes, math.prod(int(mesh_shape.get(a, 1)) for a in axes)


def batch_split(mesh_shape: dict[str, int], rules=DEFAULT_RULES) -> tuple[tuple[str, ...], int]:
  """`logical_split` of the logical "batch" axis: a batch splits over the devices only in multiples of its product."""
  return logical_split(mesh_shape, "batch", rules)


def logical_to_spec(logical_axes: Sequence[str | None], rules=None) -> P:
  """Resolves logical axis names to a `PartitionSpec` with the active (or given) rules."""
  table = dict(rules if rules is not None else active_rules())
  return P(*[table.get(a) if a is not None else None for a in logical_axes])


def mesh_axes(mesh, logical: str, size: int, exclude: Sequence[str] = ()) -> tuple[str, ...]:
  """The axes of `mesh` a logical axis splits over in a `jax.shard_map` spec.

  Args:
    mesh: the (abstract) mesh.
    logical: a logical axis name, resolved with the active rules (`use_mesh`).
    size: the length of the dimension it names.
    exclude: mesh axes already claimed by another dimension of the same array.

  Returns:
    The mesh axes (of size > 1, less `exclude`) the rules map `logical` to; () when there are none or the
    product of their sizes does not divide `size` (the dimension then stays whole on every device).
  """
  entry = logical_to_spec((logical,))[0]
  manual = manual_axes(mesh)
  names = tuple(
      a
      for a in (entry if isinstance(entry, tuple) else (entry,))
      if a in mesh.axis_names and a not in exclude and a not in manual and mesh.shape[a] > 1
  )
  return names if names and size % math.prod(mesh.shape[a] for a in names) == 0 else ()


def manual_axes(mesh) -> frozenset[str]:
  """The axes of an (abstract) mesh that an enclosing `jax.shard_map` made manual: no sharding names them."""
  return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def auto_axes(mesh) -> frozenset[str]:
  """The axes of an (abstract) mesh a `jax.shard_map` may still split over (`axis_names`): those not manual."""
  return frozenset(mesh.axis_names) - manual_axes(mesh)


def active_rules():
  """The logical-axis rules of the enclosing `use_mesh` (() outside one)."""
  return core_spmd.get_logical_axis_rules() or ()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op outside a mesh context.

  Axes that do not divide the mesh axis they map to are left unconstrained rather than padded. A mesh axis
  that two dimensions map to (e.g. "batch" -> (data, fsdp, expert) and "expert" -> expert in the MoE
  activations [B, T, E, F]) is kept only on the later dimension.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or not active_rules():
    return x
  spec = list(logical_to_spec(logical_axes))
  used: set[str] = set(manual_axes(mesh))  # inside a shard_map, its manual axes split nothing
  for i in reversed(range(len(spec))):  # a mesh axis claimed twice (batch and expert) stays on the later dim
    if spec[i] is None:
      continue
    names = tuple(a for a in (spec[i] if isinstance(spec[i], tuple) else (spec[i],)) if a not in used)
    used.update(names)
    spec[i] = names if len(names) > 1 else (names[0] if names else None)
  for i, axis in enumerate(spec):
    if axis is None:
      continue
    names = axis if isinstance(axis, tuple) else (axis,)
    if x.shape[i] % math.prod(mesh.shape[a] for a in names):
      spec[i] = None
  return jax.lax.with_sharding_constraint(x, P(*spec))
