"""A global step's sampling and learning, one after the other or at the same time on disjoint devices.

With `config.sampling.devices` the sampler has devices of its own (`runtime/device_split.py`) and, for delay d >= 1
with `config.sampling.overlap`, global step s runs as

    transfer: the parameters of version v (after step s - 1) into the sampler's layout (`Sampler.prepare_params`);
    at the same time
      on the sampler's devices: sample step s's batch at v, grade it, score it on the learner's devices at v;
      on the learner's devices: the updates of step s, from the batch the delay buffer releases (pushed at s - d);
    then push step s's batch into the buffer.

Nothing the learner does at step s reads step s's batch (d >= 1: it is released at s + d), and nothing the sampler
does reads the updates of step s (it samples at v, as the sequential step does), so the samples, grades and updates
are exactly those of the sequential step on the same split (`sampling.overlap=False`; tests/test_overlap.py). What
keeps its order: the MIPU Step 2 check (it samples at the updated parameters, after both), evaluation, checkpoints.
With d = 0 the learner needs the batch of the same step: the step runs sequentially (logged once).

The two sides run in two Python threads, JAX releasing the GIL while it executes: the learner's updates in a worker
thread, the sampling in the main thread. The sampling side stays in the main thread because grading bounds each
answer's check with a SIGALRM timer, which Python delivers to the main thread only (`data/rewards.py`); the
learner's side is JAX dispatch and its metrics alone.

The learner donates its state to each update, so the step's score pass (on the learner's devices, at version v,
while the updates run) reads a copy of the parameters at v (MIPU's snapshot when rollback is on, else one
parameter copy, made only on steps that score and update).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from minpro_jax.rl import mipu
from minpro_jax.rl.rollout import RolloutBuffer
from minpro_jax.runtime.sharding import use_mesh

logger = logging.getLogger(__name__)


class ParamsAt(NamedTuple):
  """What `Trainer.sample_step` reads of a `TrainState`: the learner's parameters at a version, and the version."""

  params: Any
  step: int


class StepRunner:
  """Runs the sampling and learning of a global step for a `minpro_jax.run.trainer.Trainer` (module docstring).

  Args:
    trainer: the trainer whose `sample_step`, `learn_step`, sampler, config and device split it uses.
  """

  def __init__(self, trainer):
    self.tr = trainer
    c = trainer.c
    self.split = trainer.parts.device_split is not None
    asked = self.split and bool(c.sampling.overlap)
    self.overlapped = asked and c.delay >= 1
    self._pool = None
    if self.overlapped:
      self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
    if self.split:
      n_s, n_l = (len(d) for d in trainer.parts.device_split)
      how = "at the same time" if self.overlapped else "one after the other"
      why = " (delay=0: step s learns from its own batch)" if asked and not self.overlapped else ""
      logger.info("sampler on %d devices, learner on %d: a step samples and learns %s%s", n_s, n_l, how, why)

  def close(self) -> None:
    """Ends the worker thread (waits for an update in flight)."""
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def run(self, state, step: int, buffer: RolloutBuffer, lr_scale: float) -> tuple[Any, Any, dict[str, Any]]:
    """Samples global step `step` at `state`, pushes its batch into `buffer` and applies the updates of the batch
    `buffer` releases at `step` (at `lr_scale`).

    Returns:
      (the state after the updates, the MIPU snapshot of the state before them or None (no updates, or rollback
      off), the step's sampling and learning metrics).
    """
    tr = self.tr
    if not self.split:  # sampler and learner on the same devices: the sampler converts the parameters itself
      batch, metrics = tr.sample_step(state, step)
      buffer.push(step, batch)
      return self._learn(state, self._released(buffer, step), lr_scale, metrics)
    t0 = time.time()
    with use_mesh(tr.mesh, tr.rules):
      prepared = tr.sampler.prepare_params(state.params)  # the weight transfer, once per version
    transfer = {"time/weight_transfer": time.time() - t0}
    if not self.overlapped:
      batch, metrics = tr.sample_step(state, step, prepared)
      buffer.push(step, batch)
      return self._learn(state, self._released(buffer, step), lr_scale, {**metrics, **transfer})
    released = self._released(buffer, step)  # pushed at step - delay < step: this step's batch is not needed
    if released is None:
      batch, metrics = tr.sample_step(state, step, prepared)
      buffer.push(step, batch)
      return state, None, {**metrics, **transfer}
    before = mipu.snapshot(state) if tr.c.mipu.rollback else None
    score_params = None
    if tr.scoring(step)[0]:  # the update donates state.params: the score pass reads a copy at this version
      score_params = before.params if before is not None else jax.tree.map(jnp.copy, state.params)
    at = ParamsAt(score_params, int(state.step))
    learning = self._pool.submit(tr.learn_step, state, released, lr_scale)
    del state  # donated by the first update
    try:
      batch, metrics = tr.sample_step(at, step, prepared)
    finally:
      state, learn_metrics = learning.result()  # waits for the updates even when sampling failed
    buffer.push(step, batch)
    return state, before, {**metrics, **learn_metrics, **transfer}

  def _released(self, buffer: RolloutBuffer, step: int):
    """The batch `buffer` releases at `step` (or None) as the learner takes it: in a multi-process run each
    process's rows staged as global arrays (`Trainer.learner_batch`, collective: called here, in the main thread);
    in one process the batch itself."""
    released = buffer.pop(step)
    return released if jax.process_count() == 1 else self.tr.learner_batch(released)

  def _learn(self, state, released, lr_scale: float, metrics: dict[str, Any]):
    if released is None:
      return state, None, metrics
    before = mipu.snapshot(state) if self.tr.c.mipu.rollback else None
    state, learn_metrics = self.tr.learn_step(state, released, lr_scale)
    return state, before, {**metrics, **learn_metrics}
