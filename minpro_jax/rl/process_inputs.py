"""The learner's inputs from per-process rows: each process holds only its rows of a step's batch.

In a run of n processes, with N = `prompts_per_step` x `group_size` rows a step:
  1. The sampler returns each process its rows (`Sampler.generate(own_rows=True)`: the whole groups of
     `row_layout.process_group_rows`), and `score` runs the learner's score pass on them: the score inputs are
     staged from each process's rows and each process reads back its rows of the log-probs. The step's batch is
     then this process's rows; `own_rows` keeps them of a global batch (dynamic sampling's rounds, a checkpoint
     written whole). The buffer, and its checkpoint, therefore hold N/n rows per process.
  2. `stage` (when the buffer releases the batch): the learner's [N, ...] global arrays (`UpdateInputs`) are made
     from every process's rows with `jax.make_array_from_process_local_data` on the staging sharding
     (`row_layout.staging_sharding`: rows split over the processes in order, and over each process's devices when
     they divide, so no row leaves its host); the [N] per-sample
     vectors the step's metrics read (`policy_version`, real tokens) are all-gathered (16 bytes a row).
  3. `mini_batches`: mini-batch j (rows [j M, (j + 1) M)) is sliced on the devices and resharded to the learner's
     batch sharding (`learner_sharding`) by one jitted program; its rows may sit on one process and the devices, not
     the hosts, move them.
  4. `Learner.update_arrays` takes those global arrays.
  5. `buffer_to_global` / `buffer_layout` / `buffer_template`: each process writes its own rows of the waiting
     batches to the orbax checkpoint (global arrays on the staging sharding of every device) and reads back only
     them on resume (`checkpoint.RunCheckpointer.restore_latest`, `row_layout.local_rows`).

In a one-process run `own_rows`, `gather_batch` and `buffer_to_global` return their input, `score` is
`Learner.score`, and the trainer keeps its host path (`RolloutBatch.split`, `Learner.update`), so a one-process run
is unchanged bit for bit.

Collective host calls: `score`, `stage`, `gather_batch` (all-gathers) and `buffer_to_global`'s checkpoint write are
called by every process at the same point, from the main thread (the overlapped step's learner thread only runs
programs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.errors import ConfigError
from minpro_jax.rl import process_packing
from minpro_jax.rl.epochs import epoch_rows
from minpro_jax.rl.learner import Learner, staleness
from minpro_jax.rl.learner_inputs import SCORE_ROW_FIELDS, UPDATE_ROW_FIELDS, ScoreInputs, UpdateInputs
from minpro_jax.rl.proximal import interpolation_alpha
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.rl.token_staleness import VersionCounts, gather_version_counts, version_counts
from minpro_jax.runtime import multihost, row_layout
from minpro_jax.runtime.sharding import DEFAULT_RULES, active_rules, batch_split


def _input_fields(local, names, replay: bool) -> dict:
  """The learner-input arrays of a process's rows: `names` of `local` (a `RolloutBatch`), its routes with router
  replay, its kept-logp thresholds where it has them. Raises ValueError: replay without routes in the batch."""
  fields = {f: getattr(local, f) for f in names}
  if replay:
    if local.routes is None:
      raise ValueError(
          "LossConfig.router_replay=True but the batch has no routes; sample it with Sampler(record_routes=True)"
      )
    fields["routes"] = local.routes
  if local.kept_logp_threshold is not None:
    fields["kept_logp_threshold"] = local.kept_logp_threshold
  return fields


def own_rows(batch: RolloutBatch, prompts_per_step: int, group_size: int) -> RolloutBatch:
  """This process's rows of the step's global batch (`row_layout.process_group_rows`), copied so the global arrays
  can be freed; `batch` itself in a one-process run.

  Raises:
    ValueError: `batch` is not the step's N = prompts_per_step x group_size rows; as `process_group_rows`.
  """
  if jax.process_count() == 1:
    return batch
  if batch.size != prompts_per_step * group_size:
    raise ValueError(f"own_rows: a batch of {batch.size} rows, the step has {prompts_per_step * group_size}")
  rows = row_layout.process_group_rows(prompts_per_step, group_size)
  return jax.tree.map(np.array, batch.select(rows))


def gather_batch(local: RolloutBatch, num_rows: int) -> RolloutBatch:
  """The global batch of `num_rows` rows on every process from each process's rows (an all-gather of every field):
  what the learner's packing reads (its plan spans the mini-batch's rows of every process). `local` in a
  one-process run."""
  if jax.process_count() == 1:
    return local
  return RolloutBatch.from_dict({k: multihost.gather_rows(v, num_rows) for k, v in local.to_dict().items()})


@dataclasses.dataclass(frozen=True)
class StagedBatch:
  """A released batch as the learner's global arrays (`stage`).

  Attributes:
    arrays: `UpdateInputs` of global [N, ...] arrays on the staging sharding (rows split over the processes).
    policy_version: [N] int64 version that sampled each row, of every process's rows.
    real_tokens: the batch's real (segment id != 0) tokens over every process.
    versions: the per-token versions of every process's rows (`token_staleness.gather_version_counts`), for the
      step's per-token staleness metrics; None when not gathered.
  """

  arrays: UpdateInputs
  policy_version: np.ndarray
  real_tokens: int
  versions: VersionCounts | None = None

  @property
  def size(self) -> int:
    return int(self.policy_version.shape[0])


def stage(local: RolloutBatch, mesh: jax.sharding.Mesh, num_rows: int, replay: bool = False) -> StagedBatch:
  """The global arrays an update reads, made from this process's rows `local` on the staging sharding of the
  learner's devices (`mesh.devices`); every process calls it at the same point (one all-gather of [N, 2] int64).

  Args:
    local: this process's rows (`own_rows`) of a batch of `num_rows` rows.
    replay: router replay (`LossConfig.router_replay`): the routes travel too.

  Raises:
    ValueError: replay without routes in the batch; `local` is not this process's share of `num_rows`; the mesh's
      devices are not in process order with equal shares (`row_layout.staging_sharding`).
  """
  fields = _input_fields(local, UPDATE_ROW_FIELDS, replay)
  placed = row_layout.global_rows(fields, row_layout.staging_sharding(mesh.devices, num_rows), num_rows)
  every = _per_row(local, num_rows)
  return StagedBatch(UpdateInputs(**placed), every[:, 0], int(every[:, 1].sum()))


def _per_row(local: RolloutBatch, num_rows: int) -> np.ndarray:
  """[N, 2] int64 (policy version, real tokens) of every process's rows (an all-gather of 16 bytes a row)."""
  per_row = np.stack([local.policy_version, (local.segment_ids != 0).sum(1)], axis=1).astype(np.int64)
  return multihost.gather_rows(per_row, num_rows)


