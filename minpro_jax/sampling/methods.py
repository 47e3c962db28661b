"""Sampling parameters and the pure next-token function of the sampler.

The behavior log-prob contract (cases B12 and B13 of tests/CASES.md; tests/test_sampler.py,
tests/test_truncation.py): the recorded log-prob is that of the distribution the token was drawn from,

  no top-k / top-p:  behavior_logp(token) = log_softmax(logits / T)[token], over the full vocabulary;
  top-k and/or top-p: behavior_logp(token) = log_softmax(logits / T)[token] - log S, with S the probability mass
                      of the kept set K (the truncated, renormalised distribution),

and, when truncating, the sampler also records `kept_logp_threshold`: a full-distribution log-prob between the
lowest kept token's and the highest dropped token's (the midpoint of that gap), so K = {v : log_softmax(logits /
T)[v] > threshold}. The learner renormalises its own distribution over that set (`models.logprobs`,
`kept_logp_threshold_bt`), so its ratio is 1 at identical parameters; a learner scoring over the full vocabulary
would be off by exactly S on every token (trl#6789, trl#7269; docs/truncation.md says why a threshold and not the
kept ids). Reporting raw logits at T != 1 would be off by the temperature (B12). Greedy decoding (T <= 1e-6)
returns the argmax and reports log_softmax(logits) at T = 1 (`SamplingParams.logprob_temperature`), which is
finite for every token, so no NaN or inf can appear.

Order of truncation (HF / vLLM convention): temperature, then top-k, then top-p (nucleus sampling, Holtzman
et al. 2020) on the renormalised top-k distribution. The nucleus keeps the smallest prefix of tokens (sorted
by probability) whose mass reaches top_p, *including* the token that crosses the threshold, and always the
most likely token, so top_p=0 means argmax (case B11).

How a token is drawn: exact inverse-CDF sampling from the (truncated) softmax weights in two levels, a
vocabulary block then a token inside it, from two uniforms per row (`sample_categorical`), where jax's
Gumbel-max `random.categorical` needs one threefry draw per vocabulary entry. The draw of a row depends only
on its key and its logits, not on how the vocabulary is split over devices: under a mesh that splits the logits by
vocabulary, each shard draws its part (`vocab_draw`) with the one-device result, bit for bit.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minpro_jax.runtime import sharding
from minpro_jax.sampling import vocab_draw
from minpro_jax.sampling.vocab_draw import first_above as _first_above

GREEDY_EPS = 1e-6  # temperatures at or below this are greedy decoding


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample (frozen and hashable: it is a static argument of the jitted decode loop).

  Attributes:
    temperature: >= 0; logits are divided by it. <= 1e-6 means greedy (argmax).
    top_k: keep the k most likely tokens; None or 0 = off.
    top_p: nucleus mass in [0, 1] on the (top-k renormalised) distribution; None or 1.0 = off; 0 = argmax.
    max_new_tokens: > 0, response length budget R.
    stop_token_ids: tuple of int token ids that end a row (the stop token itself is part of the response).

  Raises:
    ValueError: a field is out of range or of the wrong type (the message names the field).
  """

  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real):
      raise ValueError(f"SamplingParams.temperature must be a real number >= 0, got {self.temperature!r}")
    if not self.temperature >= 0:  # also rejects NaN
      raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.top_k is not None and (
        isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0
    ):
      raise ValueError(f"SamplingParams.top_k must be None or an int >= 0 (0 = off), got {self.top_k!r}")
    if self.top_p is not None and (
        isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0.0 <= self.top_p <= 1.0
    ):
      raise ValueError(f"SamplingParams.top_p must be None or a float in [0, 1] (1 = off), got {self.top_p!r}")
    if (
        isinstance(self.max_new_tokens, bool)
        or not isinstance(self.max_new_tokens, numbers.Integral)
        or self.max_new_tokens <= 0
    ):
      raise ValueError(f"SamplingParams.max_new_tokens must be an int > 0, got {self.max_new_tokens!r}")
    stops = self.stop_token_ids
    if isinstance(stops, numbers.Integral) and not isinstance(stops, bool):
      stops = (stops,)
    if not isinstance(stops, (tuple, list, frozenset, set)):
      raise ValueError(f"SamplingParams.stop_token_ids must be a tuple of ints, got {type(stops).__name__}")
    for s in stops:
      if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
        raise ValueError(
            f"SamplingParams.stop_token_ids must hold non-negative ints, got {s!r} "
            f"({type(s).__name__}); convert token strings to ids with the tokenizer first"
        )
    object.__setattr__(self, "stop_token_ids", tuple(sorted({int(s) for s in stops})))
    object.__setattr__(self, "temperature", float(self.temperature))
    if self.top_k is not None:
      object.__setattr__(self, "top_k", int(self.top_k))
    if self.top_p is not None:
      object.__setattr__(self, "top_p", float(self.top_p))

  @property
  def greedy(self) -> bool:
    """True when decoding is argmax (temperature <= 1e-6)."""
    return self.temperature <= GREEDY_EPS

  @property
  def logprob_temperature(self) -> float:
    """Temperature of the distribution the behavior log-probs are reported under (1.0 for greedy).

    Pass this as `temperature=` to `token_logprobs` to recompute the same log-probs on the learner.
    """
    return 1.0 if self.greedy else self.temperature

  @property
  def truncates(self) -> bool:
    """True when tokens are drawn from a top-k / top-p set (not greedy, top_k > 0 or top_p < 1): the behavior
    log-probs are then renormalised over that set and the sampler records `kept_logp_threshold`."""
    return not self.greedy and (bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0))


