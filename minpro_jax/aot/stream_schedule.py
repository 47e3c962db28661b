"""The in-flight mode's sampler schedule on a length draw: occupancy of the streaming pool beside the delay mode's.

`streaming_schedule` replays `minpro_jax.run.inflight_runner`'s global steps on response lengths: step s admits
batch s's N requests, then runs segments of `every` decode steps (the pool's `refill_rule` between them, exactly as
`minpro_jax.sampling.streaming`'s loop), at least one and until batch s - `ahead` has finished. Rows never wait for a
batch's last response: admission refills them from the next batch, so the long tail that leaves a delay-mode call's
rows idle (`minpro_jax.aot.schedule.continuous_schedule`, one call per batch) is filled with the next batch's work.
Each step's swap (the learner's new parameters into the sampler's layout, `Sampler.prepare_params`) is the
delay mode's weight transfer, once a step: the same cost in both modes; with `inflight_kv="recompute"` the live
rows' prefixes are also recomputed once a step (`live_rows_at_swap` of them, `live_lengths_at_swap` tokens drawn).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minpro_jax.aot.schedule import Schedule, bucket_counts
from minpro_jax.sampling.continuous import refill_rule


@dataclasses.dataclass(frozen=True)
class StreamStep:
  """One global step of the streaming pool: decode steps, segments, live rows per decode step on average, the rows
  still live when the step learns (they continue under the new version), refill iterations, the decode steps
  per live-length bucket (`Schedule.bucket_steps`; empty without `buckets`), and the tokens each live row has drawn
  at the swap (`inflight_kv="recompute"` runs its prompt and these through the new weights)."""

  decode_steps: int
  segments: int
  mean_live_rows: float
  live_rows_at_swap: int
  refills: int
  bucket_steps: tuple[int, ...] = ()
  live_lengths_at_swap: tuple[int, ...] = ()


def streaming_schedule(
    batches: list,
    rows: int,
    refill_rows: int,
    every: int,
    ahead: int,
    prompt_len: int = 0,
    buckets: tuple[int, ...] = (),
) -> list[StreamStep]:
  """The streaming pool's steps on `batches` (per global step, the [N] response lengths of its batch, each >= 1).

  Args:
    batches: S arrays of N ints, request order within each batch.
    rows: decode rows B; refill_rows: M (the engine's `rows_and_refill` of N).
    every: k, decode steps per segment; ahead: d, batches the sampler runs ahead (`delay`).
    prompt_len, buckets: P and the live-length buckets of the cache, for `bucket_steps` (as `continuous_schedule`).

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
  step = np.zeros(rows, np.int64)  # next response index of each row
  owner = np.full(rows, -1, np.int64)  # the batch of the row's request
  done = np.ones(rows, bool)
  nxt = avail = 0
  out = []
  for s in range(len(lengths)):
    avail += lengths[s].size
    decode = segments = busy = refills = 0
    hist = np.zeros(len(buckets), np.int64)
    while True:
      seg = 0
      while seg < every and (nxt < avail or not done.all()):
        go, count = refill_rule(int(done.sum()), avail - nxt, refill_rows, minimum=min)
        if go:
          at = np.flatnonzero(done)[:count]
          left[at], owner[at], step[at] = stream[nxt : nxt + count] - 1, batch_of[nxt : nxt + count], 1
          done[at] = left[at] <= 0
          np.subtract.at(unfinished, owner[at][done[at]], 1)  # a 1-token response ends at its prefill
          nxt += count
          refills += 1
          continue
        live = ~done
        k = min(int(left[live].min()), every - seg)  # no refill before the next row ends
        if buckets:
          top = int(step[live].max())
          hist += bucket_counts(prompt_len + top, prompt_len + top + k - 1, buckets)
        busy += int(live.sum()) * k
        left[live] -= k
        step[live] += k
        ended = live & (left <= 0)
        np.subtract.at(unfinished, owner[ended], 1)
        done |= ended
        seg += k
      segments, decode = segments + 1, decode + seg
      if s < ahead or unfinished[s - ahead] == 0:
        break
    live_at_swap = int((~done).sum())
    drawn = tuple(int(x) for x in step[~done])
    out.append(StreamStep(decode, segments, busy / max(decode, 1), live_at_swap, refills, tuple(int(h) for h in hist),
                          drawn))  # fmt: skip
  return out


def steady_schedule(steps: list[StreamStep], skip: int, buckets: tuple[int, ...]) -> Schedule:
  """The mean `Schedule` of one global step in the steady state: the steps after the first `skip` (the pool's
  filling: `ahead` + 1 steps), decode steps, refills and bucket steps averaged, live rows weighted by decode steps.

  Raises:
    ValueError: no step left after `skip`.
  """
  tail = steps[skip:]
  if not tail:
    raise ValueError(f"steady_schedule: {len(steps)} steps leave none after the first {skip}")
  decode = np.asarray([s.decode_steps for s in tail], np.float64)
  live = float(np.sum([s.mean_live_rows * s.decode_steps for s in tail]) / max(decode.sum(), 1))
  bucket_steps = tuple(float(np.mean(v)) for v in zip(*(s.bucket_steps for s in tail)))
  refills = float(np.mean([s.refills for s in tail]))
  return Schedule(float(decode.mean()), refills, tuple(buckets), bucket_steps, live)
