"""Orbax checkpoints of a whole run: everything needed to resume bit-exactly.

A run checkpoint at global step s holds
  * "state": the learner `TrainState` (parameters, optax state incl. its step count, update counter),
  * "buffer": the rollout batches waiting in the delay buffer (without them a resumed run would change
    its staleness); in a multi-process run each process writes and reads back its own rows of them (global arrays,
    `minpro_jax.rl.process_inputs`),
  * "meta": JSON with the global step, the data iterator state, the best evaluation score so far and
    counters.
PRNG keys are derived from (seed, global step), so they need no storage beyond the step.

`RunCheckpointer` keeps the last K run checkpoints under `workdir/checkpoints` and, separately, the
parameters of the best evaluation under `workdir/best` (the papers select the checkpoint with the best
average score).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from minpro_jax.errors import CheckpointError, DiskFullError
from minpro_jax.runtime import multihost, row_layout
from minpro_jax.runtime.param_files import abstract_like

logger = logging.getLogger(__name__)


class RunCheckpointer:
  """Save / restore run checkpoints (last `keep` kept) and the best parameters.

  Args:
    workdir: run directory; checkpoints go to `workdir/checkpoints`, best params to `workdir/best`.
    keep: number of most recent run checkpoints kept.
  """

  def __init__(self, workdir: str, keep: int = 2):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    self.workdir = os.path.abspath(workdir)
    self._keep = keep
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self._mngr = ocp.CheckpointManager(os.path.join(self.workdir, "checkpoints"), options=opts)
    self._best = ocp.CheckpointManager(
        os.path.join(self.workdir, "best"), options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
    )

  def check_disk_space(self, state: Any, params: Any) -> None:
    """Fails fast when the workdir's disk cannot hold the checkpoints the run will still write.

    Orbax only finds a full disk when it writes, which for the best parameters may be at the end of the run, so
    without this check a long run can train for hours and then lose its result. Orbax writes a new checkpoint
    before it deletes the oldest, so at its peak a run holds `keep + 1` run checkpoints (`state` and the small
    rollout buffer, which is ignored) and 2 best-params checkpoints (`params`); those already on disk are
    subtracted. Sizes are the arrays' bytes (`size * itemsize`), so this is an estimate, not a guarantee.

    Args:
      state: the learner state pytree that `save` will write (parameters and optimizer state).
      params: the parameter pytree that `save_best` will write.

    Raises:
      OSError: when the workdir's filesystem has fewer free bytes than that; the message gives both sizes in
        GB, the path, and the fixes.
    """
    n_state = max(1, self._keep + 1 - len(self._mngr.all_steps()))
    n_params = max(1, 2 - len(self._best.all_steps()))
    need = n_state * _tree_bytes(state) + n_params * _tree_bytes(params)
    free = shutil.disk_usage(self.workdir).free
    if free < need:
      raise DiskFullError(
          f"config.workdir: {self.workdir} has {free / 1e9:.2f} GB free, but the {n_state} run "
          f"checkpoint(s) and {n_params} best-parameter checkpoint(s) this run will still write need about "
          f"{need / 1e9:.2f} GB. Free disk space there, set workdir to a disk with room (e.g. "
          f"`--config.workdir=/mnt/disk/run`), or lower `--config.checkpoint.keep`."
      )

  def latest_step(self) -> int | None:
    """Global step of the newest complete run checkpoint, or None."""
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, buffer_state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes the run checkpoint of global step `step` (blocking, so a following exit loses nothing).

    A run checkpoint of global step s always describes the state after step s, so if one for `step` already exists
    (e.g. the periodic save of the last step followed by the end-of-run save) it is kept and nothing is written;
    orbax would otherwise raise StepAlreadyExistsError.
    """
    if step in self._mngr.all_steps():
      return
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        buffer=ocp.args.StandardSave(_numpy_tree(buffer_state)),
        meta=ocp.args.JsonSave(meta),
    )
    self._write(self._mngr, step, args, "run checkpoint")

  def restore(self, step: int, state_template: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Restores (state, buffer_state, meta) of `step`; `state_template` gives the structure and shardings."""
    meta = self._restore_meta(step)
    return (*self._restore_arrays(step, state_template), meta)

  def _restore_meta(self, step: int) -> dict[str, Any]:
    return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _restore_arrays(
      self, step: int, state_template: Any, batches_template: Any = None, inflight_template: Any = None
  ) -> tuple[Any, dict[str, Any]]:
    """(state, buffer tree); with `batches_template` (the waiting batches as abstract global arrays, a per-process
    buffer: `process_inputs.buffer_template`) each process reads back only its rows of them; with
    `inflight_template` (`InflightRunner.checkpoint_template`) the streaming pool's device arrays come back as
    global arrays on their shardings (each process reads its shards) and its graded batches as this process's rows."""
    buffer_args = ocp.args.StandardRestore()
    if batches_template is not None or inflight_template is not None:
      count = len(batches_template or {})
      tree = {
          "count": np.zeros((), np.int64),
          "steps": np.zeros((count + 1,), np.int64),
          "batches": batches_template or {"_": np.zeros(())},
      }
      if inflight_template is not None:
        tree["inflight"] = inflight_template
      buffer_args = ocp.args.StandardRestore(tree)
    restored = self._mngr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(state_template)), buffer=buffer_args)
    )
    buffer = dict(restored["buffer"])
    inflight = buffer.pop("inflight", None)
    buffer = jax.tree.map(_host_rows, buffer)
    if inflight is not None:  # the pool's device arrays stay global; the graded batches become this process's rows
      buffer["inflight"] = {**inflight, "ready": jax.tree.map(_host_rows, inflight["ready"])}
    return restored["state"], buffer

  def restore_latest(
      self,
      state_template: Any,
      check_meta: Callable[[dict[str, Any]], None] | None = None,
      buffer_template: Callable[[dict[str, Any]], Any] | None = None,
      inflight_template: Callable[[dict[str, Any]], Any] | None = None,
  ) -> tuple[int, Any, dict[str, Any], dict[str, Any]] | None:
    """Restores the newest run checkpoint that reads back, falling back to older ones.

    Orbax only lists checkpoints whose write finished, so a preempted save is never seen; this handles one that
    was damaged afterwards (a truncated or deleted file). For each step, newest first: the JSON meta is read and
    passed to `check_meta` (the trainer's config comparison, so a config change is reported as such and never
    taken for damage), then the arrays. If an older step restores, the newer unreadable ones are moved to
    `workdir/checkpoints_unreadable/` (kept for inspection, out of the way of the steps the run will save again)
    and a warning names them.

    Args:
      state_template: pytree giving the state's structure, dtypes and shardings.
      check_meta: called with each checkpoint's meta before its arrays are read; exceptions it raises propagate.
      buffer_template: called with the meta: the abstract waiting batches of a buffer written per process
        (`process_inputs.buffer_template`; each process then gets back its own rows), or None for one written whole.
      inflight_template: called with the meta: the abstract streaming pool and graded batches
        (`InflightRunner.checkpoint_template`), or None (read back whole).

    Returns:
      (step, state, buffer_state, meta), or None when there is no run checkpoint.

    Raises:
      CheckpointError: when no checkpoint reads back; the message names the newest one and its error, and no
        checkpoint is moved.
    """
    steps = sorted(self._mngr.all_steps(), reverse=True)
    errors: list[tuple[int, Exception]] = []
    for step in steps:
      try:
        meta = self._restore_meta(step)
      except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
        errors.append((step, e))
        continue
      if check_meta is not None:
        check_meta(meta)
      try:
        batches = None if buffer_template is None else buffer_template(meta)
        inflight = None if inflight_template is None else inflight_template(meta)
        state, buffer_state = self._restore_arrays(step, state_template, batches, inflight)
      except Exception as e:  # noqa: BLE001
        errors.append((step, e))
        continue
      if errors:
        self._set_aside(errors, fallback=step)
      return step, state, buffer_state, meta
    if errors:
      newest, err = errors[0]
      raise CheckpointError(
          f"config.workdir: no run checkpoint under {self.workdir}/checkpoints reads back (steps "
          f"{[s for s, _ in errors]}); the newest, {newest}, fails with {type(err).__name__}: "
          f"{str(err).rstrip('.')}. If the config changed the parameter or optimizer-state structure "
          "(e.g. model or optimizer settings), resume with the original config or use a new "
          "--config.workdir; if the files are damaged, repair or delete those step folders"
      ) from err
    return None

  def _set_aside(self, errors: list[tuple[int, Exception]], fallback: int) -> None:
    aside = os.path.join(self.workdir, "checkpoints_unreadable")
    multihost.barrier("checkpoints read")  # every process has read before process 0 moves the folders
    if multihost.is_primary():
      self._move_aside(errors, fallback, aside)
    multihost.barrier("checkpoints set aside")
    self._mngr.reload()

  def _move_aside(self, errors: list[tuple[int, Exception]], fallback: int, aside: str) -> None:
    os.makedirs(aside, exist_ok=True)
    for step, reason in errors:
      src = os.path.join(self.workdir, "checkpoints", str(step))
      dst = os.path.join(aside, f"{step}_{int(time.time())}")
      shutil.move(src, dst)
      logger.warning(
          "run checkpoint %d does not read back (%s: %s); moved it to %s and resumed from step %d",
          step,
          type(reason).__name__,
          str(reason)[:300],
          dst,
          fallback,
      )

  def save_best(self, step: int, params: Any, meta: dict[str, Any]) -> None:
    """Stores `params` as the best-so-far parameters (replacing the previous best).

    If a best checkpoint of `step` already exists it is kept (a re-run of a finished run repeats its final
    evaluation, with the same parameters); orbax would otherwise raise StepAlreadyExistsError.
    """
    if step in self._best.all_steps():
      return
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta))
    self._write(self._best, step, args, "best-parameter checkpoint")

  def _write(self, mngr: ocp.CheckpointManager, step: int, args: Any, what: str) -> None:
    """Saves and waits; a full disk becomes an OSError(ENOSPC) that names the workdir and says how to resume."""
    try:
      mngr.save(step, args=args, force=True)
      mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - tensorstore reports ENOSPC as ValueError("... os_error_code='28'")
      if not _disk_full(e):
        raise
      for tmp in glob.glob(os.path.join(str(mngr.directory), f"{step}.orbax-checkpoint-tmp*")):
        shutil.rmtree(tmp, ignore_errors=True)  # the partial write; the complete checkpoints stay
      raise DiskFullError(
          errno.ENOSPC,
          f"config.workdir: the disk under {self.workdir} filled up while writing the "
          f"{what} of step {step} (the partial write was removed; the run checkpoints on disk, newest "
          f"{self._mngr.latest_step()}, are intact). Free space there, or lower "
          "--config.checkpoint.keep, and re-run the same command to resume.",
      ) from e

  def best_step(self) -> int | None:
    return self._best.latest_step()

  def best_meta(self) -> dict[str, Any] | None:
    """The meta ({"score", "step"}) of the best-parameter checkpoint on disk, None when there is none."""
    step = self._best.latest_step()
    if step is None:
      return None
    return self._best.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def close(self) -> None:
    self._mngr.close()
    self._best.close()