class NextTokens(NamedTuple):
  """tokens: [B] int32; logp: [B] float32 behavior log-prob (module docstring); entropy: [B] float32 (nats) of
  the full tempered distribution; kept_logp_threshold: [B] float32 full-distribution log-prob threshold of the
  kept set when `SamplingParams.truncates` (-inf when nothing was dropped), else None."""

  tokens: jax.Array
  logp: jax.Array
  entropy: jax.Array
  kept_logp_threshold: jax.Array | None = None


# top-p alone first sorts only this many candidates (a full-vocabulary sort per row and step is expensive);
# rows whose nucleus reaches past them fall back to the full-vocabulary sort
TOP_P_CANDIDATES = 1024
SAMPLE_BLOCK = 256  # vocabulary block of the two-level inverse-CDF draw


def _sorted_prefix_mask(scaled_bv: jax.Array, vals_bk: jax.Array, ids_bk: jax.Array, keep_bk: jax.Array) -> jax.Array:
  """[B, V] bool: the tokens of the kept prefix `keep_bk` of `lax.top_k`'s order, in vocabulary order.

  `lax.top_k` orders by value, then by lower index among equal values, so the first r entries are exactly the
  tokens with value > tau, plus those with value == tau and index <= i_tau (tau, i_tau: the r-th entry).
  """
  r = jnp.sum(keep_bk, axis=-1, keepdims=True)  # >= 1: the first entry is always kept
  tau = jnp.take_along_axis(vals_bk, r - 1, axis=-1)
  i_tau = jnp.take_along_axis(ids_bk, r - 1, axis=-1)
  vocab = jnp.arange(scaled_bv.shape[-1], dtype=ids_bk.dtype)[None, :]
  return (scaled_bv > tau) | ((scaled_bv == tau) & (vocab <= i_tau))


def _nucleus_keep(probs_bk: jax.Array, top_p: float) -> jax.Array:
  """[B, K] bool prefix of sorted probabilities whose mass before each entry is < top_p (first always kept)."""
  mass_before = jnp.cumsum(probs_bk, axis=-1) - probs_bk
  return (mass_before < top_p).at[:, 0].set(True)


