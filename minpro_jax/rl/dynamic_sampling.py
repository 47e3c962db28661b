"""DAPO's dynamic sampling: keep only groups whose rewards differ, sampling more prompts until the batch is full.

A group whose G rewards are all equal has zero group-normalised advantage for every sample, so it adds no gradient
but still counts in the token-mean's denominator. DAPO (Yu et al. 2025, arXiv 2503.14476, Sec. 3.2 "Dynamic
Sampling") over-samples and drops such groups until the batch holds only informative ones. Here a global step
samples rounds of `prompts_per_step` prompts at the same parameter version (the same compiled shapes as a plain
step), keeps the groups with unequal rewards in the order sampled, and stops when `prompts_per_step` of them are
kept or after `sampling.max_sampling_rounds` rounds; a batch still short is filled with the first dropped groups
(zero advantage; counted in the metrics), so the step's shapes never change.

Pure numpy on host arrays; the trainer runs the rounds (`Trainer.sample_step`). In a multi-process run each
process holds its rows of every round and `minpro_jax.rl.process_dynamic` assembles its rows of the filled batch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np

from minpro_jax.sampling.batch import GenerationBatch

logger = logging.getLogger(__name__)


def unequal_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """[N / group_size] bool: True for each group (consecutive `group_size` rows) whose rewards are not all equal.

  Raises:
    ValueError: N is not a multiple of `group_size`.
  """
  rewards = np.asarray(rewards, np.float64)
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of group_size={group_size}")
  r = rewards.reshape(-1, group_size)
  return np.any(r != r[:, :1], axis=1)


def choose_groups(informative: list[np.ndarray], num_groups: int) -> tuple[list[tuple[int, int]], int]:
  """The (round, group) pairs of a filled batch and how many of them are uninformative fillers.

  Args:
    informative: per round, the [groups] bool mask of `unequal_groups`.
    num_groups: groups the batch needs.

  Returns:
    (the `num_groups` pairs: informative groups in sampling order, then, when those are too few, the first
    uninformative ones in sampling order; the number of such fillers).
  """
  keep = [(r, g) for r, mask in enumerate(informative) for g in np.flatnonzero(mask)]
  fill = [(r, g) for r, mask in enumerate(informative) for g in np.flatnonzero(~mask)]
  chosen = keep[:num_groups]
  fillers = fill[: num_groups - len(chosen)]
  return chosen + fillers, len(fillers)


def _pad_left(x: np.ndarray, width: int, value) -> np.ndarray:
  pad = [(0, 0)] * x.ndim
  pad[1] = (width - x.shape[1], 0)
  return np.pad(x, pad, constant_values=value)


def _pad_right(x: np.ndarray, width: int, value) -> np.ndarray:
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, width - x.shape[1])
  return np.pad(x, pad, constant_values=value)


def padded_rounds(gens: list[GenerationBatch], pad_id: int, no_route: int = -1) -> list[dict[str, np.ndarray | None]]:
  """Every per-row field of each round in `gens`, padded to the widest round: prompts left-padded, responses
  right-padded, with the padding conventions of `GenerationBatch` (pad id, mask False, log-prob and entropy 0,
  routes `no_route`, kept-set thresholds -inf); None for a field a round does not have.

  Raises:
    ValueError: the rounds differ in temperature or policy version (a step samples every round at one version).
    NotImplementedError: `GenerationBatch` has a per-row field this function does not take.
  """
  if len({g.policy_version for g in gens}) != 1 or len({g.temperature for g in gens}) != 1:
    raise ValueError("the rounds of a step must share one policy version and temperature")
  p = max(g.prompt_tokens.shape[1] for g in gens)
  r = max(g.response_tokens.shape[1] for g in gens)
  widths = {  # field: (pad side, width, value); None = a per-row [N] field
      "prompt_tokens": (_pad_left, p, pad_id),
      "prompt_mask": (_pad_left, p, False),
      "response_tokens": (_pad_right, r, pad_id),
      "response_mask": (_pad_right, r, False),
      "behavior_logp": (_pad_right, r, 0.0),
      "entropy": (_pad_right, r, 0.0),
      "routes": (_pad_right, r, no_route),
      "kept_logp_threshold": (_pad_right, r, -np.inf),
      "token_version": (_pad_right, r, -1),
      "lengths": None,
      "finish_reason": None,
      "group_ids": None,
      "sample_index": None,
  }
  arrays_of_rows = {f.name for f in dataclasses.fields(GenerationBatch)} - {"policy_version", "temperature"}
  if arrays_of_rows != set(widths):  # a field added to GenerationBatch must be taken here too, never left stale
    raise NotImplementedError(
        f"take_groups does not know GenerationBatch fields {sorted(arrays_of_rows ^ set(widths))}"
    )
  out = [{} for _ in gens]
  for field, how in widths.items():
    for k, g in enumerate(gens):
      a = getattr(g, field)
      out[k][field] = a if how is None or a is None else how[0](a, how[1], how[2])
    if any(o[field] is None for o in out):
      for o in out:
        o[field] = None
  return out


def take_groups(
    gens: list[GenerationBatch], groups: list[tuple[int, int]], group_size: int, pad_id: int, no_route: int = -1
) -> GenerationBatch:
  """One `GenerationBatch` of the rows of `groups` ((round, group) pairs, in that order) of the rounds' `gens`.

  Rounds may differ in prompt width (their prompt bucket) and response width: they are padded to the widest
  (`padded_rounds`).

  Raises:
    As `padded_rounds`.
  """
  rounds = padded_rounds(gens, pad_id, no_route)
  out = {}
  for field in rounds[0]:
    if rounds[0][field] is None:
      out[field] = None
      continue
    out[field] = np.concatenate([rounds[k][field][g * group_size : (g + 1) * group_size] for k, g in groups], axis=0)
  return dataclasses.replace(gens[0], **out)


@dataclasses.dataclass
class Round:
  """One round's sampled and graded rows: the `GenerationBatch`, the response texts (None on the rows another
  process graded: `Trainer.grade`), [N] rewards, grading stats."""

  gen: GenerationBatch
  texts: list[str | None]
  rewards: np.ndarray
  stats: dict


def fill_informative(
    first: Round,
    sample_round: Callable[[int], Round | None],
    *,
    group_size: int,
    max_rounds: int,
    pad_id: int,
    take: Callable[[list[GenerationBatch], list[tuple[int, int]]], GenerationBatch] | None = None,
) -> tuple[Round, dict[str, float]]:
  """Samples rounds (`sample_round(k)` for k = 1, 2, ...) until the groups with unequal rewards fill a batch of as
  many groups as `first` has, `max_rounds` rounds are sampled, or `sample_round` returns None (no data to spare);
  returns the filled batch and its metrics.

  The returned round's rows are the chosen groups (`choose_groups`), its group ids those of `first` (a step's
  groups keep their ids whichever round sampled them), its stats the numeric grading stats summed over every round.
  `take(gens, groups)` makes the filled `GenerationBatch` of the rounds' generations (default `take_groups`; in a
  multi-process run each round holds this process's rows and `process_dynamic.take_own_groups` returns its rows of
  the filled batch: the rewards and texts are those of every row, as `Trainer.grade` gives them). Metrics:
  `dynamic/rounds`, `dynamic/equal_frac` (share of the sampled groups with equal rewards),
  `dynamic/filler_groups` (equal-reward groups kept because the rounds ran out), `dynamic/out_of_data` (1 when a
  round was refused for lack of data).

  Logs a warning naming the field (once per call: once per step) when no round held an informative group: the step
  then sampled up to `max_rounds` times the prompts for a batch of equal-reward filler that gives no gradient.
  """
  num_groups = len(first.rewards) // group_size
  rounds, masks, out_of_data = [first], [unequal_groups(first.rewards, group_size)], 0
  while sum(int(m.sum()) for m in masks) < num_groups and len(rounds) < max_rounds:
    more = sample_round(len(rounds))
    if more is None:  # no prompts to spare: the remaining global steps need the data that is left
      out_of_data = 1
      break
    rounds.append(more)
    masks.append(unequal_groups(rounds[-1].rewards, group_size))
  groups, fillers = choose_groups(masks, num_groups)
  if fillers == num_groups:
    logger.warning(
        "sampling.drop_equal_reward_groups: none of the %d groups sampled in %d round(s) has unequal rewards, so this "
        "step's batch is equal-reward filler (zero advantage, no gradient)%s; the policy solves every problem or "
        "none: check the held-out pass@1, raise group_size or sampling.temperature, or unset drop_equal_reward_groups",
        num_groups * len(rounds),
        len(rounds),
        " and the data has no prompts to spare" if out_of_data else "",
    )
  gens = [r.gen for r in rounds]
  gen = take(gens, groups) if take is not None else take_groups(gens, groups, group_size, pad_id)
  gen = dataclasses.replace(gen, group_ids=first.gen.group_ids.copy())  # this process's rows: its group ids
  rows = [(k, g * group_size + s) for k, g in groups for s in range(group_size)]
  stats = {}
  for r in rounds:
    for key, v in r.stats.items():
      if isinstance(v, (int, float, np.integer, np.floating)):
        stats[key] = stats.get(key, 0) + v
  filled = Round(
      gen=gen,
      texts=[rounds[k].texts[i] for k, i in rows],
      rewards=np.asarray([rounds[k].rewards[i] for k, i in rows], np.float32),
      stats=stats,
  )
  sampled = num_groups * len(rounds)
  metrics = {
      "dynamic/rounds": len(rounds),
      "dynamic/equal_frac": float(sum(int((~m).sum()) for m in masks) / sampled),
      "dynamic/filler_groups": fillers,
      "dynamic/out_of_data": out_of_data,
  }
  return filled, metrics
