"""The streaming trainer mode (`config.staleness.mode = "inflight"`): in-flight weight updates, as PipelineRL and
AReaL's interruptible generation make staleness, with the version that drew every token recorded.

The sampler is one `minpro_jax.sampling.streaming.StreamPool` that lives for the whole run: the continuous engine's
decode rows, refilled from a stream of requests, run in segments of k = `staleness.inflight_every` decode steps.
Global step s (d = `delay`, the batches the sampler may run ahead of the learner):

  1. admit batch s: the loader's next `prompts_per_step` prompts, `group_size` requests each, with the delay mode's
     row keys (`Trainer.step_seed(s, 1)`) and group ids (s * prompts_per_step + i);
  2. run segments at the current version v: at least one, and until batch s - d has finished (s >= d); the refill
     rule keeps the rows full from the admitted batches s - d .. s;
  3. collect every batch that has finished, grade it and score it with the learner at v (`Trainer.graded_batch`:
     the learner's log-probs are those of the version current when the batch finished);
  4. learn from batch s - d (`num_epochs` x `num_updates_per_step` updates, `Trainer.learn_step`), the version moves
     to v + E n, and the pool's parameters with it at the next step (`StreamPool.swap`: with
     `staleness.inflight_kv = "recompute"` the live rows' caches are recomputed under the new version first).

Rows of batches s - d + 1 .. s that are still being generated continue under the new version: one response's
tokens come from several versions (`RolloutBatch.token_version`, each token's behaviour log-prob is the version's
that drew it). With d = 0 no row outlives its batch, so nothing is mixed. When every segment drains the pool
(k >= max_new_tokens with decode rows >= a batch's rows, or k >= the decode steps of every admitted batch), no
response sees a swap and the run is the delay-mode run of the same `delay`, bit for bit: batch b is sampled whole by
the version after step b - 1 and learnt from at step b + d (tests/test_inflight.py). The step's metrics are the
sample metrics of the batch it learns (those of batch s - d, reported at step s: delay mode reports them at step
s - d), the learning metrics with the per-token staleness (`minpro_jax.rl.token_staleness`), and `inflight/*`: the
segments, decode steps and row occupancy of the step.

Checkpoints hold the pool (its cache, outputs and ring), the admitted batches' prompts and the graded batches
waiting to be learnt (`state_dict`), so a run killed at any point resumes exactly. With
`staleness.inflight_checkpoint_kv = "rebuild"` the pool's KV cache is left out (at the paper's scale it is most of
the checkpoint) and the first step after a resume recomputes the live rows' caches under its version: exact with
`inflight_kv = "recompute"` from a step that learnt (it recomputes them there anyway), an approximation otherwise
(`StreamPool.load_state_dict`).

Several JAX processes (docs/multihost.md) run the same pool: every process admits the same prompts with the same
keys and runs the same segments on the global mesh, so the host-side decisions (which batches finished, the refill,
the segments of a step) are the same on every process; a finished batch comes back to each process as its rows only
(`StreamPool.collect(own_rows=True)`: whole groups), which it grades, scores and keeps, and the learner's global
arrays are made from every process's rows (`Trainer.learner_batch`), as in delay mode. Each process writes and reads
back its own shards of the pool's device arrays and its own rows of the graded batches (`state_dict`,
`checkpoint_template`); the host state, the same on every process, is written once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np

from minpro_jax.errors import ConfigError
from minpro_jax.rl import process_inputs
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime import multihost
from minpro_jax.runtime.sharding import use_mesh
from minpro_jax.sampling.engines.base import bucket
from minpro_jax.sampling.streaming import StreamPool

logger = logging.getLogger(__name__)


def inflight_mode(c) -> bool:
  """Whether config `c` runs the streaming mode (`staleness.mode = "inflight"`; absent in older configs: delay)."""
  st = c.get("staleness")
  return st is not None and st.mode == "inflight"


def rebuild_exactness(kv: str, moved: bool) -> str:
  """What a resume without the pool's KV cache (`inflight_checkpoint_kv="rebuild"`) is, for the log: exact with
  `kv="recompute"` where the parameters `moved` since the checkpointed step's segments (that step learnt: the
  uninterrupted run recomputes the same rows under the same version at this swap), else an approximation
  (docs/inflight.md, "Resume without the KV cache")."""
  if kv != "recompute":
    return (
        "an approximation with staleness.inflight_kv='keep': the live rows' keys and values from older versions "
        "become this version's (one recompute swap)"
    )
  if not moved:
    return "equal up to fp32 summation order: no update since, so recomputed in one pass instead of token by token"
  return "exact: the uninterrupted run recomputes the same rows under the same version at this swap"


class InflightRunner:
  """Runs global steps of a `minpro_jax.run.trainer.Trainer` in the streaming mode (module docstring); the same
  interface as `minpro_jax.run.step_runner.StepRunner`.

  Raises:
    ConfigError: a sampler the streaming pool cannot run (naming the field).
  """

  def __init__(self, trainer):
    self.tr = tr = trainer
    c = tr.c
    self.rows_per_batch = n = c.prompts_per_step * c.group_size
    longest = max(len(tr.prompt_ids[p.id]) for p in tr.train_problems)  # the pool's prompt slots hold every prompt
    try:
      self.pool = StreamPool(
          tr.sampler,
          tr.sampling,
          batch_rows=n,
          capacity=(c.delay + 1) * n,
          every=c.staleness.inflight_every,
          kv=c.staleness.inflight_kv,
          prompt_len=bucket(longest, tr.sampler.prompt_buckets),
      )
    except ValueError as e:
      raise ConfigError(f"config.staleness.mode: {e}") from e
    self.problem_index = {p.id: i for i, p in enumerate(tr.train_problems)}
    self.waiting: dict[int, dict[str, Any]] = {}  # batch -> {"ids", "problems", "admitted"} (not finished)
    self.ready: dict[int, tuple[RolloutBatch, dict[str, Any]]] = {}  # finished, graded, not yet learnt
    self._prepared, self._version = None, None  # the sampler's parameters and their version (`_params`)
    st = c.staleness
    self.checkpoint_kv = st.get("inflight_checkpoint_kv", "save") == "save"  # the pool's KV cache in checkpoints

  def close(self) -> None:
    """Nothing runs in the background."""

  def _params(self, state):
    """The pool's parameters at `state`'s version: prepared once per version, swapped into the live rows."""
    version = int(state.step)
    if self._prepared is None or version != self._version:
      with use_mesh(self.tr.mesh, self.tr.rules):
        self._prepared = self.tr.sampler.prepare_params(state.params).state
        if self._version is not None and (version != self._version or self.pool.cache_missing):
          if self.pool.cache_missing:  # restored without the KV cache: the swap rebuilds it
            logger.info(
                "in-flight pool restored without its KV cache (staleness.inflight_checkpoint_kv='rebuild'): the %d "
                "live rows' caches are recomputed under version %d; %s",
                self.pool.live,
                version,
                rebuild_exactness(self.pool.kv, version != self._version),
            )
          self.pool.swap(self._prepared)
      self._version = version
    return self._prepared

  def run(self, state, step: int, buffer, lr_scale: float) -> tuple[Any, Any, dict[str, Any]]:
    """Global step `step` (module docstring; `buffer`, the delay buffer, stays empty in this mode).

    Returns:
      (the state after the step's updates, None (no MIPU rollback in this mode), the step's metrics).
    """
    del buffer
    tr, c = self.tr, self.tr.c
    problems = next(tr.loader)
    group_ids = step * c.prompts_per_step + np.arange(len(problems))
    ids = self.pool.admit([tr.prompt_ids[p.id] for p in problems], tr.step_seed(step, 1), c.group_size, group_ids)
    self.waiting[step] = {"ids": list(ids), "problems": problems, "admitted": time.time()}
    target = step - c.delay
    params, version = self._params(state), int(state.step)
    t0 = time.time()
    segments = decode = busy = 0
    while True:
      with use_mesh(tr.mesh, tr.rules):  # as `Trainer.generate` calls the sampler
        stats = self.pool.segment(params, version)
      segments, decode, busy = segments + 1, decode + stats.decode_steps, busy + stats.busy_row_steps
      if target < 0 or target in self.ready or self.pool.finished(self.waiting[target]["ids"]):
        break
    metrics: dict[str, Any] = {
        "inflight/segments": segments,
        "inflight/decode_steps": decode,
        "inflight/occupancy": busy / max(decode * self.pool.rows, 1),  # live rows per decode step / decode rows
        "inflight/live_rows": self.pool.live,
        "time/segments": time.time() - t0,
    }
    for b in sorted(self.waiting):  # grade and score what finished, at this version
      w = self.waiting[b]
      if self.pool.finished(w["ids"]):
        gen = self.pool.collect(w["ids"], tr.sampling.logprob_temperature, own_rows=True)  # several: its rows
        self.ready[b] = tr.graded_batch(state, b, gen, w["problems"], time.time() - w["admitted"])
        del self.waiting[b]
    if target < 0:
      return state, None, metrics
    batch, sample_metrics = self.ready.pop(target)
    state, learn_metrics = tr.learn_step(state, tr.learner_batch(batch), lr_scale)  # several: staged (collective)
    return state, None, {**sample_metrics, **metrics, **learn_metrics}

  # ------------------------------------------------------------------------------------------------ checkpoints
  def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta): the pool's arrays (`StreamPool.state_dict`: its device arrays as they are sharded) and the
    graded batches waiting to be learnt (for the checkpoint's buffer: in a multi-process run each process's rows as
    one global array, `process_inputs.buffer_to_global`, so each process writes its own), and as JSON the admitted
    batches' problems (indices into the training problems), the waiting batches' sample metrics and the graded
    batches' layout (`process_inputs.buffer_layout`). Nothing is gathered."""
    n = self.rows_per_batch
    ready = {"steps": np.zeros((0,), np.int64), "batches": {str(b): x.to_dict() for b, (x, _) in self.ready.items()}}
    layout = process_inputs.buffer_layout(ready, n)
    ready = process_inputs.buffer_to_global(ready, n)["batches"]
    # orbax writes no empty container
    arrays = {"pool": self.pool.state_dict(self.checkpoint_kv), "ready": ready or {"_": np.zeros(())}}
    meta = {
        "version": self._version,
        "pool_kv": self.checkpoint_kv,
        "waiting": {str(b): [self.problem_index[p.id] for p in w["problems"]] for b, w in self.waiting.items()},
        "waiting_ids": {str(b): [w["ids"][0], len(w["ids"])] for b, w in self.waiting.items()},
        "ready_metrics": {str(b): m for b, (_, m) in self.ready.items()},
        "ready_layout": layout,
    }
    return arrays, json.loads(json.dumps(meta, default=float))

  def checkpoint_template(self, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The abstract arrays of `state_dict` for the checkpoint of `meta` (`RunCheckpointer.restore_latest`'s
    `inflight_template`): the pool's device arrays on its shardings and, in a multi-process run, the graded batches
    as the global arrays each process reads its rows of. None for a checkpoint of before `ready_layout` (its pool
    and batches were written whole: read back whole)."""
    layout = meta.get("inflight", {}).get("ready_layout")
    if layout is None:
      return None
    ready = process_inputs.buffer_template({"buffer": layout}) if multihost.process_count() > 1 else None
    if ready is None:  # one process: the batches as numpy of their shapes
      ready = {
          b: {f: np.zeros(shape, dtype) for f, (shape, dtype) in fields.items()}
          for b, fields in layout["batches"].items()
      }
    pool = self.pool.checkpoint_template(meta["inflight"].get("pool_kv", True))  # written with its KV cache?
    return {"pool": pool, "ready": ready or {"_": np.zeros(())}}

  def load_state_dict(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Restores `state_dict`'s pool, waiting batches and graded batches (their sample time restarts at 0). A pool
    written without its KV cache has its live rows' caches rebuilt at the next step (`_params`, said on the log)."""
    self.pool.load_state_dict(arrays["pool"], meta.get("pool_kv", True))  # before the option: with the cache
    probs = self.tr.train_problems
    self.waiting = {}
    for b, idx in meta["waiting"].items():
      first, count = meta["waiting_ids"][b]
      self.waiting[int(b)] = {
          "ids": list(range(first, first + count)),
          "problems": [probs[i] for i in idx],
          "admitted": time.time(),
      }
    ready, c = arrays.get("ready", {}), self.tr.c
    whole = "ready_layout" not in meta  # written whole (before per-process checkpoints): keep this process's rows
    own = lambda x: process_inputs.own_rows(x, c.prompts_per_step, c.group_size) if whole else x  # noqa: E731
    self.ready = {
        int(b): (own(RolloutBatch.from_dict(ready[b])), m) for b, m in meta["ready_metrics"].items() if b in ready
    }
    self._prepared, self._version = None, meta["version"]  # the next step swaps when its version is newer
