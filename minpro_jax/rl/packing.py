"""Packing the learner's samples into rows of a token budget (`learner.row_tokens`), and unpacking per-token outputs.

Unpacked, every learner row is one sample, prompt bucket + max_new_tokens long whatever the response length, so at
long-tailed lengths most of a row is padding. Packed, the real tokens of a mini-batch's samples are placed side by
side in rows of W = `row_tokens` tokens by first-fit decreasing (a sample longer than W gets a row of its own), each
sample a segment of its row: segment ids 1, 2, ... in the order the samples sit (0 = padding), its own RoPE positions
(0, 1, ... as unpacked), its per-token advantage. The model's attention never crosses a segment (same non-zero id,
causal) and the objectives, aggregation and rollout correction reduce per segment (`minpro_jax.rl.prefix`), so a
packed update is the unpacked one up to float rounding (tests/test_packing.py).

Static shapes. A packed mini-batch of M samples of width L always has `packed_rows(M, L, W, mb)` rows: a multiple of
the micro-batch `mb` (a micro-batch is `mb` packed rows), at most M, and at least what first-fit needs. First fit
never leaves two rows both at most half full (an item that opened the later row would have fitted in the earlier),
so with every sample at most min(L, W) tokens it uses K <= ceil(2 M L / W) rows; K <= M as each sample fits a row.
The rows past K are padding; the learner skips the micro-batches that hold only padding (`jax.lax.cond`), so the
work done scales with K while the compiled shapes depend only on (M, L, W, mb).

Everything here is host numpy (pure functions): `plan` places the samples, `pack` gathers a batch's per-token fields
into the plan's rows, `unpack` scatters per-token outputs (the learner's log-probs, its routes) back to the batch's
[N, L] layout.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minpro_jax.errors import ConfigError
from minpro_jax.models.moe import NO_ROUTE
from minpro_jax.rl.rollout import RolloutBatch

# the per-token fields of a packed batch, in `minpro_jax.rl.learner.UpdateInputs` order
PACKED_FIELDS = ("tokens", "segment_ids", "positions", "response_mask", "behavior_logp", "learner_logp", "advantages")
SCORE_FIELDS = ("tokens", "segment_ids", "positions")


class PackPlan(NamedTuple):
  """Where each of N samples sits in R packed rows of W tokens.

  Attributes:
    num_rows: R, the rows of the packed arrays (static: `packed_rows`).
    width: W, tokens per packed row.
    used_rows: K <= R, the rows holding at least one sample (rows K..R-1 are padding).
    sample_row, sample_offset, lengths: [N] int64 row, first column and real-token count of each sample.
    src: [T] int64 flat indices into the unpacked [N, L] arrays of every real token (row-major order).
    dst: [T] int64 flat indices into the packed [R, W] arrays of the same tokens.
    segment_ids: [R, W] int32 packed segment ids (1, 2, ... per row in column order; 0 = padding).
  """

  num_rows: int
  width: int
  used_rows: int
  sample_row: np.ndarray
  sample_offset: np.ndarray
  lengths: np.ndarray
  src: np.ndarray
  dst: np.ndarray
  segment_ids: np.ndarray


def first_fit_decreasing(lengths: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Bins the items of `lengths` into rows of `row_tokens` by first-fit decreasing.

  Items are taken longest first (ties by index); each goes to the first row with room for it, else opens a new
  row; an item longer than `row_tokens` opens a row of its own that takes nothing else.

  Args:
    lengths: [N] non-negative ints.
    row_tokens: the row budget W > 0.

  Returns:
    (row [N] int64, offset [N] int64 (first column of the item in its row), number of rows).

  Raises:
    ValueError: row_tokens <= 0 or a negative length.
  """
  lengths = np.asarray(lengths, np.int64)
  if row_tokens <= 0:
    raise ValueError(f"row_tokens must be > 0, got {row_tokens}")
  if lengths.size and lengths.min() < 0:
    raise ValueError(f"lengths must be >= 0, got {lengths.min()}")
  n = lengths.size
  row, offset = np.zeros(n, np.int64), np.zeros(n, np.int64)
  fill = np.zeros(n, np.int64)  # tokens placed in each row opened so far (at most one row per item)
  opened = 0
  for i in np.argsort(-lengths, kind="stable"):
    size = lengths[i]
    fits = np.flatnonzero(fill[:opened] + size <= row_tokens) if size <= row_tokens else ()
    r = fits[0] if len(fits) else opened
    if r == opened:
      opened += 1
      fill[r] = 0 if size <= row_tokens else row_tokens  # an oversize item takes its row alone
    row[i], offset[i] = r, fill[r] if size <= row_tokens else 0
    fill[r] += size
  return row, offset, opened


