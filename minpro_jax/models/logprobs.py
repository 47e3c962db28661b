"""Per-token log-probabilities (and entropy) without materialising [B, T, V] logits.

The final hidden states are cut into sequence chunks of C tokens; a `lax.scan` over chunks projects each
chunk to the vocabulary, takes an fp32 logsumexp and gathers the target logit, under `jax.checkpoint`,
so both the forward and the backward pass hold at most [B, C, V] logits (Tunix's chunked log-prob path;
MaxText's vocabulary tiling is the same idea with a custom VJP).

This is the function the learner, the evaluator and the parity tests call.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from minpro_jax.models.transformer import Transformer


class TokenLogprobs(NamedTuple):
  """logp: [B, T] float32, logp[:, t] = log p(tokens[:, t] | tokens[:, <t]); column 0 is 0.
  entropy: [B, T] float32 entropy of the distribution that predicted token t (column 0 is 0), or None.
  router_aux_loss: scalar float32 MoE load-balancing loss of the forward pass (0 for dense models).
  """
  logp: jax.Array
  entropy: jax.Array | None
  router_aux_loss: jax.Array


def logprobs_from_hidden(hidden_btd: jax.Array, head_dv: jax.Array, targets_bt: jax.Array, *,
                         temperature: float = 1.0, chunk_size: int = 256,
                         return_entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """log softmax(hidden @ head / temperature)[target] per position, chunked over the sequence.

  Args:
    hidden_btd: [B, T, D] hidden states (any float dtype).
    head_dv: [D, V] output projection.
    targets_bt: [B, T] int32 token whose log-prob is wanted at each position.
    temperature: > 0; logits are divided by it before the softmax (the sampler's distribution).
    chunk_size: tokens per chunk C; peak logits memory is B * C * V * 4 bytes. `chunk_size >= T` is dense
      (one chunk, no recomputation in the backward pass).
    return_entropy: also return the entropy (nats) of each position's distribution.

  Returns:
    ([B, T] float32 log-probs, [B, T] float32 entropies or None).

  Raises:
    ValueError: temperature <= 0 or chunk_size <= 0.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
  b, t, d = hidden_btd.shape
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
  y = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
  inv_t = 1.0 / temperature

  def chunk(h_bcd, y_bc):
    logits = jnp.einsum("bcd,dv->bcv", h_bcd, head_dv, preferred_element_type=jnp.float32) * inv_t
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, y_bc[..., None], axis=-1)[..., 0] - lse
    if not return_entropy:
      return logp, None
    p = jnp.exp(logits - lse[..., None])
    return logp, lse - jnp.sum(p * logits, axis=-1)

  if n == 1:
    # One chunk holds all B * T * V logits anyway, so recomputing them in the backward pass would cost a
    # fourth head matmul and save no peak memory: the forward keeps them for the backward instead.
    logp, ent = jax.tree.map(lambda a: a[None], chunk(h[0], y[0]))
  else:
    chunk = jax.checkpoint(chunk)

    def body(carry, xs):
      return carry, chunk(*xs)

    _, (logp, ent) = jax.lax.scan(body, None, (h, y))
  logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  if ent is not None:
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return logp, ent


def token_logprobs(model: Transformer, tokens_bt: jax.Array, segment_ids_bt: jax.Array | None = None,
                   positions_bt: jax.Array | None = None, *, temperature: float = 1.0, chunk_size: int = 256,
                   return_entropy: bool = False) -> TokenLogprobs:
  """Teacher-forced log-probs of every token of `tokens_bt` under `model`.

  Args:
    model: the `Transformer`.
    tokens_bt: [B, T] int32 prompt+response tokens.
    segment_ids_bt: [B, T] int32 (0 = padding; see `Transformer`). Default all 1.
    positions_bt: [B, T] int32 RoPE positions (default: position inside each segment).
    temperature: divide logits by this before the softmax; use the sampler's temperature so the learner's
      log-probs are those of the distribution the tokens were sampled from.
    chunk_size: sequence chunk C of the vocabulary projection.
    return_entropy: also compute per-position entropy.

  Returns:
    `TokenLogprobs` with logp[:, t] = log p(tokens[:, t] | tokens[:, <t]) (column 0 is 0; values at
    padding or across segment boundaries are meaningless and must be masked by the caller).
  """
  out = model(tokens_bt, positions_bt, segment_ids_bt, return_hidden=True)
  logp, ent = logprobs_from_hidden(out.out[:, :-1], model.head_weight(), tokens_bt[:, 1:],
                                   temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy)
  logp = jnp.pad(logp, ((0, 0), (1, 0)))
  if ent is not None:
    ent = jnp.pad(ent, ((0, 0), (1, 0)))
  return TokenLogprobs(logp, ent, out.router_aux_loss)