def learner_sharding(mesh: jax.sharding.Mesh, rows: int) -> jax.sharding.NamedSharding:
  """The learner's batch sharding of a [rows, ...] mini-batch: rows over the mesh axes the logical "batch" axis maps
  to (those of size > 1), or replicated when their product does not divide `rows`."""
  axes = tuple(a for a in batch_split(dict(mesh.shape), active_rules() or DEFAULT_RULES)[0] if mesh.shape.get(a, 1) > 1)
  if rows % math.prod(mesh.shape[a] for a in axes):
    axes = ()
  return row_layout.batch_sharding(mesh, axes)


def mini_batches(
    staged: StagedBatch, num: int, mesh: jax.sharding.Mesh, rows: np.ndarray | None = None
) -> Iterator[UpdateInputs]:
  """`num` equal consecutive mini-batches of `staged` (of its rows in the order `rows`, a permutation of them, when
  given: `minpro_jax.rl.epochs`), each taken on the devices and laid out on the learner's batch sharding
  (`learner_sharding`), one at a time (a mini-batch is made when the loop asks for it).

  Raises:
    ValueError: the batch size is not divisible by `num` (`RolloutBatch.split`'s message); `rows` with packed
      arrays (their rows are the packed rows of each mini-batch).
  """
  n = staged.size
  if num <= 0 or n % num:
    raise ValueError(f"cannot split a batch of {n} samples into {num} equal mini-batches")
  m = staged.arrays.tokens.shape[0] // num  # packed (`process_packing.stage`): each mini-batch's R packed rows
  sharding = learner_sharding(mesh, m)
  if rows is not None and staged.arrays.tokens.shape[0] != n:
    raise ValueError("mini_batches: a row order needs unpacked arrays (one sample per row)")
  for j in range(num):
    if rows is None:
      yield multihost.settle(row_layout.take_rows(sharding, j * m, m)(staged.arrays))
    else:  # the same program for every order: the rows are an argument (replicated int32, the same on every process)
      yield multihost.settle(_take_at(sharding)(staged.arrays, np.asarray(rows[j * m : (j + 1) * m], np.int32)))


