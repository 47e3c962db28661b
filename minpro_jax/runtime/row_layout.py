"""Per-process rollout batches: each process holds, grades and places only its rows.

A step's global batch is B = `prompts_per_step` prompts × G = `group_size` samples, prompt-major (the G rows of
prompt p are rows [p G, (p + 1) G)). With n processes, process i owns the whole groups of prompts
[i B/n, (i + 1) B/n), i.e. rows [i B G/n, (i + 1) B G/n): group advantages computed from its own rows are exact,
and the rows are the contiguous block its devices hold when the batch axis splits over the mesh's `data`/`fsdp`
axes in process order (`check_layout`). `global_rows` makes the global sharded array from every process's block
(`jax.make_array_from_process_local_data`), `local_rows` reads a process's block back (`rows_to_host`: a device output's rows per process), and `batch_stats` reduces a step's statistics from per-process partial
sums, so no host needs the global batch. docs/multihost.md says what is wired into the trainer.

Every function is exact in a single-process run (one process owns every row) and makes no collective call there.
`global_rows` and `batch_stats` are collective: every process calls them at the same point.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.errors import ConfigError
from minpro_jax.runtime import multihost


def process_prompts(prompts_per_step: int, index: int | None = None, count: int | None = None) -> slice:
  """The prompts [start, stop) of a step's `prompts_per_step` that process `index` of `count` owns (default: this
  process): contiguous, equal, disjoint and in process order.

  Raises:
    ConfigError: `prompts_per_step` does not divide by the process count (naming both and the fix).
    ValueError: `index` not in [0, count).
  """
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  if not 0 <= index < count:
    raise ValueError(f"process index {index} not in [0, {count})")
  if prompts_per_step % count:
    lower = prompts_per_step - prompts_per_step % count
    raise ConfigError(
        f"config.prompts_per_step: {prompts_per_step} prompts do not split into whole groups over the run's "
        f"{count} processes (each process samples, grades and holds the groups of its own prompts); use a multiple "
        f"of {count}, e.g. {lower or count} or {lower + count}"
    )
  per = prompts_per_step // count
  return slice(index * per, (index + 1) * per)


def process_group_rows(
    prompts_per_step: int, group_size: int, index: int | None = None, count: int | None = None
) -> slice:
  """The rows [start, stop) of the step's prompt-major [B G] batch that process `index` owns: the G rows of each of
  its prompts (`process_prompts`). Raises as `process_prompts`."""
  prompts = process_prompts(prompts_per_step, index, count)
  return slice(prompts.start * group_size, prompts.stop * group_size)


def batch_sharding(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> NamedSharding:
  """The sharding of a batch whose leading (row) axis splits over the mesh axes `axes`; other axes replicated."""
  return NamedSharding(mesh, P(tuple(axes) or None))


def staging_sharding(devices, num_rows: int | None = None) -> NamedSharding:
  """The sharding that splits a batch's rows over the processes in process order, so that process i's devices hold
  exactly its rows (`process_group_rows`, for a row count that divides by the process count): over every device
  (process-major) when `num_rows` divides by the device count, else over the processes alone (each process's rows
  replicated on its devices). Each process places its rows on it with `global_rows` and no row crosses a process;
  a jitted program then reshards them to the learner's batch sharding (`minpro_jax.rl.process_inputs`), or orbax
  writes each process's rows.

  Args:
    devices: the devices to stage on (a mesh's `devices`, any shape, or a list), in an order where each process's
      devices are adjacent and the processes ascend (`make_mesh`'s default order; `jax.devices()`'s).
    num_rows: the global row count, or None (the rows split over the processes alone).

  Raises:
    ValueError: a process holds none of `devices`, or not as many as another, or they are not in process order.
  """
  flat = list(np.asarray(devices).flat)
  count = jax.process_count()
  procs = [d.process_index for d in flat]
  if procs != sorted(procs):
    raise ValueError(f"staging_sharding: the devices are not in process order (processes {procs})")
  per = [procs.count(i) for i in range(count)]
  if len(set(per)) != 1 or per[0] == 0:
    raise ValueError(f"staging_sharding: the processes hold {per} of the {len(flat)} devices, not equal shares")
  mesh = jax.sharding.Mesh(np.asarray(flat, object).reshape(count, per[0]), ("process", "local"))
  every = num_rows is not None and num_rows % len(flat) == 0
  return NamedSharding(mesh, P(("process", "local") if every else "process"))


def process_blocks(sharding: jax.sharding.Sharding, shape: int | tuple[int, ...]) -> list[tuple[int, int]]:
  """[(start, stop)] of the rows of an array of `shape` ([num_rows, ...]; an int: [num_rows]) that each process's
  devices hold under `sharding`, by process index; (0, 0) for a process holding none.

  Raises:
    ValueError: a process's devices hold rows that are not one contiguous block.
  """
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  spans: dict[int, list[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    rows = range(shape[0])[index[0]]
    spans.setdefault(device.process_index, []).append((rows.start, rows.stop))
  blocks = []
  for proc in range(jax.process_count()):
    merged: list[list[int]] = []
    for start, stop in sorted(set(spans.get(proc, []))):
      if merged and start <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], stop)
      else:
        merged.append([start, stop])
    if len(merged) > 1:
      raise ValueError(f"process {proc}'s devices hold the rows {[tuple(m) for m in merged]}: not one block")
    blocks.append(tuple(merged[0]) if merged else (0, 0))
  return blocks


def check_layout(sharding: jax.sharding.Sharding, prompts_per_step: int, group_size: int, field: str = "mesh.shape"):
  """Raises unless the devices of process i hold exactly its rows (`process_group_rows`) of the step's batch.

  Then each process can pass its own rows to `global_rows` and grade what it sampled. It holds for a batch axis that
  splits over the mesh axes whose devices are ordered by process (`make_mesh` keeps `jax.devices()`'s order).

  Raises:
    ConfigError: naming `config.<field>`, the process and the rows its devices hold against the rows it owns; or
      as `process_prompts`.
  """
  n = prompts_per_step * group_size
  count = jax.process_count()
  want = [process_group_rows(prompts_per_step, group_size, i, count) for i in range(count)]
  try:
    held = process_blocks(sharding, n)
    bad = [i for i in range(count) if held[i] != (want[i].start, want[i].stop)]
    if bad:
      (a, b), w = held[bad[0]], want[bad[0]]
      why = f"process {bad[0]}'s devices hold the rows [{a}, {b}), it owns [{w.start}, {w.stop})"
    else:
      why = ""
  except ValueError as e:
    why = str(e)
  if why:
    raise ConfigError(
        f"config.{field}: the step's {n} rows do not split over the processes by whole groups in process order "
        f"({why}); split the batch over the mesh axes 'data'/'fsdp' with each process's devices adjacent (the "
        "default device order)"
    )


def global_rows(local: Any, sharding: jax.sharding.Sharding, num_rows: int) -> Any:
  """The global [num_rows, ...] arrays laid out as `sharding`, made from this process's rows of every leaf.

  Args:
    local: a pytree of numpy arrays, each [rows this process owns, ...] (its `process_group_rows`; the same
      trailing shape and dtype on every process).
    sharding: a sharding of the leading axis (`batch_sharding`) satisfying `check_layout`.
    num_rows: the global row count.

  Raises:
    ValueError: a leaf whose leading dimension is not this process's share.
  """
  mine = process_blocks(sharding, num_rows)[jax.process_index()]

  def one(x):
    x = np.asarray(x)
    if x.shape[0] != mine[1] - mine[0]:
      raise ValueError(f"process {jax.process_index()} passed {x.shape[0]} rows, its devices hold rows {mine}")
    return jax.make_array_from_process_local_data(sharding, x, (num_rows, *x.shape[1:]))

  return jax.tree.map(one, local)


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of the global [N, ...] array `x` (the block `process_blocks` gives its devices), as numpy,
  read from its own shards: the per-process way back to the host, where `multihost.to_host` all-gathers N rows.

  Raises:
    ValueError: as `process_blocks`; or `x` is split along another axis than the rows (a shard is not whole rows).
  """
  start, stop = process_blocks(x.sharding, x.shape)[jax.process_index()]
  out, seen = None, set()
  for shard in x.addressable_shards:
    rows = range(x.shape[0])[shard.index[0]]
    if any(i != slice(None) and range(n)[i] != range(n) for i, n in zip(shard.index[1:], x.shape[1:])):
      raise ValueError(f"local_rows: {x.sharding} splits the array along an axis other than its rows")
    if rows.start in seen:
      continue  # a replica of rows already read
    seen.add(rows.start)
    if out is None:
      out = np.empty((stop - start, *x.shape[1:]), x.dtype)
    out[rows.start - start : rows.stop - start] = np.asarray(shard.data)
  return np.empty((0, *x.shape[1:]), x.dtype) if out is None else out


@functools.lru_cache(maxsize=64)
def take_rows(sharding: jax.sharding.Sharding, start: int, size: int):
  """A jitted program: rows [start, start + size) of every leaf of a tree of global arrays, laid out as `sharding`
  (the devices move the rows; no host holds them). Collective: every process runs it at the same point."""
  return jax.jit(lambda tree: jax.tree.map(lambda a: a[start : start + size], tree), out_shardings=sharding)


def rows_to_host(tree: Any, num_rows: int, devices, own: bool) -> tuple[Any, slice]:
  """The first `num_rows` rows of every array leaf of `tree` on the host: all of them (`own` False, or one process),
  or with `own` only this process's rows (`multihost.process_rows(num_rows)`: whole groups when the prompts split
  over the processes), read from its own devices.

  With `own` in a multi-process run, the device leaves are first laid out with the rows split over the processes
  in order (`take_rows` to `staging_sharding(devices, num_rows)`: the devices move them) and each process reads its
  block (`local_rows`): no all-gather. Host (numpy) leaves, and every leaf when `devices` cannot take that layout
  (None, not in process order with equal shares, or rows that do not split over the processes), are brought whole (`multihost.to_host`) and sliced.
  Collective in a multi-process run: every process calls it at the same point with the same tree structure.

  Args:
    tree: a pytree of [>= num_rows, ...] arrays (device or numpy); None leaves pass through.
    num_rows: the rows that count (the rest, padding, are dropped).
    devices: the devices the device leaves live on (a mesh's `devices`), or None.
    own: return only this process's rows.

  Returns:
    (the tree of numpy arrays, the rows [start, stop) of the `num_rows` they are).
  """
  if not own or jax.process_count() == 1:
    return jax.tree.map(lambda a: np.asarray(a)[:num_rows], multihost.to_host(tree)), slice(0, num_rows)
  rows = multihost.process_rows(num_rows)
  sharding = None
  if devices is not None and num_rows % jax.process_count() == 0:
    try:
      sharding = staging_sharding(devices, num_rows)
    except ValueError:
      sharding = None  # this layout cannot put each process's rows on its devices: the host path
  leaves, treedef = jax.tree.flatten(tree)
  on_device = [i for i, x in enumerate(leaves) if sharding is not None and isinstance(x, jax.Array)]
  out = list(leaves)
  if on_device:
    placed = multihost.settle(take_rows(sharding, 0, num_rows)(multihost.settle([leaves[i] for i in on_device])))
    for i, x in zip(on_device, placed):
      out[i] = local_rows(x)
  for i, x in enumerate(leaves):
    if i not in on_device:
      out[i] = np.asarray(multihost.to_host(x))[rows]
  return jax.tree.unflatten(treedef, out), rows


STATS = ("sum", "count", "min", "max")


def batch_stats(local: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
  """{name: {"sum", "count", "min", "max", "mean"}} of each named array over the rows of every process.

  `local` maps a name to this process's values (any shape; a process may pass an empty array). One all-gather of a
  [names, 4] float64 array (sorted names, so the processes agree); sums of float32 values are taken in float64, so
  a mean equals one process's up to float64 round-off. "min"/"max"/"mean" are nan when no process has a value.
  """
  names = sorted(local)
  part = np.zeros((len(names), len(STATS)), np.float64)
  for r, name in enumerate(names):
    x = np.asarray(local[name], np.float64).ravel()
    part[r] = (x.sum(), x.size, x.min(initial=np.inf), x.max(initial=-np.inf))
  if jax.process_count() > 1:
    every = np.asarray(multihost_utils.process_allgather(part, tiled=False))  # [processes, names, 4]
    part = np.stack([every[..., 0].sum(0), every[..., 1].sum(0), every[..., 2].min(0), every[..., 3].max(0)], -1)
  out = {}
  for name, (s, c, lo, hi) in zip(names, part):
    out[name] = {
        "sum": float(s),
        "count": int(c),
        "min": float(lo) if c else float("nan"),
        "max": float(hi) if c else float("nan"),
        "mean": float(s / c) if c else float("nan"),
    }
  return out
