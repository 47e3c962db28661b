"""`GenerationBatch`: what the sampler hands to the rollout buffer and the learner (host-side numpy)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

FINISH_STOP = "stop"  # the row emitted one of the stop ids (the stop token is part of the response)
FINISH_LENGTH = "length"  # the row used all max_new_tokens without a stop id (truncated)


class LearnerArrays(NamedTuple):
  """Padded [N, P + R] arrays for `token_logprobs` and the losses (prompt left-padded, response right-padded).

  tokens: int32 prompt + response ids (padding holds the pad id).
  segment_ids: int32, 1 on real prompt/response tokens, 0 on padding.
  positions: int32 RoPE positions counting real tokens only (= `segment_positions(segment_ids)`).
  response_mask: bool, True on response tokens up to and including the stop token.
  behavior_logp: float32, log-prob of token t at index t (the alignment of `token_logprobs`), 0 elsewhere.
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  response_mask: np.ndarray
  behavior_logp: np.ndarray


@dataclasses.dataclass
class GenerationBatch:
  """N sampled rows (N = prompts x group_size), host-side numpy arrays.

  Attributes:
    prompt_tokens: [N, P] int32, left-padded with the pad id.
    prompt_mask: [N, P] bool, True on real prompt tokens.
    response_tokens: [N, R] int32, pad id after the stop token / at unused steps.
    response_mask: [N, R] bool, True up to and including the stop token.
    behavior_logp: [N, R] float32 log_softmax(logits / T)[token] over the full vocabulary (T = 1 for greedy),
      0 where masked. See `minpro_jax.sampling.methods`.
    entropy: [N, R] float32 entropy (nats) of the same distribution (0 where masked), or None.
    lengths: [N] int32 response lengths (= response_mask.sum(-1)).
    finish_reason: [N] str array, "stop" or "length".
    group_ids: [N] int64 group id (one per prompt) carried by every sample of that prompt.
    sample_index: [N] int32 index of the sample within its group, 0..G-1.
    policy_version: int, the parameter version (number of optimizer updates) that produced every row.
    temperature: the temperature the log-probs are reported at (1.0 for greedy); pass it to `token_logprobs`.
  """

  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  response_tokens: np.ndarray
  response_mask: np.ndarray
  behavior_logp: np.ndarray
  entropy: np.ndarray | None
  lengths: np.ndarray
  finish_reason: np.ndarray
  group_ids: np.ndarray
  sample_index: np.ndarray
  policy_version: int
  temperature: float = 1.0

  def __len__(self) -> int:
    return int(self.response_tokens.shape[0])

  @property
  def truncated(self) -> np.ndarray:
    """[N] bool, True for rows that hit max_new_tokens without a stop id."""
    return self.finish_reason == FINISH_LENGTH

  def to_learner_arrays(self) -> LearnerArrays:
    """Concatenates prompt and response into padded [N, P + R] learner arrays (see `LearnerArrays`).

    The left-padded prompt ends at column P - 1 and the response starts at column P, so every row is one
    contiguous segment; `token_logprobs(model, tokens, segment_ids, positions, temperature=self.temperature)`
    reproduces `behavior_logp` on `response_mask` (exactly, at equal parameters and precision).
    """
    n, p = self.prompt_tokens.shape
    tokens = np.concatenate([self.prompt_tokens, self.response_tokens], axis=1).astype(np.int32)
    real = np.concatenate([self.prompt_mask, self.response_mask], axis=1)
    segment_ids = real.astype(np.int32)
    positions = np.where(real, np.cumsum(real, axis=1) - 1, 0).astype(np.int32)
    response_mask = np.concatenate([np.zeros((n, p), bool), self.response_mask], axis=1)
    behavior_logp = np.concatenate([np.zeros((n, p), np.float32), self.behavior_logp], axis=1)
    return LearnerArrays(tokens, segment_ids, positions, response_mask, behavior_logp.astype(np.float32))