@functools.lru_cache(maxsize=8)
def _take_at(sharding: jax.sharding.Sharding):
  """A jitted `(tree, rows) -> the rows [rows] of every leaf`, laid out as `sharding` (the devices move them)."""
  return jax.jit(lambda tree, rows: jax.tree.map(lambda a: jnp.take(a, rows, axis=0), tree), out_shardings=sharding)


def for_learner(
    released: RolloutBatch | None, learner: Learner, num_rows: int, num: int
) -> RolloutBatch | StagedBatch | None:
  """What `updates` takes of the batch of `num_rows` rows the delay buffer released for `num` updates (None passes
  through): in one process the batch itself; in several, where each holds its own rows, their global arrays on the
  learner's devices (`stage`; with packing, `learner.row_tokens`, each process's mini-batches packed on it:
  `process_packing.stage`), or the rows all-gathered to every host (`gather_batch`) when the learner's mesh cannot
  take per-process rows (devices not in process order with equal shares) or, packed, a mini-batch spans processes
  (`num` not a multiple of the process count; logged). Collective (module docstring)."""
  if released is None or jax.process_count() == 1:
    return released
  mesh, replay = learner.mesh, learner.loss_cfg.router_replay
  try:
    row_layout.staging_sharding(mesh.devices)
  except ValueError:
    return gather_batch(released, num_rows)  # this mesh cannot take per-process rows: the host path
  versions = gather_version_counts(version_counts(released), num_rows)  # the per-token staleness metrics
  if learner.row_tokens is None:
    return dataclasses.replace(stage(released, mesh, num_rows, replay), versions=versions)
  if num <= 0 or num_rows % num or not process_packing.fits(num_rows, num_rows // num):
    _warn_gathered(num, num_rows)
    return gather_batch(released, num_rows)
  every = _per_row(released, num_rows)
  arrays = process_packing.stage(released, learner, num_rows, num, every[:, 1])
  return StagedBatch(arrays, every[:, 0], int(every[:, 1].sum()), versions)


_warned = []


def _warn_gathered(num: int, num_rows: int) -> None:
  if not _warned:
    _warned.append(True)
    logging.warning(
        "packing (learner.row_tokens): %d mini-batches of a %d-row batch do not lie within the %d processes' rows, "
        "so every host gathers and packs the whole batch; make num_updates_per_step a multiple of the process count",
        num, num_rows, jax.process_count(),
    )  # fmt: skip


def score(learner: Learner, params: Any, local: RolloutBatch, num_rows: int, *, return_routes: bool = False,
          chunk_rows: int | None = None):  # fmt: skip
  """`Learner.score(chunk_rows=...)` of a batch of `num_rows` rows of which this process holds its own (`local`:
  whole groups, `row_layout.process_group_rows`), returning this process's rows of the [N, L] log-probs (and with
  `return_routes` of the learner's [N, L, layers, k] routes); `learner.score(params, local, ...)` in one process.

  The score inputs are staged from each process's rows (`row_layout.global_rows` on the staging sharding of the
  learner's devices), resharded to the learner's batch sharding on the devices, scored by the learner's program,
  and each process reads its rows of the outputs back from its own devices (`row_layout.rows_to_host`): no host
  holds the batch. Packed (`learner.row_tokens`), each process packs its own chunks of `chunk_rows` samples
  (`process_packing.score`). With a mesh whose devices cannot hold each process's rows, or packed chunks that span
  processes, the rows are all-gathered and scored whole (`gather_batch`), and each process keeps its rows of the
  result. Collective: every process calls it at the same point, in the caller's `use_mesh`.

  Raises:
    ValueError: N not divisible by the micro-batch size; replay without routes; `local` is not this process's
      share of `num_rows`.
  """
  if jax.process_count() == 1:
    return learner.score(params, local, return_routes=return_routes, chunk_rows=chunk_rows)
  mesh = learner.mesh
  try:
    staging = None if mesh is None else row_layout.staging_sharding(mesh.devices, num_rows)
  except ValueError:
    staging = None
  packed = learner.row_tokens is not None
  if staging is not None and packed and process_packing.fits(num_rows, chunk_rows or num_rows):
    sharding_of = lambda rows: learner_sharding(mesh, rows)  # noqa: E731
    return process_packing.score(
        learner, params, local, num_rows, chunk_rows or num_rows, sharding_of, return_routes=return_routes
    )
  if staging is None or packed:
    rows = multihost.process_rows(num_rows)
    out = learner.score(params, gather_batch(local, num_rows), return_routes=return_routes, chunk_rows=chunk_rows)
    return jax.tree.map(lambda a: np.array(a[rows]), out)
  mb = min(learner.micro_batch_size, num_rows)
  if num_rows % mb:
    raise ValueError(f"batch of {num_rows} rows is not divisible by micro_batch_size {mb}")
  fields = _input_fields(local, SCORE_ROW_FIELDS, learner.loss_cfg.router_replay)
  placed = multihost.settle(row_layout.global_rows(fields, staging, num_rows))
  placed = multihost.settle(row_layout.take_rows(learner_sharding(mesh, num_rows), 0, num_rows)(placed))
  logp, routes = multihost.settle(learner.jitted_score(params, ScoreInputs(**placed), mb))
  (logp, routes), _ = row_layout.rows_to_host((logp, routes if return_routes else None), num_rows, mesh.devices, True)
  return (logp, routes) if return_routes else logp


def updates(
    learner: Learner,
    state: Any,
    batch: RolloutBatch | StagedBatch,
    num: int,
    lr_scale: float = 1.0,
    *,
    num_epochs: int = 1,
    group_size: int = 1,
    seed: int = 0,
) -> tuple[Any, list[dict[str, Any]], np.ndarray, int]:
  """`num_epochs` passes over `batch`, each `num` optimizer updates, one per equal consecutive mini-batch of the
  pass's row order (`minpro_jax.rl.epochs.epoch_rows` of `group_size`, `seed`; host rows: `RolloutBatch.select` /
  `split` and `Learner.update_inputs`; staged: `mini_batches`), inside the caller's `use_mesh`. Every update after
  the first gets the previous update's gradient (the `grad_cosine` metric). With decoupled PPO it first scores the
  batch at the parameters before the first update (`LossConfig.reads_proximal_logp`, pi_prox) or gives each update
  A-3PO's interpolation weight (`minpro_jax.rl.proximal`).

  Returns:
    (the state after them, each update's metrics, the [num_epochs x N] int64 staleness of every row at each of its
    updates, the real tokens the updates ran: the batch's times num_epochs).

  Raises:
    ValueError: the batch size is not divisible by `num`, or a mini-batch by `group_size`; as the learner's update.
    ConfigError: num_epochs > 1 with packed staged arrays (`process_packing.stage`: each process packed its own
      mini-batches, which a reordered pass cannot reuse).
  """
  n = batch.size
  if num <= 0 or n % num:
    raise ValueError(f"cannot split a batch of {n} samples into {num} equal mini-batches")
  if num_epochs < 1 or (n // num) % group_size:
    raise ValueError(
        f"num_epochs must be >= 1 and each mini-batch of {n // num} rows hold whole groups of {group_size}"
    )
  loss_cfg, first = learner.loss_cfg, int(state.step)
  staged = isinstance(batch, StagedBatch)
  if staged and num_epochs > 1 and batch.arrays.tokens.shape[0] != n:
    raise ConfigError(
        "config.num_epochs: passes after the first reorder the batch's groups, but in this multi-process run each "
        "process packed its own mini-batches (learner.row_tokens); set num_epochs=1 or learner.row_tokens=0"
    )
  if loss_cfg.reads_proximal_logp:  # decoupled PPO's pi_prox: the parameters before the step's first update
    if staged:
      logp, _ = learner.jitted_score(state.params, batch.arrays.score_inputs(), learner.micro_batch(n // num))
      batch = dataclasses.replace(batch, arrays=batch.arrays._replace(proximal_logp=logp))
    else:
      logp = learner.score(state.params, batch, chunk_rows=n // num)
      batch = batch.replace(proximal_logp=np.where(batch.response_mask, logp, 0.0).astype(np.float32))
  versions, interpolate = batch.policy_version, loss_cfg.proximal == "interpolate"
  ups, stale, grads = [], [], None
  for epoch in range(num_epochs):
    rows = epoch_rows(n, group_size, epoch, seed, first)
    if staged:
      minis = ((arrays, None) for arrays in mini_batches(batch, num, learner.mesh, rows if epoch else None))
    else:  # each mini-batch's device arrays made when the loop asks for them
      host = batch.split(num) if not epoch else batch.select(rows).split(num)
      minis = (learner.update_inputs(mini, learner.micro_batch(mini.size)) for mini in host)
    for j, (arrays, pad) in enumerate(minis):
      version = versions[rows[j * (n // num) : (j + 1) * (n // num)]]
      current = int(state.step)
      stale.append(staleness(current, version))
      if interpolate:
        arrays = arrays._replace(proximal_alpha=interpolation_alpha(version, first, current))
      state, m, grads = learner.update_arrays(state, arrays, lr_scale, pad_fraction=pad, previous_grads=grads)
      ups.append(m)
  tokens = batch.real_tokens if staged else int(batch.segment_ids.sum())
  return state, ups, np.concatenate(stale), tokens * num_epochs


# ---------------------------------------------------------------------------------------------- the delay buffer
def buffer_layout(state: dict[str, Any], num_rows: int) -> dict[str, Any]:
  """JSON for the checkpoint's meta: {"rows": N, "batches": {name: {field: [global shape, dtype]}}} of the
  `RolloutBuffer.state_dict()` `state` of this process's rows: what `buffer_template` restores."""
  batches = {}
  for name, fields in state["batches"].items():
    batches[name] = {f: [[num_rows, *np.shape(v)[1:]], np.asarray(v).dtype.str] for f, v in fields.items()}
  return {"rows": int(num_rows), "batches": batches}


def buffer_to_global(state: dict[str, Any], num_rows: int) -> dict[str, Any]:
  """`RolloutBuffer.state_dict()` of this process's rows with every batch field as a global [N, ...] array on the
  staging sharding of all devices: orbax then writes each process's rows from that process. `state` itself in a
  one-process run.

  Raises:
    ValueError: as `row_layout.global_rows` / `staging_sharding`.
  """
  if jax.process_count() == 1:
    return state
  sharding = row_layout.staging_sharding(jax.devices(), num_rows)
  batches = {k: row_layout.global_rows(dict(b), sharding, num_rows) for k, b in state["batches"].items()}
  return {"steps": state["steps"], "batches": batches}


def buffer_template(meta: dict[str, Any]) -> dict[str, Any] | None:
  """The abstract batches (`jax.ShapeDtypeStruct`s on the staging sharding of all devices) of the buffer written
  with `buffer_layout(...)` in `meta["buffer"]`, for `RunCheckpointer.restore_latest`; None for a checkpoint whose
  buffer was written whole by process 0 (one-process runs, and multi-process runs before per-process buffers)."""
  layout = meta.get("buffer")
  if layout is None:
    return None
  sharding = row_layout.staging_sharding(jax.devices(), layout["rows"])
  return {
      name: {
          f: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding) for f, (shape, dtype) in b.items()
      }
      for name, b in layout["batches"].items()
  }