def _disk_full(e: BaseException) -> bool:
  """Whether `e` (or an exception it was raised from) is a "no space left on device" error."""
  while e is not None:
    if (
        (isinstance(e, OSError) and e.errno == errno.ENOSPC)
        or "No space left on device" in str(e)
        or "os_error_code='28'" in str(e)
    ):
      return True
    e = e.__cause__ or e.__context__
  return False


def _tree_bytes(tree: Any) -> int:
  """Bytes of the array leaves of `tree` (global shapes, so a sharded array counts once)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _host_rows(x):
  """A restored buffer leaf on the host: this process's rows of a global array written per process, else numpy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return row_layout.local_rows(x)
  return np.asarray(x)


def _numpy_tree(tree):
  """Orbax refuses empty arrays and containers: store the buffer's steps with a -1 sentinel and a count. Global
  (per-process) batch arrays stay as they are: orbax writes each process's rows from it."""
  steps = np.asarray(tree.get("steps", np.zeros((0,), np.int64)), np.int64).reshape(-1)
  out = {"count": np.asarray(steps.size, np.int64), "steps": np.concatenate([steps, np.full(1, -1, np.int64)])}
  batches = tree.get("batches", {})
  out["batches"] = (
      {k: {f: v if isinstance(v, jax.Array) else np.asarray(v) for f, v in b.items()} for k, b in batches.items()}
      if batches
      else {"_": np.zeros(())}
  )
  if "inflight" in tree:  # the streaming mode's pool and graded batches (`InflightRunner.state_dict`), global arrays
    out["inflight"] = jax.tree.map(lambda v: v if isinstance(v, jax.Array) else np.asarray(v), tree["inflight"])
  return out


def buffer_state_from_restored(tree: dict[str, Any]) -> dict[str, Any]:
  """Inverse of `_numpy_tree` for `RolloutBuffer.load_state_dict`."""
  batches = {k: v for k, v in tree["batches"].items() if k != "_"}
  count = int(np.asarray(tree["count"]))
  return {"steps": np.asarray(tree["steps"]).reshape(-1)[:count], "batches": batches}
