"""Dynamic sampling's filled batch from per-process rounds: no host holds a round or the batch.

In a multi-process run every round of `dynamic_sampling.fill_informative` is sampled with
`Sampler.generate(own_rows=True)`, so process i holds its rows (whole groups) of each round; the rewards are those
of every row (`Trainer.grade` all-gathers them), so every process makes the same choice of groups
(`dynamic_sampling.choose_groups`), the one a single process makes. The filled batch's slot j may hold a group that
another process sampled, so the rows move on the devices:

  1. each process pads its rows of every round to the widest round (`dynamic_sampling.padded_rounds`) and places
     them, round after round, as its block of one global [K x N, ...] array per field on the staging sharding
     (`row_layout.global_rows`: process i's K x N / n rows on its own devices);
  2. one jitted gather takes the filled batch's N rows of it (indices computed on the host, a traced [N] int32
     array, so a new choice does not recompile) laid out on the staging sharding of N rows, and each process
     reads back its rows (`row_layout.local_rows`).

The per-row [N] fields (lengths, finish reasons as a bool, sample indices) take the same gather.
A process's rows of the filled batch equal the rows a single process's `take_groups` gives it, bit for bit. The
gather may hold the filled batch's N rows on every device for a moment (XLA partitions a gather from a
row-sharded operand as a masked local gather and a reduction).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from minpro_jax.rl.dynamic_sampling import padded_rounds, take_groups
from minpro_jax.runtime import multihost, row_layout
from minpro_jax.sampling.batch import FINISH_LENGTH, FINISH_STOP, GenerationBatch


@functools.lru_cache(maxsize=16)
def _gather(sharding: jax.sharding.Sharding):
  """A jitted program: rows `idx` ([N] int32) of every leaf of a tree of global arrays, laid out as `sharding`."""
  return jax.jit(lambda tree, idx: jax.tree.map(lambda a: a[idx], tree), out_shardings=sharding)


def source_rows(groups: list[tuple[int, int]], group_size: int, num_rounds: int, num_rows: int) -> np.ndarray:
  """[N] int64: for each row of the filled batch (`groups`' (round, group) pairs in order, `group_size` rows each),
  its row in the [K x N] array of process-major blocks that `take_own_groups` builds: process q's block holds its
  N / n rows of round 0, then of round 1, ...

  Raises:
    ValueError: `num_rows` does not split over the processes.
  """
  n = jax.process_count()
  if num_rows % n:
    raise ValueError(f"source_rows: {num_rows} rows do not split over {n} processes")
  share = num_rows // n
  rows = np.asarray([g * group_size + s for _, g in groups for s in range(group_size)], np.int64)
  rounds = np.repeat(np.asarray([k for k, _ in groups], np.int64), group_size)
  owner, local = np.divmod(rows, share)
  return owner * num_rounds * share + rounds * share + local


def take_own_groups(
    gens: list[GenerationBatch], groups: list[tuple[int, int]], group_size: int, pad_id: int, no_route: int = -1
) -> GenerationBatch:
  """This process's rows of `dynamic_sampling.take_groups(every process's rounds, groups, ...)`, from its rows of
  each round `gens` (`Sampler.generate(own_rows=True)`); `take_groups` in one process. Collective: every process
  calls it at the same point with the same `groups`.

  Raises:
    As `padded_rounds`; ValueError: the rounds' rows are not this process's share of N = len(groups) x group_size.
  """
  if jax.process_count() == 1:
    return take_groups(gens, groups, group_size, pad_id, no_route)
  num_rows, k = len(groups) * group_size, len(gens)
  rounds = padded_rounds(gens, pad_id, no_route)
  for r in rounds:  # the finish reason (a str array) travels as a bool
    r["finish_reason"] = r["finish_reason"] == FINISH_STOP
  fields = [f for f, v in rounds[0].items() if f != "group_ids" and v is not None]
  local = {f: np.concatenate([r[f] for r in rounds]) for f in fields}
  devices = jax.devices()
  placed = row_layout.global_rows(local, row_layout.staging_sharding(devices, k * num_rows), k * num_rows)
  idx = source_rows(groups, group_size, k, num_rows)
  out = _gather(row_layout.staging_sharding(devices, num_rows))(placed, idx.astype(np.int32))
  taken = {f: row_layout.local_rows(multihost.settle(v)) for f, v in out.items()}
  stop = taken["finish_reason"]
  taken["finish_reason"] = np.where(stop, FINISH_STOP, FINISH_LENGTH).astype(gens[0].finish_reason.dtype)
  nones = {f: None for f, v in rounds[0].items() if v is None}
  return dataclasses.replace(gens[0], **taken, **nones, group_ids=gens[0].group_ids.copy())
