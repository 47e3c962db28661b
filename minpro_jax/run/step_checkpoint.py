"""What a global step's run checkpoint holds beside the learner state, and how a resume reads it back.

The meta (JSON): the global step, the data loader's position, the config's resume fingerprint, the run's progress,
the process count and the metrics rows up to the step. The buffer: the delay buffer's waiting batches (in a
multi-process run each process's rows of one global array, their layout in the meta: `process_inputs`), or in the
in-flight mode the streaming pool and its graded batches (`InflightRunner.state_dict`: each process its shards).
`minpro_jax.run.checkpoint.RunCheckpointer` writes and reads them; the trainer calls `payload` and `restore`.
"""

from __future__ import annotations

from typing import Any

from minpro_jax.errors import CheckpointError, ConfigError
from minpro_jax.rl import process_inputs
from minpro_jax.rl.rollout import RolloutBuffer
from minpro_jax.run import resume_check
from minpro_jax.run.checkpoint import buffer_state_from_restored
from minpro_jax.run.inflight_runner import InflightRunner
from minpro_jax.runtime import multihost


def payload(tr, step: int, buffer: RolloutBuffer, progress) -> tuple[dict[str, Any], dict[str, Any]]:
  """(buffer tree, meta) of the run checkpoint of global step `step` of the trainer `tr`."""
  meta = {
      "global_step": step,
      "data": tr.loader.get_state(),
      "config": resume_check.resume_fingerprint(tr.c),
      "progress": progress.to_json(),
      "process_count": multihost.process_count(),
      "metrics": tr._writer.rows_upto(step) if tr._writer is not None else [],  # put back if the file lost them
  }
  buf = buffer.state_dict()
  if isinstance(tr.steps, InflightRunner):  # the streaming pool and its batches, per process (delay buffer: empty)
    buf["inflight"], meta["inflight"] = tr.steps.state_dict()
  elif multihost.process_count() > 1:  # each process writes its own rows of the waiting batches
    n = tr.c.prompts_per_step * tr.c.group_size
    meta["buffer"] = process_inputs.buffer_layout(buf, n)
    buf = process_inputs.buffer_to_global(buf, n)
  return buf, meta


def restore(tr, state, buffer: RolloutBuffer) -> tuple[int, Any, dict[str, Any]] | None:
  """Reads the newest run checkpoint of `tr`'s workdir that passes the config and process-count checks back into
  `buffer`, the in-flight pool and the data loader: (its step, the restored state, its meta), or None (no checkpoint).

  Raises:
    CheckpointError: a checkpoint of another process count, or none reads back (`RunCheckpointer.restore_latest`).
    ConfigError: a changed config (`resume_check.check_resume`), or a run already past `total_steps`.
  """
  c = tr.c

  def check(meta):
    resume_check.check_resume(c, meta.get("config"), tr.workdir)
    saved_count = meta.get("process_count", 1)
    if saved_count != multihost.process_count():
      raise CheckpointError(
          f"config.workdir: the run in {tr.workdir} was checkpointed by {saved_count} process(es), this one "
          f"runs on {multihost.process_count()}; resume it with {saved_count} process(es) (the same launch "
          "command), or start a new run in another --config.workdir"
      )

  inflight = tr.steps.checkpoint_template if isinstance(tr.steps, InflightRunner) else None
  restored = tr.ckpt.restore_latest(
      state, check_meta=check, buffer_template=process_inputs.buffer_template, inflight_template=inflight
  )
  if restored is None:
    return None
  latest, state, buf_state, meta = restored
  start = int(meta["global_step"]) + 1
  if start > c.total_steps:
    raise ConfigError(
        f"config.total_steps: the run in {tr.workdir} has already done {start} global steps, more than "
        f"total_steps={c.total_steps}; raise total_steps to continue it, or use another --config.workdir"
    )
  buffer.load_state_dict(buffer_state_from_restored(buf_state))
  if isinstance(tr.steps, InflightRunner):
    tr.steps.load_state_dict(buf_state["inflight"], meta["inflight"])
  if "buffer" not in meta:  # written whole by process 0 (one process, or before per-process buffers)
    buffer.map_batches(lambda b: process_inputs.own_rows(b, c.prompts_per_step, c.group_size))
  tr.loader.set_state(meta["data"])
  return latest, state, meta
