"""The in-flight mode's sampler schedule on a length draw: occupancy of the streaming pool beside the delay mode's.

`streaming_schedule` replays `minpro_jax.run.inflight_runner`'s global steps on response lengths: step s admits
batch s's N requests, then runs segments of `every` decode steps (the pool's `refill_rule` between them, exactly as
`minpro_jax.sampling.streaming`'s loop), at least one and until batch s - `ahead` has finished. Rows never wait for a
batch's last response: admission refills them from the next batch, so the long tail that leaves a delay-mode call's
rows idle (`minpro_jax.aot.schedule.continuous_schedule`, one call per batch) is filled with the next batch's work.
Each step's swap (the learner's new parameters into the sampler's layout, `Sampler.prepare_params`) is the
delay mode's weight transfer, once a step: the same cost in both modes; with `inflight_kv="recompute"` the live
rows' prefixes are also recomputed once a step (`live_rows_at_swap` of them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minpro_jax.sampling.continuous import refill_rule


@dataclasses.dataclass(frozen=True)
class StreamStep:
  """One global step of the streaming pool: decode steps, segments, live rows per decode step on average, the rows
  still live when the step learns (they continue under the new version), and refill iterations."""

  decode_steps: int
  segments: int
  mean_live_rows: float
  live_rows_at_swap: int
  refills: int


def streaming_schedule(batches: list, rows: int, refill_rows: int, every: int, ahead: int) -> list[StreamStep]:
  """The streaming pool's steps on `batches` (per global step, the [N] response lengths of its batch, each >= 1).

  Args:
    batches: S arrays of N ints, request order within each batch.
    rows: decode rows B; refill_rows: M (the engine's `rows_and_refill` of N).
    every: k, decode steps per segment; ahead: d, batches the sampler runs ahead (`delay`).

  Returns:
    S `StreamStep`s.

  Raises:
    ValueError: a length < 1, every < 1 or ahead < 0.
  """
  if every < 1 or ahead < 0:
    raise ValueError(f"every={every} must be >= 1 and ahead={ahead} >= 0")
  lengths = [np.asarray(b, np.int64) for b in batches]
  if any(b.size and b.min() < 1 for b in lengths):
    raise ValueError("streaming_schedule: response lengths must be >= 1")
  stream = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
  batch_of = np.repeat(np.arange(len(lengths)), [b.size for b in lengths])
  unfinished = np.asarray([b.size for b in lengths], np.int64)
  left = np.zeros(rows, np.int64)  # decode steps the row still runs (0: done)
  owner = np.full(rows, -1, np.int64)  # the batch of the row's request
  done = np.ones(rows, bool)
  nxt = avail = 0
  out = []
  for s in range(len(lengths)):
    avail += lengths[s].size
    decode = segments = busy = refills = 0
    while True:
      seg = 0
      while seg < every and (nxt < avail or not done.all()):
        go, count = refill_rule(int(done.sum()), avail - nxt, refill_rows, minimum=min)
        if go:
          at = np.flatnonzero(done)[:count]
          left[at], owner[at] = stream[nxt : nxt + count] - 1, batch_of[nxt : nxt + count]
          done[at] = left[at] <= 0
          np.subtract.at(unfinished, owner[at][done[at]], 1)  # a 1-token response ends at its prefill
          nxt += count
          refills += 1
          continue
        live = ~done
        k = min(int(left[live].min()), every - seg)  # no refill before the next row ends
        busy += int(live.sum()) * k
        left[live] -= k
        ended = live & (left <= 0)
        np.subtract.at(unfinished, owner[ended], 1)
        done |= ended
        seg += k
      segments, decode = segments + 1, decode + seg
      if s < ahead or unfinished[s - ahead] == 0:
        break
    out.append(StreamStep(decode, segments, busy / max(decode, 1), int((~done).sum()), refills))
  return out
