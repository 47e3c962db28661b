"""Sampling parameters and the pure next-token function of the sampler.

The behavior log-prob contract (public bug-report cases B12, B13; tests/test_sampler.py):

  behavior_logp(token) = log_softmax(logits / T)[token], over the FULL vocabulary.

Top-k and top-p only change *which* token is drawn, never how its log-prob is reported, so the learner,
which recomputes `token_logprobs(..., temperature=T)` with a full-vocabulary softmax, gets a ratio of
exactly 1 at identical parameters (renormalising over the nucleus would bias every ratio by the surviving
mass S; reporting raw logits at T != 1 would be off by the temperature). Greedy decoding (T <= 1e-6)
returns the argmax and reports log_softmax(logits) at T = 1 (`SamplingParams.logprob_temperature`), which
is finite for every token, so no NaN or inf can appear.

Order of truncation (HF / vLLM convention): temperature, then top-k, then top-p on the renormalised top-k
distribution. The nucleus keeps the smallest prefix of tokens (sorted by probability) whose mass reaches
top_p, *including* the token that crosses the threshold, and always the most likely token, so top_p=0
means argmax (case B11).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

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
    if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral)
                                   or self.top_k < 0):
      raise ValueError(f"SamplingParams.top_k must be None or an int >= 0 (0 = off), got {self.top_k!r}")
    if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real)
                                   or not 0.0 <= self.top_p <= 1.0):
      raise ValueError(f"SamplingParams.top_p must be None or a float in [0, 1] (1 = off), got {self.top_p!r}")
    if (isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, numbers.Integral)
        or self.max_new_tokens <= 0):
      raise ValueError(f"SamplingParams.max_new_tokens must be an int > 0, got {self.max_new_tokens!r}")
    stops = self.stop_token_ids
    if isinstance(stops, numbers.Integral) and not isinstance(stops, bool):
      stops = (stops,)
    if not isinstance(stops, (tuple, list, frozenset, set)):
      raise ValueError(f"SamplingParams.stop_token_ids must be a tuple of ints, got {type(stops).__name__}")
    for s in stops:
      if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
        raise ValueError(f"SamplingParams.stop_token_ids must hold non-negative ints, got {s!r} "
                         f"({type(s).__name__}); convert token strings to ids with the tokenizer first")
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


class NextTokens(NamedTuple):
  """tokens: [B] int32; logp: [B] float32 behavior log-prob; entropy: [B] float32 (nats) of that distribution."""
  tokens: jax.Array
  logp: jax.Array
  entropy: jax.Array


def truncation_logits(scaled_logits_bv: jax.Array, top_k: int | None, top_p: float | None):
  """Candidate set of top-k then top-p sampling.

  Args:
    scaled_logits_bv: [B, V] float32 temperature-scaled logits.
    top_k: None/0 = off, else keep the k largest.
    top_p: None/1 = off, else nucleus mass on the renormalised top-k distribution (crossing token kept).

  Returns:
    (cand_logits [B, C], cand_ids [B, C] int32): candidate logits (-inf outside the kept set), sorted
    descending, and their vocabulary ids; C = V when neither truncation is on (then ids are None).
  """
  v = scaled_logits_bv.shape[-1]
  use_k = bool(top_k) and top_k < v
  use_p = top_p is not None and top_p < 1.0
  if not use_k and not use_p:
    return scaled_logits_bv, None
  vals, ids = jax.lax.top_k(scaled_logits_bv, top_k if use_k else v)
  if use_p:
    probs = jax.nn.softmax(vals, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    keep = keep.at[:, 0].set(True)  # top_p = 0 -> argmax, never an empty set
    vals = jnp.where(keep, vals, -jnp.inf)
  return vals, ids.astype(jnp.int32)


def get_next_tokens(logits_bv: jax.Array, keys_b: jax.Array, sampling: SamplingParams) -> NextTokens:
  """Draws one token per row and reports its behavior log-prob (see the module docstring).

  Args:
    logits_bv: [B, V] float32 raw logits of the next position.
    keys_b: [B] typed PRNG keys (or [B, 2] uint32), one per row.
    sampling: the `SamplingParams` (static).

  Returns:
    `NextTokens`: tokens [B] int32, logp [B] = log_softmax(logits / T)[token] over the full vocabulary
    (T = 1 for greedy), entropy [B] of the same full distribution.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  scaled = logits_bv / sampling.logprob_temperature
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  if sampling.greedy:
    tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  else:
    cand, ids = truncation_logits(scaled, sampling.top_k, sampling.top_p)
    choice = jax.vmap(jax.random.categorical)(keys_b, cand).astype(jnp.int32)
    tokens = choice if ids is None else jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
  logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return NextTokens(tokens, logp, entropy)
