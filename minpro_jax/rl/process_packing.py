"""Packed learner inputs from per-process rows: packing (`learner.row_tokens`) with no host
holding the step's batch.

A packing plan spans the samples it packs, so each mini-batch is packed where its samples are. When every
mini-batch of a step lies within one process's rows (`fits`: the mini-batch size M = N / num_updates_per_step
divides a process's share N / n, i.e. `num_updates_per_step` is a multiple of the process count, as the paper
configs' 16 on 4 or 8 hosts), each process packs its own mini-batches with the plans a one-process run makes of
them (`packing.plan_chunks`: one plan per mini-batch, all of one shape R x W), and the packed rows of every
mini-batch sit side by side in one global [num x R, W] array on the staging sharding, each process's on its own
devices (`row_layout.staging_sharding`).

- `stage`: the update's inputs. `process_inputs.mini_batches` then slices mini-batch j's R rows on the devices and
  lays them out on the learner's batch sharding, as unpacked.
- `score`: the score pass packs the step's batch in the same mini-batch chunks (`Learner.score(chunk_rows=M)` in
  one process), scores every packed row in one program, and each process reads back its packed rows of the
  log-probs (and routes) and unpacks its samples.

The plans, hence the packed rows, are those of a one-process run for any process count that divides
`num_updates_per_step`; W is the longest sample of the whole batch or `row_tokens` (all-gathered [N] lengths).
Otherwise `process_inputs` all-gathers the rows and packs them on every host. Collective: every process calls
these at the same point, from the main thread.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from minpro_jax.rl import packing
from minpro_jax.rl.learner import Learner, ScoreInputs, UpdateInputs
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime import multihost, row_layout


def fits(num_rows: int, chunk_rows: int) -> bool:
  """Whether each process's rows of a batch of `num_rows` (`multihost.process_rows`) hold whole chunks of
  `chunk_rows` samples, so that each process packs its own chunks."""
  n = jax.process_count()
  return chunk_rows > 0 and num_rows % n == 0 and (num_rows // n) % chunk_rows == 0


def lengths(local: RolloutBatch, num_rows: int) -> np.ndarray:
  """[N] int64 real tokens of every process's samples (an all-gather of 8 bytes a row)."""
  return multihost.gather_rows((np.asarray(local.segment_ids) != 0).sum(1).astype(np.int64), num_rows)


def _pack(local: RolloutBatch, chunk_rows: int, row_tokens: int, mb: int, fields, replay: bool, longest: int):
  """(the plans, the packed host fields) of this process's chunks: [its chunks x R, W, ...] rows.

  Raises:
    ValueError: replay without routes; this process's rows are not whole chunks.
  """
  if replay and local.routes is None:
    raise ValueError(
        "LossConfig.router_replay=True but the batch has no routes; sample it with Sampler(record_routes=True)"
    )
  plans = packing.plan_chunks(local.segment_ids, chunk_rows, row_tokens, mb, width=longest)
  static = packing.packed_rows(chunk_rows, local.tokens.shape[1], plans[0].width, mb)
  if plans[0].num_rows != static:  # every process must place chunks of the same shape
    raise ValueError(f"process_packing: a chunk needs {plans[0].num_rows} packed rows, the static count is {static}")
  return plans, packing.pack_chunks(local, plans, fields, routes=replay)


def stage(local: RolloutBatch, learner: Learner, num_rows: int, num: int, all_lengths: np.ndarray) -> UpdateInputs:
  """The packed update inputs of a batch of `num_rows` rows in `num` mini-batches as global [num x R, W] arrays on
  the staging sharding of the learner's devices, made from this process's rows `local` (whole mini-batches:
  `fits`), each mini-batch packed as `Learner.update` packs it.

  Args:
    all_lengths: [N] real tokens of every sample (`lengths`).

  Raises:
    ValueError: a mini-batch spans processes (`fits`); replay without routes; as `row_layout.global_rows`.
  """
  m = num_rows // num
  if num_rows % num or not fits(num_rows, m):
    raise ValueError(f"process_packing.stage: mini-batches of {m} rows do not lie within the processes' rows")
  mb = min(learner.micro_batch_size, m)
  longest = int(all_lengths.max(initial=0))
  _, fields = _pack(local, m, learner.row_tokens, mb, packing.PACKED_FIELDS, learner.loss_cfg.router_replay, longest)
  total = fields["tokens"].shape[0] * jax.process_count()
  placed = row_layout.global_rows(fields, row_layout.staging_sharding(learner.mesh.devices, total), total)
  return UpdateInputs(**placed)


def score(learner: Learner, params: Any, local: RolloutBatch, num_rows: int, chunk_rows: int, sharding_of, *,
          return_routes: bool = False):  # fmt: skip
  """`Learner.score(chunk_rows=chunk_rows)` of a batch of `num_rows` rows of which this process holds its own
  (`local`, whole chunks: `fits`), returning this process's rows of the [N, L] log-probs (and of the learner's
  routes with `return_routes`). The packed rows are staged per process, laid out by `sharding_of(rows)` (the
  learner's batch sharding) and read back per process. Collective.

  Raises:
    ValueError: the chunks span processes; N not divisible by the micro-batch size; replay without routes.
  """
  if not fits(num_rows, chunk_rows):
    raise ValueError(f"process_packing.score: chunks of {chunk_rows} rows do not lie within the processes' rows")
  mb = min(learner.micro_batch_size, num_rows)
  if num_rows % mb:
    raise ValueError(f"batch of {num_rows} rows is not divisible by micro_batch_size {mb}")
  longest = int(lengths(local, num_rows).max(initial=0))
  replay = learner.loss_cfg.router_replay
  plans, fields = _pack(local, chunk_rows, learner.row_tokens, mb, packing.SCORE_FIELDS, replay, longest)
  total = fields["tokens"].shape[0] * jax.process_count()
  devices = learner.mesh.devices
  placed = multihost.settle(row_layout.global_rows(fields, row_layout.staging_sharding(devices, total), total))
  placed = multihost.settle(row_layout.take_rows(sharding_of(total), 0, total)(placed))
  logp, routes = multihost.settle(learner.jitted_score(params, ScoreInputs(**placed), mb))
  (logp, routes), _ = row_layout.rows_to_host((logp, routes if return_routes else None), total, devices, True)
  shape = local.tokens.shape
  logp = packing.unpack_chunks(logp, plans, shape)
  if not return_routes:
    return logp
  return logp, None if routes is None else packing.unpack_chunks(routes, plans, shape, fill=packing.NO_ROUTE)