def packed_rows(num_samples: int, sample_width: int, row_tokens: int, micro_batch: int) -> int:
  """The static number of packed rows of a mini-batch of `num_samples` samples of at most `sample_width` tokens:
  min(M, ceil(2 M L / W)) rounded up to a multiple of `micro_batch` (the first-fit bound of the module docstring),
  and never more than M rounded up."""
  m = num_samples
  bound = m if 2 * sample_width >= row_tokens else min(m, -(-2 * m * sample_width // row_tokens))
  return max(1, -(-bound // micro_batch)) * micro_batch


def _plan_shape(
    lengths: np.ndarray, used: int, sample_width: int, row_tokens: int, micro_batch: int, width: int | None = None
):
  """(R, W) of a plan whose first fit used `used` rows: W = max(row_tokens, longest sample, `width`), R the static
  `packed_rows` or, should first fit need more, its rows rounded up to a micro-batch."""
  width = max(row_tokens, int(np.max(lengths, initial=0)), width or 0)
  rows = max(packed_rows(len(lengths), sample_width, width, micro_batch), -(-used // micro_batch) * micro_batch)
  return rows, width


def plan_shape(lengths, sample_width: int, row_tokens: int, micro_batch: int) -> tuple[int, int, int]:
  """(R rows, K used rows, W width) that `plan` gives samples of `lengths` real tokens in unpacked rows of
  `sample_width`, without placing their tokens (compile-only tools: `minpro_jax.aot.packed`).

  Raises:
    ValueError: row_tokens or micro_batch <= 0, a negative length.
  """
  if micro_batch <= 0:
    raise ValueError(f"micro_batch must be > 0, got {micro_batch}")
  lengths = np.asarray(lengths, np.int64)
  used = first_fit_decreasing(lengths, row_tokens)[2]
  rows, width = _plan_shape(lengths, used, sample_width, row_tokens, micro_batch)
  return rows, used, width


def plan(segment_ids: np.ndarray, row_tokens: int, micro_batch: int, width: int | None = None) -> PackPlan:
  """Places the samples of an unpacked [N, L] batch (one sample per row, real tokens where `segment_ids != 0`) into
  packed rows of `row_tokens` tokens.

  Args:
    segment_ids: [N, L] int, non-zero on each sample's real tokens (prompt and response).
    row_tokens: W > 0, tokens per packed row.
    micro_batch: packed rows per micro-batch (the row count is a multiple of it).
    width: a least width of the packed rows (plans packed side by side share one: `plan_chunks`); None: none.

  Returns:
    The `PackPlan`: W = max(row_tokens, longest sample, width); `packed_rows(N, L, W, micro_batch)` rows.

  Raises:
    ValueError: row_tokens or micro_batch <= 0.
  """
  if micro_batch <= 0:
    raise ValueError(f"micro_batch must be > 0, got {micro_batch}")
  real = np.asarray(segment_ids) != 0
  n, length = real.shape
  lengths = real.sum(1).astype(np.int64)
  row, offset, used = first_fit_decreasing(lengths, row_tokens)
  rows, width = _plan_shape(lengths, used, length, row_tokens, micro_batch, width)
  sample_of_token, col = np.nonzero(real)  # row-major: each sample's tokens in order
  rank = np.cumsum(real, axis=1)[sample_of_token, col] - 1  # index of the token inside its sample
  src = sample_of_token * length + col
  dst = row[sample_of_token] * width + offset[sample_of_token] + rank
  # segment id of a sample: 1 + how many samples sit before it in its row
  order = np.lexsort((offset, row))
  seg = np.zeros(n, np.int32)
  starts = np.r_[0, np.flatnonzero(np.diff(row[order])) + 1]
  seg[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n])) + 1
  packed_seg = np.zeros(rows * width, np.int32)
  packed_seg[dst] = seg[sample_of_token]
  return PackPlan(rows, width, used, row, offset, lengths, src, dst, packed_seg.reshape(rows, width))


def pack_tokens(values: np.ndarray, p: PackPlan, fill=0) -> np.ndarray:
  """[N, L, ...] per-token `values` of the planned batch -> [R, W, ...]: each real token moved to its packed place
  in the rows of `p`, `fill` elsewhere (the batch's dtype)."""
  values = np.asarray(values)
  trail = values.shape[2:]
  out = np.full((p.num_rows * p.width, *trail), fill, values.dtype)
  out[p.dst] = values.reshape(-1, *trail)[p.src]
  return out.reshape(p.num_rows, p.width, *trail)


def pack(batch: RolloutBatch, p: PackPlan, fields=PACKED_FIELDS, routes: bool = False) -> dict[str, np.ndarray]:
  """The per-token `fields` of `batch` in the packed rows of `p` (host arrays, the batch's dtypes).

  `segment_ids` are the plan's; `advantages` ([N] per sample) become [R, W] per token; padding is 0 (False), and
  NO_ROUTE in `routes` ([R, W, layers, k], with `routes=True`); `kept_logp_threshold` and `proximal_logp` too when
  the batch has them.
  """
  out = {}
  for f in fields:
    if f == "segment_ids":
      out[f] = p.segment_ids
    elif f == "advantages":
      per_token = np.broadcast_to(np.asarray(batch.advantages)[:, None], batch.tokens.shape)
      out[f] = pack_tokens(per_token, p)
    else:
      out[f] = pack_tokens(getattr(batch, f), p)
  if routes:
    out["routes"] = pack_tokens(batch.routes, p, fill=NO_ROUTE)
  if batch.kept_logp_threshold is not None:  # the sampler's kept set (truncated sampling, docs/truncation.md)
    out["kept_logp_threshold"] = pack_tokens(batch.kept_logp_threshold, p)
  if batch.proximal_logp is not None:  # decoupled PPO's pi_prox (`minpro_jax.rl.proximal`)
    out["proximal_logp"] = pack_tokens(batch.proximal_logp, p)
  return out


def unpack(values: np.ndarray, p: PackPlan, shape: tuple[int, int], fill=0) -> np.ndarray:
  """[R, W, ...] per-token outputs of packed rows -> the unpacked [N, L, ...] layout (`shape` = (N, L)), `fill`
  off the samples' real tokens."""
  values = np.asarray(values)
  trail = values.shape[2:]
  out = np.full((shape[0] * shape[1], *trail), fill, values.dtype)
  out[p.src] = values.reshape(-1, *trail)[p.dst]
  return out.reshape(*shape, *trail)


def plan_chunks(segment_ids: np.ndarray, chunk_rows: int, row_tokens: int, micro_batch: int, width: int | None = None):
  """One `plan` per consecutive chunk of `chunk_rows` samples of an unpacked [N, L] batch (a step's mini-batches:
  each packed on its own, as its update packs it), all of one shape so their rows can sit side by side
  (`pack_chunks`): W = max(row_tokens, the longest sample of the batch, `width`), R = `packed_rows(chunk_rows, L,
  W, micro_batch)`.

  Raises:
    ValueError: chunk_rows <= 0 or not dividing N; as `plan`.
  """
  seg = np.asarray(segment_ids)
  n = seg.shape[0]
  if chunk_rows <= 0 or n % chunk_rows:
    raise ValueError(f"plan_chunks: {n} samples do not split into chunks of {chunk_rows}")
  longest = int((seg != 0).sum(1).max(initial=0))
  w = max(row_tokens, longest, width or 0)
  plans = [plan(seg[i : i + chunk_rows], row_tokens, micro_batch, width=w) for i in range(0, n, chunk_rows)]
  rows = max(p.num_rows for p in plans)  # the static count of every chunk (first fit never needs more)
  return [p._replace(num_rows=rows, segment_ids=_pad_rows(p.segment_ids, rows, 0)) for p in plans]


def _pad_rows(values: np.ndarray, rows: int, fill) -> np.ndarray:
  """[R, ...] -> [rows, ...] with `fill` rows appended."""
  pad = [(0, rows - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
  return np.pad(values, pad, constant_values=fill)


def pack_chunks(batch: RolloutBatch, plans, fields=PACKED_FIELDS, routes: bool = False) -> dict[str, np.ndarray]:
  """`pack` of each chunk of `batch` (`plan_chunks`), side by side: [len(plans) x R, W, ...] rows, chunk c's at
  [c R, (c + 1) R)."""
  m = batch.size // len(plans)
  parts = [pack(batch.select(slice(c * m, (c + 1) * m)), p, fields, routes) for c, p in enumerate(plans)]
  return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


def unpack_chunks(values: np.ndarray, plans, shape: tuple[int, int], fill=0) -> np.ndarray:
  """`unpack` of per-token outputs of `pack_chunks`'s rows ([len(plans) x R, W, ...]) -> [N, L, ...] (`shape` =
  (N, L))."""
  r, m = plans[0].num_rows, shape[0] // len(plans)
  parts = [unpack(values[c * r : (c + 1) * r], p, (m, shape[1]), fill) for c, p in enumerate(plans)]
  return np.concatenate(parts)


def pad_fraction(segment_ids: np.ndarray, micro_batch: int) -> float:
  """The share of the token slots the learner runs that are padding: 1 - real tokens / (micro-batches holding a
  real token x `micro_batch` rows x width), for packed or unpacked [R, W] `segment_ids`."""
  real = np.asarray(segment_ids) != 0
  rows, width = real.shape
  mb = min(micro_batch, rows)
  active = int(real.reshape(rows // mb, -1).any(1).sum())
  return 1.0 - float(real.sum()) / max(active * mb * width, 1)


def check_row_tokens(c) -> None:
  """`learner.row_tokens` of a training config: 0 / None (off) or an int that holds the longest sample and is at
  most a whole mini-batch's tokens.

  Raises:
    ConfigError: naming `config.learner.row_tokens` and the fix.
  """
  learner = c.get("learner")
  w = None if learner is None else learner.get("row_tokens")
  if not w:
    return
  longest = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if isinstance(w, bool) or not isinstance(w, int) or w < longest:
    raise ConfigError(
        f"config.learner.row_tokens: {w!r} cannot hold the longest sample (data.max_prompt_tokens + "
        f"sampling.max_new_tokens = {longest} tokens) in one packed row; set it to an int >= {longest} "
        "(e.g. that sum: several short samples per row), or 0 to turn packing off"
    )
  mini_batch = _mini_batch(c)
  if w > mini_batch * longest:
    raise ConfigError(
        f"config.learner.row_tokens: {w} is wider than a whole mini-batch ({mini_batch} samples x {longest} "
        f"tokens = {mini_batch * longest}); one row of that width holds the mini-batch already, and a wider one only "
        f"pads: set it to at most {mini_batch * longest} (usually {longest}..{4 * longest}), or 0 to turn packing off"
    )


def _mini_batch(c) -> int:
  """Samples per mini-batch (one optimizer update) of a training config, at least 1."""
  return max(1, c.prompts_per_step * c.group_size // max(1, c.num_updates_per_step))


def micro_batch_warning(c) -> str | None:
  """A warning when packing is on but cannot save work: a micro-batch as large as the mini-batch holds every packed
  row, and the one micro-batch always runs (`docs/learner.md`); None otherwise."""
  w, m = row_tokens(c), _mini_batch(c)
  if not w or c.micro_batch_size < m:
    return None
  return (
      f"learner.row_tokens={w} with micro_batch_size={c.micro_batch_size} >= the mini-batch of {m} samples: every "
      "packed row sits in the one micro-batch, which always runs, so packing saves no work here and pads more "
      f"(learn/pad_fraction); set micro_batch_size below {m} (e.g. {max(1, m // 4)}) so that the micro-batches "
      "packing empties are skipped"
  )


def row_tokens(c) -> int | None:
  """The config's packing budget, None when packing is off."""
  learner = c.get("learner")
  return (learner.get("row_tokens") or None) if learner is not None else None
