"""The learner's packed programs in the step budget (`learner.row_tokens`): their shapes, and the work they do.

With `learner.row_tokens = W` the learner packs a mini-batch's M samples into rows of W tokens by first-fit
decreasing (`minpro_jax.rl.packing`) and runs `packing.packed_rows(M, L, W, mb)` rows, a static count; its
accumulation loop skips the micro-batches that hold only padding rows (`jax.lax.cond`), so the work done scales with
the rows first fit uses, K. The compile-only tool compiles those static shapes (`static_rows`); the budget takes K
from the seeded length draw, each mini-batch's samples through the learner's own packer (`packing.plan_shape`), and
runs the micro-batch loop's forward-and-backward branch for ceil(K / mb) of its R / mb iterations (`weight_active`).
The update packs each consecutive mini-batch of M (`RolloutBatch.split`); scoring packs the step's N samples in the
same chunks of M, side by side in one run (`Learner.score(chunk_rows=M)`, `minpro_jax.rl.process_packing`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minpro_jax.aot.analysis import model_flops
from minpro_jax.rl import packing


class Packed(NamedTuple):
  """One packed learner program over a step's length draw.

  Attributes:
    rows: R, the static packed rows of one run (a multiple of `micro_batch`).
    width: W, tokens per packed row.
    micro_batch: rows per micro-batch.
    used: K of each mini-batch's packing, the rows first fit fills.
    real_tokens: the real (prompt + response) tokens of the runs together.
    chunks_per_run: mini-batches packed side by side in one run (update: 1; score: all of a step's).
  """

  rows: int
  width: int
  micro_batch: int
  used: tuple[int, ...]
  real_tokens: int
  chunks_per_run: int = 1

  @property
  def micro_batches(self) -> int:
    """Iterations of one run's micro-batch loop (R / mb)."""
    return self.rows // self.micro_batch

  @property
  def active(self) -> tuple[int, ...]:
    """Micro-batches each mini-batch's packing computes: ceil(K / mb)."""
    return tuple(-(-k // self.micro_batch) for k in self.used)

  @property
  def active_per_run(self) -> float:
    """The mean micro-batches a run computes: its chunks' together."""
    return float(np.mean(self.active)) * self.chunks_per_run

  @property
  def active_fraction(self) -> float:
    """The mean share of a run's micro-batches that hold a sample (the loop's costs are linear in it)."""
    return self.active_per_run / self.micro_batches

  @property
  def slot_fraction(self) -> float:
    """Real tokens / the token slots of the micro-batches computed (1 - the padding the learner runs)."""
    return self.real_tokens / max(sum(self.active) * self.micro_batch * self.width, 1)

  def describe(self) -> str:
    k = f"{self.used[0]}" if len(self.used) == 1 else f"{min(self.used)}-{max(self.used)}"
    a = f"{self.active[0]}" if len(self.active) == 1 else f"{np.mean(self.active):.2f} on average"
    return (
        f"{self.rows}x{self.width} packed, micro-batch {self.micro_batch}: {k} rows used, {a} of "
        f"{self.micro_batches} micro-batches run, {self.slot_fraction:.0%} of their tokens real"
    )

  def as_dict(self) -> dict:
    return {
        **self._asdict(),
        "micro_batches": self.micro_batches,
        "active": list(self.active),
        "active_fraction": self.active_fraction,
        "slot_fraction": self.slot_fraction,
    }


def _width(c, shapes) -> int | None:
  w = packing.row_tokens(c)
  return None if w is None else max(int(w), shapes.seq_len)


def static_rows(c, shapes) -> tuple[int, int, int] | None:
  """(update rows, score rows, width) the packed learner's programs are compiled at: `packing.packed_rows` of a
  mini-batch and of the step's rollouts (the micro-batch capped at each, as the learner does); None when
  `learner.row_tokens` is off."""
  w = _width(c, shapes)
  if w is None:
    return None
  m, n, mb = shapes.mini_batch, shapes.rollouts, shapes.micro_batch
  return (
      packing.packed_rows(m, shapes.seq_len, w, min(mb, m)),
      n // m * packing.packed_rows(m, shapes.seq_len, w, min(mb, n)),
      w,
  )


def learner_packing(c, shapes, lengths, prompt_len: int) -> dict[str, Packed] | None:
  """{"score": Packed, "update": Packed} of config `c` over response `lengths` ([N] tokens, the budget's draw)
  with `prompt_len` real prompt tokens each; None when `learner.row_tokens` is off."""
  w = _width(c, shapes)
  if w is None:
    return None
  real = np.asarray(lengths, np.int64) + int(prompt_len)
  m, n, mb = shapes.mini_batch, shapes.rollouts, shapes.micro_batch
  out = {}
  for name, mbs in (("score", min(mb, n)), ("update", min(mb, m))):
    runs = [packing.plan_shape(real[i : i + m], shapes.seq_len, w, mbs) for i in range(0, n, m)]
    chunks = len(runs) if name == "score" else 1  # the score runs every mini-batch's packed rows at once
    out[name] = Packed(
        rows=chunks * max(r[0] for r in runs), width=w, micro_batch=mbs, used=tuple(r[1] for r in runs),
        real_tokens=int(real.sum()), chunks_per_run=chunks,
    )  # fmt: skip
  return out


def weight_active(tree, p: Packed) -> int:
  """Weights the micro-batch loops of a packed program's cost tree (`hlo_cost.HloCost.root`) by the share of their
  iterations that compute: in every while loop of R / mb iterations, the conditional directly in its body (the
  learner's skip of padding micro-batches; the tree keeps its costlier branch, the forward and backward) runs with
  weight `p.active_fraction` instead of every iteration. Returns the number of branches weighted (0: the program
  has no such loop, e.g. unpacked).
  """
  count = 0
  for _, node in tree.walk():
    if node.kind != "while" or abs(node.trips - p.micro_batches) > 0.5:
      continue
    for ch in node.children:
      if ch.kind == "branch" and ch.trip_source == "max":
        ch.trips, ch.trip_source = p.active_fraction, "weight"
        count += 1
  return count


def analytic_flops(cfg, program: str, p: Packed) -> float:
  """`analysis.model_flops` of the micro-batches one packed run computes on average (all devices together):
  rows of W tokens with causal attention over the whole row, as the attention kernels compute it (segment ids mask
  inside the computed blocks; they do not skip blocks)."""
  rows = float(np.mean(p.active)) * p.micro_batch
  return model_flops(cfg, program, rows=rows, prompt_len=0, response_len=p.width, remat=cfg.remat)
