"""`GenerationBatch`: what the sampler generated (host-side numpy), prompt and response kept apart.

`minpro_jax.rl.rollout.RolloutBatch.from_generation` turns it into the learner's [N, P + R] layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_STOP = "stop"  # the row emitted one of the stop ids (the stop token is part of the response)
FINISH_LENGTH = "length"  # the row used all max_new_tokens without a stop id (truncated)


@dataclasses.dataclass
class GenerationBatch:
  """N sampled rows (N = prompts x group_size), host-side numpy arrays.

  Attributes:
    prompt_tokens: [N, P] int32, left-padded with the pad id.
    prompt_mask: [N, P] bool, True on real prompt tokens.
    response_tokens: [N, R] int32, pad id after the stop token / at unused steps.
    response_mask: [N, R] bool, True up to and including the stop token.
    behavior_logp: [N, R] float32 log-prob of each token under the distribution it was drawn from:
      log_softmax(logits / T)[token] (T = 1 for greedy), renormalised over the top-k / top-p set when the sampling
      truncates; 0 where masked. See `minpro_jax.sampling.methods`.
    entropy: [N, R] float32 entropy (nats) of the full tempered distribution, before any top-k / top-p (0 where
      masked), or None.
    lengths: [N] int32 response lengths (= response_mask.sum(-1)).
    finish_reason: [N] str array, "stop" or "length".
    group_ids: [N] int64 group id (one per prompt) carried by every sample of that prompt.
    sample_index: [N] int32 index of the sample within its group, 0..G-1.
    policy_version: int, the parameter version (number of optimizer updates) that produced every row, -1 when
      the caller gave none.
    temperature: the temperature the log-probs are reported at (1.0 for greedy); pass it to `token_logprobs`.
    routes: None, or [N, R, L, k] int16 MoE experts that fed each response token forward in each layer
      (`Sampler(record_routes=True)`); NO_ROUTE (-1) where no forward ran (the last token, padding).
    kept_logp_threshold: None when the sampling does not truncate, else [N, R] float32: token v was in the
      top-k / top-p set of a position iff log_softmax(logits / T)[v] > the threshold (-inf where masked).
      The learner renormalises over it (`minpro_jax.models.logprobs`; docs/truncation.md).
    token_version: None when one version drew every row (`policy_version`), else [N, R] int32 the version that
      drew each response token, -1 where masked (the streaming sampler, `minpro_jax.sampling.streaming`: a
      response continues under newer parameters; `policy_version` is then the smallest).
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
  routes: np.ndarray | None = None
  kept_logp_threshold: np.ndarray | None = None
  token_version: np.ndarray | None = None

  def __len__(self) -> int:
    return int(self.response_tokens.shape[0])

  @classmethod
  def from_decoded(cls, prompt_tokens, prompt_segments, tokens, logp, entropy, mask, stopped, **fields):
    """The batch of a decode loop's host outputs: tokens / logp / entropy / mask / stopped are [N, R] (stopped
    [N] bool: the row drew a stop id); the prompt [N, P] with its segment ids (nonzero = a real token); the
    lengths and finish reasons follow from the mask and `stopped`; `fields` are the other fields as they are."""
    return cls(
        prompt_tokens=prompt_tokens,
        prompt_mask=np.asarray(prompt_segments).astype(bool),
        response_tokens=tokens,
        response_mask=mask,
        behavior_logp=logp,
        entropy=entropy,
        lengths=mask.sum(-1).astype(np.int32),
        finish_reason=np.where(stopped, FINISH_STOP, FINISH_LENGTH),
        **fields,
    )

  def select(self, rows: slice | np.ndarray) -> "GenerationBatch":
    """The batch of rows `rows` (a slice or an index array) of every per-row field."""
    per_row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return dataclasses.replace(self, **{k: v[rows] for k, v in per_row.items() if isinstance(v, np.ndarray)})

  @property
  def truncated(self) -> np.ndarray:
    """[N] bool, True for rows that hit max_new_tokens without a stop id."""
    return self.finish_reason == FINISH_LENGTH
