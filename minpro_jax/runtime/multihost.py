"""What the host side of a run does when it spans several JAX processes (one per TPU host or GPU node).

The trainer's data flow across processes (docs/multihost.md):
  * every process computes the same global prompt batch (the order is a pure function of the seed and the step),
    builds the same host arrays and passes them to jit, which takes a host value as the *global* value;
  * device outputs that span other processes' devices come back with :func:`to_host` (an all-gather), so every
    process holds the same global rollout batch until the step's metrics are taken (then only its rows:
    `minpro_jax.rl.process_inputs`);
  * the costly host work, grading, is split: process i grades the rows :func:`process_rows` gives it and
    :func:`gather_rows` puts the results together on every process.
So a run's samples, rewards and updates do not depend on the process count. Every function here is the identity
(and makes no collective call) in a single-process run.

Every process must call the functions with collectives (:func:`to_host` of a sharded array, :func:`gather_rows`,
:func:`sum_over_processes`, :func:`check_same`, :func:`barrier`) in the same order, like any JAX collective.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from minpro_jax.errors import ConfigError, LaunchError

SHARED_DIR_TIMEOUT_S = 10.0  # how long the other processes wait to see process 0's file (NFS attribute caches)


def process_count() -> int:
  """The number of JAX processes of this run (`jax.process_count()`; 1 without `jax.distributed`)."""
  return jax.process_count()


def is_primary() -> bool:
  """Whether this process writes the run's files (metrics, tables, plots, summary): process 0."""
  return jax.process_index() == 0


def to_host(tree: Any) -> Any:
  """The global numpy value of every array leaf of `tree`, on every process.

  A leaf whose shards all live on this process (or that is replicated) is fetched locally; one that spans other
  processes' devices is all-gathered (`multihost_utils.process_allgather(tiled=True)`), which every process must
  call at the same point. Non-array leaves pass through.
  """

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(one, tree)


def settle(tree: Any) -> Any:
  """Waits for the arrays of `tree` in a multi-process CPU run; elsewhere returns at once (async dispatch kept).

  With JAX 0.10.2's CPU backend, two programs with gloo collectives in flight at once can deadlock every
  process (seen here: 400 dispatches of a jitted fsdp step without a wait hang, with a wait per step they run;
  `jax_cpu_enable_async_dispatch=False` does not cover multi-device programs). Call it on the outputs of a
  jitted step that is dispatched in a loop without a host read.
  """
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    jax.block_until_ready(tree)
  return tree


def process_rows(n: int, index: int | None = None, count: int | None = None) -> slice:
  """The contiguous rows [start, stop) of n that process `index` of `count` handles (default: this process).

  Rows are split as evenly as possible, the first processes taking one more; a process may get none when
  n < count. The slices of all processes are disjoint and cover range(n) in order.
  """
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  if not 0 <= index < count:
    raise ValueError(f"process index {index} not in [0, {count})")
  base, extra = divmod(n, count)
  start = index * base + min(index, extra)
  return slice(start, start + base + (index < extra))


def gather_rows(local: np.ndarray, n: int) -> np.ndarray:
  """The [n, ...] array whose rows `process_rows(n)` each process computed as `local`.

  Args:
    local: this process's rows, shape [len(range(n)[process_rows(n)]), ...]; every process passes the same
      trailing shape and dtype.
    n: the global row count.

  Raises:
    ValueError: `local` has the wrong number of rows.
  """
  local = np.asarray(local)
  rows = process_rows(n)
  if local.shape[0] != rows.stop - rows.start:
    raise ValueError(f"process {jax.process_index()} passed {local.shape[0]} rows, its share is {rows}")
  if jax.process_count() == 1:
    return local
  width = -(-n // jax.process_count())
  padded = np.zeros((width, *local.shape[1:]), local.dtype)
  padded[: local.shape[0]] = local
  stacked = np.asarray(multihost_utils.process_allgather(padded, tiled=False))  # [count, width, ...]
  parts = [stacked[i, : process_rows(n, i).stop - process_rows(n, i).start] for i in range(jax.process_count())]
  return np.concatenate(parts, axis=0)


def sum_over_processes(x: np.ndarray) -> np.ndarray:
  """The elementwise sum of `x` over all processes (counts, e.g. grading statistics), on every process."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x, tiled=False)).sum(0)


def check_same(value: str, what: str) -> None:
  """Raises on every process when `value` (e.g. the config, the command) differs between processes.

  Processes of one run must run the same program on the same data; a different command on one host would
  otherwise hang in a collective or train on a silently different run.

  Raises:
    LaunchError: naming `what` and the processes whose value differs from process 0's.
  """
  if jax.process_count() == 1:
    return
  digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], np.uint32).copy()
  every = np.asarray(multihost_utils.process_allgather(digest, tiled=False))
  odd = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
  if odd:
    raise LaunchError(
        f"{what} differs between processes: processes {odd} have another one than process 0; start every "
        "process with the same command"
    )


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (a no-op for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def check_shared_dir(path: str, field: str, timeout_s: float = SHARED_DIR_TIMEOUT_S) -> None:
  """Raises on every process unless `path` is one directory that every process sees (a no-op for one process).

  Process 0 writes a file with a random token into `path`; every other process must read that token from its own
  `path` within `timeout_s` seconds. A workdir that is not shared would otherwise end in orbax's 600 s timeout at
  the first checkpoint. Every process must call it at the same point (it makes collective calls).

  Raises:
    ConfigError: naming `config.<field>` (or `field` itself when it is a flag, `--out`), the processes that do not
      see the file, and the fix.
  """
  if jax.process_count() == 1:
    return
  name = field if field.startswith("--") else f"config.{field}"
  mine = np.frombuffer(os.urandom(8), np.uint32).copy()
  token = np.asarray(multihost_utils.process_allgather(mine, tiled=False))[0].tobytes().hex()  # process 0's
  probe = os.path.join(path, f".shared_dir_check_{token}")
  if is_primary():
    with open(probe + ".tmp", "w") as f:
      f.write(token)
    os.replace(probe + ".tmp", probe)
  barrier("minpro_shared_dir_written")
  deadline, seen = time.time() + timeout_s, False
  while not seen:
    try:
      with open(probe) as f:
        seen = f.read() == token
    except OSError:
      pass
    if seen or time.time() > deadline:
      break
    time.sleep(0.1)
  every = np.asarray(multihost_utils.process_allgather(np.asarray([int(seen)], np.int32), tiled=False)).ravel()
  if is_primary():
    os.remove(probe)  # every process has read it (or given up) before the all-gather above returned
  blind = [i for i, ok in enumerate(every.tolist()) if not ok]
  if blind:
    raise ConfigError(
        f"{name}: {path} is not one directory shared by every process: processes {blind} do not see the "
        f"file process 0 wrote there within {timeout_s:.0f} s; put it on a file system that every host mounts at "
        "the same path (NFS, gcsfuse, a Filestore share) and pass it as an absolute path (a relative path is "
        "taken from each process's current directory)"
    )
