"""The token draw of `methods.get_next_tokens` on one shard of the vocabulary, so a sampler whose logits are split
by vocabulary (the sampler's layout: "act_vocab" over `tensor`) draws without gathering them (issue 54).

The draw is `methods.sample_categorical`'s two-level inverse CDF over vocabulary blocks of `SAMPLE_BLOCK` tokens
from the start of the vocabulary: a block from the block masses with one uniform, a token inside it with a second.
The blocks are global, so the draw does not depend on the sharding; a shard of V / t tokens whose bounds fall inside
a block handles that block with the tokens it lacks taken from the next shard (at most `SAMPLE_BLOCK` - 1 of them,
`_next_head`). Each shard sums the blocks that start in its range; every shard then holds the [rows, blocks] sums
of the whole vocabulary (one all-reduce of a few hundred floats a row), draws the block, and the shard that holds
it draws the token. The normaliser z, the entropy and the kept mass are sums of those block sums. Every sum is a fixed
pairwise tree of elementwise adds (`tree_sum`), the same on one device as on t shards, so the sharded draw returns
the one-device draw's tokens, log-probs, entropies and kept-set thresholds bit for bit (tests/test_vocab_draw.py, 8
CPU devices). Against the draw of before (XLA reductions: the block masses, and z over the whole vocabulary in one)
the log-probs move by fp32 rounding, and a token only where a uniform falls within that rounding of a block's or
token's bound (none in the tests' draws).

Top-k / top-p: each shard's `lax.top_k` candidates (values, global ids) are gathered and the global top-k taken over
them: `lax.top_k` orders equal values by lower index, and the gathered candidates are in shard order, so this is the
full vocabulary's `lax.top_k`. The nucleus is `methods._nucleus_keep` on them, and the kept set is the threshold
test of `methods._sorted_prefix_mask`, elementwise on each shard. Top-p alone, on a row whose nucleus reaches past
`TOP_P_CANDIDATES` tokens, finds the nucleus's threshold by bisection over the logits' values (`_nucleus_search`,
`lax.cond`; rare at top_p <= 0.99): all-reduces of block sums, no gather of the logits.

Collectives per draw over the vocabulary axes (none on one device): a max of the rows' logits, the next shard's
first `SAMPLE_BLOCK` logits (a `ppermute`; an all-gather of the whole vocabulary when a shard is shorter than a
block), the block sums (a sum of each shard's blocks at their places), the token (a max); greedy also the argmax (a
min); with truncation also the candidates (an all-gather of [rows, t * k]) and the threshold's min / max; top-p
past the candidates, 34 all-reduces of [rows, blocks] or [rows, t] and three min / max.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minpro_jax.runtime import sharding

NEG = -jnp.inf


class _Shard:
  """Collectives over the vocabulary's mesh axes `axes` (t shards, in the order of `lax.axis_index(axes)`); with no
  axes (t = 1) each is the identity on one device."""

  def __init__(self, axes: tuple[str, ...], t: int):
    self.axes, self.t = axes, t
    self.index = jax.lax.axis_index(axes) if axes else 0

  def pmax(self, x):
    return jax.lax.pmax(x, self.axes) if self.axes else x

  def pmin(self, x):
    return jax.lax.pmin(x, self.axes) if self.axes else x

  def gather(self, x, axis: int):
    """[..., n, ...] -> [..., t * n, ...] along `axis`, in shard order."""
    return jax.lax.all_gather(x, self.axes, axis=axis, tiled=True) if self.axes else x


def tree_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis as a fixed pairwise tree of elementwise adds (padded with -0.0 to a power of two, which
  adds nothing): the same order in every program. An XLA reduction may sum a row in another order in programs of
  other shapes (8 CPU devices: 4 of 16 block sums of a [16, 4000] draw differed in the last bit), which would move
  the draw's block masses, and with them rare tokens, between one device and t shards."""
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  x = jnp.concatenate([x, jnp.full((*x.shape[:-1], width - n), -0.0, x.dtype)], axis=-1) if width > n else x
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def block_layout(v: int, t: int, block: int) -> tuple[list[int], list[int], int]:
  """(first global block of each shard, its block count, the largest count) for t shards of v // t tokens: a
  shard owns the blocks that start in its range."""
  vl, nb = v // t, -(-v // block)
  firsts = [-(-(s * vl) // block) for s in range(t)]
  counts = [(firsts[s + 1] if s + 1 < t else nb) - firsts[s] for s in range(t)]
  return firsts, counts, max(counts)


def _next_head(scaled: jax.Array, shard: _Shard, v: int, block: int) -> jax.Array:
  """[B, block]: the logits of the `block` tokens after this shard's range (-inf past the vocabulary)."""
  b, vl = scaled.shape
  if not shard.axes:
    return jnp.full((b, block), NEG, scaled.dtype)
  if vl >= block:
    t = shard.t
    head = jax.lax.ppermute(scaled[:, :block], shard.axes, [(i + 1, i) for i in range(t - 1)])
    return jnp.where(shard.index == t - 1, NEG, head)
  full = jnp.concatenate([shard.gather(scaled, 1), jnp.full((b, block), NEG, scaled.dtype)], axis=1)
  return jax.lax.dynamic_slice_in_dim(full, (shard.index + 1) * vl, block, axis=1)


def first_above(weights_bn: jax.Array, u_b: jax.Array) -> jax.Array:
  """[B] int32: inverse CDF of non-negative weights at fraction u in [0, 1): the first index with positive
  weight whose cumulative weight exceeds u * total (the last positive one if rounding leaves none)."""
  n = weights_bn.shape[-1]
  cdf = jnp.cumsum(weights_bn, axis=-1)
  positive = weights_bn > 0
  hit = (cdf > (u_b * cdf[:, -1])[:, None]) & positive
  iota = jnp.arange(n, dtype=jnp.int32)[None, :]
  first = jnp.min(jnp.where(hit, iota, n), axis=-1)
  last = jnp.max(jnp.where(positive, iota, -1), axis=-1)
  return jnp.where(first < n, first, jnp.maximum(last, 0)).astype(jnp.int32)


def _float_key(x: jax.Array) -> jax.Array:
  """int32 keys in the order of the float32 values (an involution: `_float_key(_float_key(x)) bits == x bits`)."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  return i ^ ((i >> 31) & 0x7FFFFFFF)


def _key_float(k: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(k ^ ((k >> 31) & 0x7FFFFFFF), jnp.float32)


def _nucleus_search(sc, shard: _Shard, top_p: float, mass_above, z, m):
  """(tau, i_tau) [B] of the nucleus found by a threshold search, without gathering the logits.

  The kept set is the sorted-prefix rule of `methods._nucleus_keep` (a token is kept while the mass before it is
  < top_p) with the mass before a token taken as A(s) + j * q: A(s) = `mass_above(s)`, the unnormalised mass of the
  tokens with logit > s (block tree sums, the same on any split), q = exp(s - m) a token's own weight, j its rank
  among the tokens of equal logit (by id). A is non-increasing in s, so the lowest kept logit is the least token
  logit >= tau0, tau0 the least float with A(tau0) < top_p * z: a bisection over the floats' int32 order (32
  rounds of one all-reduce of [B, blocks] sums). Ties at that logit are counted by id across the shards (an
  all-reduce of [B, t] counts). Against the whole vocabulary's sort and cumsum the set moves only where a mass lies
  within fp32 rounding of top_p (the tests' rows: none).
  """
  b, vl = sc.shape
  target = top_p * z
  lo = _float_key(shard.pmin(jnp.min(sc, axis=-1))) - 1  # A(lo) = z >= target: not kept
  hi = _float_key(m)  # A(max) = 0 < target: kept

  def halve(_, bounds):
    lo, hi = bounds
    live = lo + 1 < hi
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
    ok = mass_above(_key_float(jnp.where(live, mid, hi))) < target
    return jnp.where(live & ~ok, mid, lo), jnp.where(live & ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))  # keys span < 2^32: 32 halvings close every row
  tau = shard.pmin(jnp.min(jnp.where(sc >= _key_float(hi)[:, None], sc, jnp.inf), axis=-1))
  before = mass_above(tau)  # < target
  q = jnp.exp(tau - m)
  tied = sc == tau[:, None]
  own = jnp.sum(tied, axis=-1, dtype=jnp.int32)
  counts = own[:, None] * (jnp.arange(shard.t)[None, :] == shard.index)
  counts = jax.lax.psum(counts, shard.axes) if shard.axes else counts
  # n: the tied tokens kept, #{j >= 0 : before + j * q < target}, at least 1, at most all of them
  total = jnp.sum(counts, axis=-1)
  n = jnp.clip(jnp.ceil((target - before) / q), 1, total).astype(jnp.int32)  # q = 0 (underflow): inf -> all
  n = jnp.where((n < total) & (before + n.astype(jnp.float32) * q < target), n + 1, n)
  n = jnp.where((n > 1) & (before + (n - 1).astype(jnp.float32) * q >= target), n - 1, n)
  # the n-th tied token by id: on the shard whose tied tokens hold it
  rank = n - jnp.sum(jnp.where(jnp.arange(shard.t)[None, :] < shard.index, counts, 0), axis=-1)
  pos = jnp.argmax(tied & (jnp.cumsum(tied, axis=-1) == rank[:, None]), axis=-1)
  i_tau = jnp.where((rank >= 1) & (rank <= own), shard.index * vl + pos.astype(jnp.int32), -1)
  return tau, shard.pmax(i_tau)


def _kept_rule(sc, shard: _Shard, v: int, top_k, top_p, nucleus_keep, candidates: int, full=None):
  """(tau, i_tau) [B]: the kept set is {id : sc > tau or (sc == tau and id <= i_tau)} (`_sorted_prefix_mask`),
  from the gathered per-shard `lax.top_k` candidates ([B, t * k], never the logits). Top-p alone: `full` =
  (mass_above, z, m) of the whole distribution (`_nucleus_search`), which decides the rows whose nucleus reaches
  past the candidates."""
  b, vl = sc.shape
  use_k = bool(top_k) and top_k < v
  use_p = top_p is not None and top_p < 1.0
  k = top_k if use_k else min(v, candidates)
  offset = shard.index * vl

  def top(values, ids, n):
    if shard.t == 1:
      return values[:, :n], ids[:, :n]
    vals, pos = jax.lax.top_k(values, n)
    return vals, jnp.take_along_axis(ids, pos, axis=-1)

  def rule(vals, ids, keep):
    r = jnp.sum(keep, axis=-1, keepdims=True)
    return jnp.take_along_axis(vals, r - 1, axis=-1)[:, 0], jnp.take_along_axis(ids, r - 1, axis=-1)[:, 0]

  lv, li = jax.lax.top_k(sc, min(k, vl))
  # values and global ids in one all-gather (ids < 2^24 are exact as float32)
  both = shard.gather(jnp.stack([lv, (li.astype(jnp.int32) + offset).astype(jnp.float32)]), 2)
  vals, ids = top(both[0], both[1].astype(jnp.int32), k)
  if not use_p:
    return rule(vals, ids, jnp.ones(vals.shape, bool))
  if use_k:
    log_z = jax.nn.logsumexp(vals, axis=-1, keepdims=True)
  else:
    mass_above, z, m = full
    log_z = (m + jnp.log(z))[:, None]
  keep = nucleus_keep(jnp.exp(vals - log_z), top_p)
  tau, i_tau = rule(vals, ids, keep)
  if use_k or k == v:
    return tau, i_tau
  past = keep[:, -1]  # the nucleus may reach past the candidates

  def search():
    st, si = _nucleus_search(sc, shard, top_p, mass_above, z, m)
    return jnp.where(past, st, tau), jnp.where(past, si, i_tau)

  return jax.lax.cond(jnp.any(past), search, lambda: (tau, i_tau))


def draw_shard(scaled, u, *, v: int, axes: tuple[str, ...], t: int, sampling, block: int, candidates: int, nucleus):
  """One shard's part of the draw (the module docstring); on every shard the same [B] outputs.

  Args:
    scaled: [B, V / t] float32 temperature-scaled logits of this shard (vocabulary ids s * V / t + j).
    u: [B, 2] float32 uniforms of `methods.sample_categorical`.
    v: the vocabulary size V; axes, t: the vocabulary's mesh axes and their size (() and 1: one device).
    sampling: the `SamplingParams`; block: the draw's vocabulary block; candidates: `TOP_P_CANDIDATES`;
    nucleus: `methods._nucleus_keep`.

  Returns:
    (tokens [B] int32, logp [B], entropy [B], kept_logp_threshold [B] or None), as `methods.get_next_tokens`.
  """
  if v >= 1 << 24:
    raise ValueError(f"vocabulary of {v} tokens: the draw carries token ids as float32, exact below 2**24")
  shard = _Shard(axes, t)
  b, vl = scaled.shape
  firsts, counts, nbmax = block_layout(v, t, block)
  m = shard.pmax(jnp.max(scaled, axis=-1))
  first = jnp.asarray(firsts, jnp.int32)[shard.index] if axes else 0
  # this shard's blocks: its tokens from its first block's start, then the next shard's, -inf past them
  ext = jnp.concatenate([scaled, _next_head(scaled, shard, v, block), jnp.full((b, nbmax * block), NEG)], axis=1)
  start = first * block - shard.index * vl
  ext = jax.lax.dynamic_slice_in_dim(ext, start, nbmax * block, axis=1)
  gid = first * block + jnp.arange(nbmax * block, dtype=jnp.int32)[None, :]
  shifted = ext - m[:, None]
  e = jnp.exp(shifted)
  as_blocks = lambda x: x.reshape(b, nbmax, block)  # noqa: E731
  ids = shard.index * vl + jnp.arange(vl, dtype=jnp.int32)[None, :]  # this shard's own tokens

  def whole(parts_bxn):  # [B, X, nbmax] per shard -> [B, X, nb] global block order, on every shard
    if not axes:
      return parts_bxn[..., : counts[0]]
    # each shard's blocks at their global places, zeros elsewhere, summed over the shards: exact (one term is not
    # zero), and an all-reduce, as the layers' own collectives (no all-gather in a decode step)
    count = jnp.asarray(counts, jnp.int32)[shard.index]
    parts = jnp.where(jnp.arange(nbmax)[None, None, :] < count, parts_bxn, 0.0)
    placed = jnp.zeros((*parts.shape[:2], sum(counts) + nbmax), parts.dtype)
    placed = jax.lax.dynamic_update_slice_in_dim(placed, parts, first, axis=2)
    return jax.lax.psum(placed, axes)[..., : sum(counts)]

  ez = tree_sum(as_blocks(e))
  eh = tree_sum(as_blocks(jnp.where(e > 0, e * shifted, 0.0)))
  threshold = None
  if sampling.greedy:
    tok = shard.pmin(jnp.min(jnp.where(scaled - m[:, None] == 0, ids, v), axis=-1))
    tok = jnp.where(tok < v, tok, 0).astype(jnp.int32)
    zh = whole(jnp.stack([ez, eh], axis=1))
    z, h = tree_sum(zh[:, 0]), tree_sum(zh[:, 1])
    blk, inner = tok // block, tok % block
    norm = z
  else:
    if sampling.truncates:
      sc = jnp.where(scaled == 0, 0.0, scaled)
      use_k = bool(sampling.top_k) and sampling.top_k < v
      zh = None if use_k else whole(jnp.stack([ez, eh], axis=1))
      ext_sc = jnp.where(ext == 0, 0.0, ext)

      def mass_above(tau_b):  # [B]: the unnormalised mass of the tokens with logit > tau, as z is summed
        return tree_sum(whole(tree_sum(as_blocks(jnp.where(ext_sc > tau_b[:, None], e, 0.0)))[:, None])[:, 0])

      full = None if use_k else (mass_above, tree_sum(zh[:, 0]), m)
      tau, i_tau = _kept_rule(sc, shard, v, sampling.top_k, sampling.top_p, nucleus, candidates, full)
      kept = (ext_sc > tau[:, None]) | ((ext_sc == tau[:, None]) & (gid <= i_tau[:, None]))
      weights = jnp.where(kept, e, 0.0)
      ew = tree_sum(as_blocks(weights))
      if zh is None:
        zhw = whole(jnp.stack([ez, eh, ew], axis=1))
        z, h, bw = tree_sum(zhw[:, 0]), tree_sum(zhw[:, 1]), zhw[:, 2]
      else:
        z, h, bw = tree_sum(zh[:, 0]), tree_sum(zh[:, 1]), whole(ew[:, None])[:, 0]
      # the lowest kept and the highest dropped log-prob, over this shard's own tokens
      own_kept = (sc > tau[:, None]) | ((sc == tau[:, None]) & (ids <= i_tau[:, None]))
      own_shifted = scaled - m[:, None]
      lowest = -jnp.max(jnp.where(own_kept, -own_shifted, NEG), axis=-1)
      highest = jnp.max(jnp.where(own_kept, NEG, own_shifted), axis=-1)
      bounds = shard.pmax(jnp.stack([-lowest, highest], axis=-1))  # one max for both
      lowest, highest = -bounds[:, 0], bounds[:, 1]
      norm = tree_sum(bw)
      threshold = 0.5 * (lowest + highest) - jnp.log(z)
    else:
      zh = whole(jnp.stack([ez, eh], axis=1))
      z, h, bw = tree_sum(zh[:, 0]), tree_sum(zh[:, 1]), zh[:, 0]
      weights = e
      norm = z
    blk = first_above(bw, u[:, 0])
    lb = jnp.clip(blk - first, 0, nbmax - 1)
    inner = first_above(jnp.take_along_axis(as_blocks(weights), lb[:, None, None], axis=1)[:, 0], u[:, 1])
  # the token (inside its block) and its shifted logit from the shard that owns its block, in one max
  lb = blk - first
  mine = (lb >= 0) & (lb < (jnp.asarray(counts, jnp.int32)[shard.index] if axes else counts[0]))
  at = jnp.clip(lb, 0, nbmax - 1) * block + inner
  picked = jnp.stack([inner.astype(jnp.float32), jnp.take_along_axis(shifted, at[:, None], axis=-1)[:, 0]], axis=-1)
  picked = shard.pmax(jnp.where(mine[:, None], picked, NEG))
  tok, tok_shifted = blk * block + picked[:, 0].astype(jnp.int32), picked[:, 1]
  entropy = jnp.log(z) - h / z
  return tok, tok_shifted - jnp.log(norm), entropy, threshold


def vocab_axes(mesh, v: int) -> tuple[tuple[str, ...], int]:
  """(the mesh axes that split the vocabulary of the logits, their size): the auto axes of `mesh` the active
  rules map "act_vocab" to, where they divide v; ((), 1) outside a mesh."""
  if mesh is None or mesh.empty or not sharding.auto_axes(mesh):
    return (), 1
  axes = sharding.mesh_axes(mesh, "act_vocab", v)
  return axes, math.prod(mesh.shape[a] for a in axes) if axes else 1