def truncation_logits(scaled_logits_bv: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
  """Top-k then top-p candidate set, as logits with -inf outside it (vocabulary order).

  Args:
    scaled_logits_bv: [B, V] float32 temperature-scaled logits.
    top_k: None/0 = off, else keep the k largest (ties: lower token id first, as `lax.top_k`).
    top_p: None/1 = off, else nucleus mass on the renormalised top-k distribution (crossing token kept).

  Returns:
    [B, V] float32: `scaled_logits_bv` on the kept tokens, -inf elsewhere (unchanged when both are off).
    With top-p alone, only the `TOP_P_CANDIDATES` most likely tokens are sorted unless some row's nucleus
    reaches past them, in which case the whole vocabulary is sorted; both give the same set.
  """
  v = scaled_logits_bv.shape[-1]
  use_k = bool(top_k) and top_k < v
  use_p = top_p is not None and top_p < 1.0
  if not use_k and not use_p:
    return scaled_logits_bv
  # `lax.top_k` orders +0.0 before -0.0, while == and > treat them as equal: one zero for the mask below
  scaled_logits_bv = jnp.where(scaled_logits_bv == 0, 0.0, scaled_logits_bv)

  def mask_from_top(k: int) -> jax.Array:
    vals, ids = jax.lax.top_k(scaled_logits_bv, k)
    if not use_p:
      return _sorted_prefix_mask(scaled_logits_bv, vals, ids, jnp.ones(vals.shape, bool))
    # top-k renormalised (softmax over the k values); top-p alone: the full distribution
    log_z = jax.nn.logsumexp(vals if use_k else scaled_logits_bv, axis=-1, keepdims=True)
    return _sorted_prefix_mask(scaled_logits_bv, vals, ids, _nucleus_keep(jnp.exp(vals - log_z), top_p))

  if use_k:
    mask = mask_from_top(top_k)
  elif v <= TOP_P_CANDIDATES:
    mask = mask_from_top(v)
  else:
    vals, ids = jax.lax.top_k(scaled_logits_bv, TOP_P_CANDIDATES)
    log_z = jax.nn.logsumexp(scaled_logits_bv, axis=-1, keepdims=True)
    keep = _nucleus_keep(jnp.exp(vals - log_z), top_p)
    # the last candidate kept -> that row's nucleus may extend past the candidates: sort everything
    mask = jax.lax.cond(
        jnp.any(keep[:, -1]), lambda: mask_from_top(v), lambda: _sorted_prefix_mask(scaled_logits_bv, vals, ids, keep)
    )
  return jnp.where(mask, scaled_logits_bv, -jnp.inf)


def sample_categorical(weights_bv: jax.Array, keys_b: jax.Array, block: int = SAMPLE_BLOCK) -> jax.Array:
  """One index per row drawn with probability weights / sum(weights), by a two-level inverse CDF.

  A vocabulary block is drawn from the block masses with one uniform, then a token inside it from the
  block's weights with a second, independent uniform: two random numbers per row instead of one Gumbel per
  vocabulary entry, and the fp32 CDFs stay short (V / block and block entries), so rounding moves each
  token's probability by ~1e-7 of its block's mass at most. A zero weight is never drawn.

  Args:
    weights_bv: [B, V] float32 non-negative, finite, with a positive sum per row (e.g. exp(logits - max),
      0 outside a top-k / top-p set).
    keys_b: [B] PRNG keys, one per row (the draw of a row depends only on its key and weights).
    block: vocabulary block size (static int >= 1).

  Returns:
    [B] int32 token ids.
  """
  b, v = weights_bv.shape
  nb = -(-v // block)
  w = jnp.pad(weights_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
  u = _uniforms(keys_b)
  blk = _first_above(jnp.sum(w, axis=-1), u[:, 0])
  inner = _first_above(jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0], u[:, 1])
  return blk * block + inner


def _uniforms(keys_b: jax.Array) -> jax.Array:
  """[B, 2] float32 uniforms of `sample_categorical`, on the midpoints of their 2^-23 grid, in (0, 1): u = 0 would
  hand the first positive weight of a row or block an extra 2^-23 of probability however small that weight is."""
  return jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys_b) + 2.0**-24


def get_next_tokens(logits_bv: jax.Array, keys_b: jax.Array, sampling: SamplingParams) -> NextTokens:
  """Draws one token per row and reports its behavior log-prob (see the module docstring).

  Args:
    logits_bv: [B, V] float32 raw logits of the next position.
    keys_b: [B] typed PRNG keys (or [B, 2] uint32), one per row.
    sampling: the `SamplingParams` (static).

  Returns:
    `NextTokens`: tokens [B] int32; logp [B] = log_softmax(logits / T)[token] over the full vocabulary (T = 1
    for greedy), minus log S (the kept mass) when `sampling.truncates`; entropy [B] of the full tempered
    distribution; kept_logp_threshold [B] when truncating (else None). Greedy picks the lowest id among equal
    maxima (as `argmax`); sampling is `sample_categorical`'s draw on the (truncated) softmax weights. The sums
    (z, the entropy's, the kept mass S) run over the draw's vocabulary blocks, then over the blocks.

  Under a mesh whose "act_vocab" axes split V (`use_mesh`; inside a `jax.shard_map`, its auto axes) the draw runs
  per vocabulary shard in a `jax.shard_map` (`vocab_draw`): no device gathers the [B, V] logits, and the outputs
  are the one-device outputs bit for bit.
  """
  scaled = logits_bv.astype(jnp.float32) / sampling.logprob_temperature
  b, v = scaled.shape
  u = jnp.zeros((b, 2), jnp.float32) if sampling.greedy else _uniforms(keys_b)
  mesh = jax.sharding.get_abstract_mesh()
  axes, t = vocab_draw.vocab_axes(mesh, v)

  def draw(scaled, u):
    out = vocab_draw.draw_shard(
        scaled,
        u,
        v=v,
        axes=axes,
        t=t,
        sampling=sampling,
        block=SAMPLE_BLOCK,
        candidates=TOP_P_CANDIDATES,
        nucleus=_nucleus_keep,
    )
    return out if out[3] is not None else out[:3]

  if axes:
    batch = sharding.mesh_axes(mesh, "batch", b, exclude=axes) or None
    n_out = 4 if sampling.truncates else 3
    draw = jax.shard_map(
        draw,
        mesh=mesh,
        in_specs=(P(batch, axes), P(batch, None)),
        out_specs=(P(batch),) * n_out,
        axis_names=sharding.auto_axes(mesh),
        check_vma=False,
    )
  return NextTokens(*draw(scaled, u))
