"""How many loop iterations the sampler runs on a length draw, and the bound for the same work.

`continuous_schedule` replays the continuous sampler's admission and refill policy (the continuous engine,
`minpro_jax.sampling.continuous.decode_with_refills`, whose rule `refill_rule` it calls) on N response lengths:
each loop iteration either refills up to `refill_rows` done decode rows with the next waiting requests (their
prefill samples response index 0) or runs one decode step for every live row (a row of length L lives L - 1 decode
steps), and a decode step attends over the smallest live-length bucket >= P + the longest live row's index. The
simulation jumps from one row's end to the next, so a step of 4,096 rows of 20k tokens takes milliseconds.
`static_schedule` is the static sampler: one prefill of every row, then decode steps until the longest row ends.

`sampling_bound` and `learning_bound` are the physics of the same work on a slice (docs/aot.md, "The bound").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minpro_jax.sampling.continuous import refill_rule


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Loop iterations of one sampler call.

  decode_steps: decode iterations; refills: refill iterations (continuous) or prefills (static: 1);
  bucket_steps: decode iterations per live-length bucket (same order as `buckets`); mean_live_rows: live rows per
  decode step on average.
  """

  decode_steps: int
  refills: int
  buckets: tuple[int, ...]
  bucket_steps: tuple[int, ...]
  mean_live_rows: float

  @property
  def iterations(self) -> int:
    """Loop iterations of the call: decode steps plus refills (prefills)."""
    return self.decode_steps + self.refills


def bucket_counts(lo: int, hi: int, buckets: tuple[int, ...]) -> np.ndarray:
  """How many integers in [lo, hi] fall in each bucket (the smallest bucket >= the value; above the last: last)."""
  edges = np.asarray(buckets)
  counts = np.zeros(len(buckets), np.int64)
  prev = -np.inf
  for i, b in enumerate(edges):
    top = b if i < len(edges) - 1 else np.inf
    a, z = max(lo, prev + 1), min(hi, top)
    if z >= a:
      counts[i] = int(z - a + 1)
    prev = b
  return counts


def continuous_schedule(lengths, rows: int, refill_rows: int, prompt_len: int, buckets: tuple[int, ...]) -> Schedule:
  """The continuous sampler's iterations on requests of `lengths` (response lengths in request order, each >= 1).

  Args:
    lengths: [N] ints, tokens each response gets (stop token included).
    rows: decode rows B; refill_rows: M, rows one refill prefills (the engine's `rows_and_refill`).
    prompt_len: P, the prompt bucket (cache slots before the responses).
    buckets: the live-length buckets of a P + R slot cache (`attention_core.live_length_buckets`).
  """
  lengths = np.asarray(lengths, np.int64)
  n = int(lengths.size)
  done = np.ones(rows, bool)
  step = np.zeros(rows, np.int64)  # next response index of each row
  left = np.zeros(rows, np.int64)  # decode steps the row still runs
  nxt = decode = refills = live_steps = 0
  hist = np.zeros(len(buckets), np.int64)
  while nxt < n or not done.all():
    go, count = refill_rule(int(done.sum()), n - nxt, refill_rows, minimum=min)
    if go:
      at = np.flatnonzero(done)[:count]
      left[at] = lengths[nxt : nxt + count] - 1
      step[at] = 1
      done[at] = left[at] <= 0
      nxt += count
      refills += 1
      continue
    live = ~done
    k = int(left[live].min())  # decode steps until the next row ends (no refill can come before)
    top = int(step[live].max())
    hist += bucket_counts(prompt_len + top, prompt_len + top + k - 1, buckets)
    live_steps += int(live.sum()) * k
    step[live] += k
    left[live] -= k
    done |= live & (left <= 0)
    decode += k
  return Schedule(decode, refills, tuple(buckets), tuple(int(h) for h in hist), live_steps / max(decode, 1))


def static_schedule(lengths, prompt_len: int, buckets: tuple[int, ...]) -> Schedule:
  """The static sampler: one prefill of all N rows, then max(lengths) - 1 decode steps over the whole cache."""
  lengths = np.asarray(lengths, np.int64)
  steps = int(lengths.max()) - 1
  hist = np.zeros(len(buckets), np.int64)
  hist[-1] = steps
  live = float(np.sum(lengths - 1)) / max(steps, 1)
  return Schedule(steps, 1, tuple(buckets), tuple(int(h) for h in hist), live)


def kv_tokens_read(lengths, prompt_lens) -> float:
  """Sum over rows and decode steps of the tokens in that row's cache: a row of prompt p and length L reads
  p + t tokens when it samples index t = 1 .. L - 1 (index 0 comes from the prefill)."""
  lengths = np.asarray(lengths, np.float64)
  p = np.broadcast_to(np.asarray(prompt_lens, np.float64), lengths.shape)
  steps = lengths - 1
  return float(np.sum(steps * p + steps * (steps + 1) / 2))


def sampling_bound(
    lengths,
    prompt_lens,
    *,
    kv_bytes_per_token: float,
    weight_bytes: float,
    chips: int,
    resident_chips: int,
    hbm_bandwidth: float,
) -> dict[str, float]:
  """Seconds the same sampling work needs at least on `chips` chips (HBM-bound decode).

  KV: every row's own cache read once per generated token, spread over every chip:
  kv_tokens_read x kv_bytes_per_token / (chips x HBM bandwidth). Weights: the longest row's decode steps (one wave
  of every row at once) each read the weights of the best resident layout once: (max L - 1) x weight_bytes /
  resident_chips / HBM bandwidth, where the weights are split over `resident_chips` (tensor parallel within one
  host) and every group of them decodes its share of the rows.

  Returns: {"kv": s, "weights": s, "total": s}; None for a chip without figures (hbm_bandwidth 0: cpu:N).
  """
  if not hbm_bandwidth:
    return None
  lengths = np.asarray(lengths)
  kv = kv_tokens_read(lengths, prompt_lens) * kv_bytes_per_token / (chips * hbm_bandwidth)
  w = (int(lengths.max()) - 1) * weight_bytes / max(resident_chips, 1) / hbm_bandwidth
  return {"kv": kv, "weights": w, "total": kv + w}


def learning_flops(lengths, prompt_lens, *, matmul_params: float, attn_flops_per_ctx: float) -> float:
  """Forward FLOPs over the real (unpadded) tokens: a sequence of T = p + L tokens costs T x 2 x matmul_params
  + attn_flops_per_ctx x T (T + 1) / 2 (causal attention over each token's own prefix)."""
  t = np.asarray(lengths, np.float64) + np.broadcast_to(np.asarray(prompt_lens, np.float64), np.shape(lengths))
  return float(np.sum(t * 2 * matmul_params + attn_flops_per_ctx * t * (t + 1) / 2))
