"""Per-token log-probabilities (and entropy) without materialising [B, T, V] logits.

The final hidden states are cut into sequence chunks of C tokens; a `lax.scan` over chunks projects each
chunk to the vocabulary, takes an fp32 logsumexp and gathers the target logit, so the forward pass holds at
most [B, C, V] logits (Tunix's chunked log-prob path). The backward pass is a custom VJP that recomputes each
chunk's logits one vocabulary tile [B, C, V/n] at a time and writes the head gradient tile by tile into one
[D, V] buffer, so it never holds a [D, V] temporary per chunk either (MaxText's vocabulary tiling idea). With
a single chunk (C >= T) plain autodiff is used: the logits are kept for the backward pass instead of
recomputed, which costs no extra peak memory there and saves one head matmul.

Truncated sampling (top-k / top-p): given the sampler's kept-set threshold per position (`kept_logp_threshold_bt`,
`minpro_jax.sampling.methods`), the log-prob is renormalised over the kept set K = {v : log_softmax(z)[v] >
threshold} plus the target itself, logp = z_y - logsumexp_{v in K} z_v, the log-prob of the distribution the
sampler drew from (trl#7269; docs/truncation.md). It costs one more masked sum over the chunk's logits, no
sort. Without a threshold nothing changes. The entropy is always that of the full tempered distribution.

This is the function the learner, the evaluator and the parity tests call. Log-probs and entropies are
fp32 and in nats.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from minpro_jax.models.dense import dense
from minpro_jax.models.transformer import Transformer


class TokenLogprobs(NamedTuple):
  """logp: [B, T] float32, logp[:, t] = log p(tokens[:, t] | tokens[:, <t]); column 0 is 0.
  entropy: [B, T] float32 entropy of the distribution that predicted token t (column 0 is 0), or None.
  router_aux_loss: scalar float32 MoE load-balancing loss of the forward pass (0 for dense models).
  routes: [B, T, L, k] int16 experts the router itself chose per token and layer (MoE; also under replay), or None.
  """

  logp: jax.Array
  entropy: jax.Array | None
  router_aux_loss: jax.Array
  routes: jax.Array | None = None


def _kept(z, lse, y, thr, start=0):
  """[B, C, V'] bool kept set of logits z (vocabulary ids start + [0, V')): log-prob above thr, or the target."""
  hit = (y - start)[..., None] == jnp.arange(z.shape[-1], dtype=y.dtype)
  return (z - lse[..., None] > thr[..., None]) | hit


def _chunk_forward(h_bcd, head_dv, y_bc, inv_t, return_entropy, thr_bc=None):
  """fp32 (logp, entropy or None, lse, lse of the kept set or None) of one [B, C] chunk (`thr_bc`: the kept-set
  thresholds, or None for the full vocabulary)."""
  logits = dense(h_bcd, head_dv, preferred_element_type=jnp.float32) * inv_t
  lse = jax.nn.logsumexp(logits, axis=-1)
  lse_kept = None
  logp = jnp.take_along_axis(logits, y_bc[..., None], axis=-1)[..., 0] - lse
  if thr_bc is not None:
    # log S, S the kept mass, summed in one pass over exp(logits - lse) (no second [B, C, V] array); S >= p(target)
    # holds exactly and keeps logp <= 0 where p(target) underflows
    p_kept = jnp.where(_kept(logits, lse, y_bc, thr_bc), jnp.exp(logits - lse[..., None]), 0.0)
    log_s = jnp.maximum(jnp.log(jnp.sum(p_kept, axis=-1)), logp)
    logp, lse_kept = logp - log_s, lse + log_s
  if not return_entropy:
    return logp, None, lse, lse_kept
  p = jnp.exp(logits - lse[..., None])
  return logp, lse - jnp.sum(p * logits, axis=-1), lse, lse_kept


def _num_vocab_tiles(vocab: int, vocab_tile: int) -> int:
  """Smallest tile count >= vocab / vocab_tile that divides vocab; 1 when the vocabulary is sharded."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and math.prod(mesh.shape.values()) > 1:
    return 1  # tiles would cut across vocabulary shards; keep one [D, V] matmul and let GSPMD shard it
  for n in range(max(1, -(-vocab // vocab_tile)), vocab + 1):
    if vocab % n == 0:
      return n
  return 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked(h_nbcd, head_dv, y_nbc, thr_nbc, inv_t, return_entropy, n_vtiles):
  """[N, B, C] (logp, entropy or zeros) over N chunks; backward in vocabulary tiles (see module docstring).
  `thr_nbc`: kept-set thresholds, or None."""
  return _chunked_fwd(h_nbcd, head_dv, y_nbc, thr_nbc, inv_t, return_entropy, n_vtiles)[0]


def _chunked_fwd(h_nbcd, head_dv, y_nbc, thr_nbc, inv_t, return_entropy, n_vtiles):
  del n_vtiles

  def body(carry, xs):
    logp, ent, lse, lse_kept = _chunk_forward(xs[0], head_dv, xs[1], inv_t, return_entropy, xs[2])
    return carry, (logp, jnp.zeros_like(logp) if ent is None else ent, lse, lse_kept)

  _, (logp, ent, lse, lse_kept) = jax.lax.scan(body, None, (h_nbcd, y_nbc, thr_nbc))
  return (logp, ent), (h_nbcd, head_dv, y_nbc, thr_nbc, lse, lse_kept, ent)


def _chunked_fwd_rule(h_nbcd, head_dv, y_nbc, thr_nbc, inv_t, return_entropy, n_vtiles):
  """The custom VJP's forward (symbolic zeros: the primal inputs come wrapped as `CustomVJPPrimal`)."""
  value = lambda x: jax.tree.map(lambda p: p.value, x, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))  # noqa: E731
  return _chunked_fwd(value(h_nbcd), value(head_dv), value(y_nbc), value(thr_nbc), inv_t, return_entropy, n_vtiles)


def _chunked_bwd(inv_t, return_entropy, n_vtiles, res, g):
  # With z = logits / T and p = softmax(z): d logp / dz = onehot(y) - p and
  # d entropy / dz = -p * (z - sum_i p_i z_i), where sum_i p_i z_i = lse - entropy. With a kept set K, the
  # log-prob's p is the softmax over K (0 outside it); the entropy's stays the full one.
  h_nbcd, head_dv, y_nbc, thr_nbc, lse_nbc, lse_kept_nbc, ent_nbc = res
  g_logp, g_ent = g
  # an entropy nothing differentiates (a metric) adds no work to the backward pass
  return_entropy = return_entropy and not isinstance(g_ent, SymbolicZero)
  zeros = lambda x: jnp.zeros(x.aval.shape, x.aval.dtype) if isinstance(x, SymbolicZero) else x  # noqa: E731
  g_logp, g_ent = zeros(g_logp), zeros(g_ent)
  vt = head_dv.shape[1] // n_vtiles

  def chunk_bwd(dw_dv, xs):
    h_bcd, y_bc, thr, lse, lse_kept, ent, gl, ge = xs

    def tile(carry, j):
      dh_bcd, dw_dv = carry
      start = j * vt
      w_dt = jax.lax.dynamic_slice_in_dim(head_dv, start, vt, axis=1)
      z = dense(h_bcd, w_dt, preferred_element_type=jnp.float32) * inv_t
      p = jnp.exp(z - lse[..., None])
      if thr is None:
        dz = -gl[..., None] * p
      else:
        p_kept = jnp.where(_kept(z, lse, y_bc, thr, start), jnp.exp(z - lse_kept[..., None]), 0.0)
        dz = -gl[..., None] * p_kept
      if return_entropy:
        dz = dz - ge[..., None] * p * (z - (lse - ent)[..., None])
      hit = (y_bc - start)[..., None] == jnp.arange(vt, dtype=y_bc.dtype)
      dz = (dz + jnp.where(hit, gl[..., None], 0.0)) * inv_t
      dh_bcd = dh_bcd + dense(dz.astype(w_dt.dtype), w_dt, w_transposed=True, preferred_element_type=jnp.float32)
      dw_tile = jax.lax.dot_general(
          h_bcd.reshape(-1, h_bcd.shape[-1]),
          dz.astype(h_bcd.dtype).reshape(-1, vt),
          (((0,), (0,)), ((), ())),
          preferred_element_type=jnp.float32,
      )
      old = jax.lax.dynamic_slice_in_dim(dw_dv, start, vt, axis=1)
      dw_dv = jax.lax.dynamic_update_slice_in_dim(dw_dv, old + dw_tile.astype(dw_dv.dtype), start, axis=1)
      return (dh_bcd, dw_dv), None

    dh0 = jnp.zeros(h_bcd.shape, jnp.float32)
    (dh, dw_dv), _ = jax.lax.scan(tile, (dh0, dw_dv), jnp.arange(n_vtiles))
    return dw_dv, dh.astype(h_bcd.dtype)

  dw, dh = jax.lax.scan(
      chunk_bwd,
      jnp.zeros(head_dv.shape, head_dv.dtype),
      (h_nbcd, y_nbc, thr_nbc, lse_nbc, lse_kept_nbc, ent_nbc, g_logp, g_ent),
  )
  return dh, dw, None, None


_chunked.defvjp(_chunked_fwd_rule, _chunked_bwd, symbolic_zeros=True)


def logprobs_from_hidden(
    hidden_btd: jax.Array,
    head_dv: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    return_entropy: bool = False,
    vocab_tile: int = 8192,
    kept_logp_threshold_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """log softmax(hidden @ head / temperature)[target] per position, chunked over the sequence.

  Args:
    hidden_btd: [B, T, D] hidden states (any float dtype).
    head_dv: [D, V] output projection.
    targets_bt: [B, T] int32 token whose log-prob is wanted at each position.
    temperature: > 0; logits are divided by it before the softmax (the sampler's distribution).
    chunk_size: tokens per chunk C; peak logits memory is B * C * V * 4 bytes. `chunk_size >= T` is dense
      (one chunk, no recomputation in the backward pass).
    return_entropy: also return the entropy (nats) of each position's distribution.
    vocab_tile: target width of the vocabulary tiles of the multi-chunk backward pass (the tile count is the
      smallest divisor of V giving tiles <= this); backward scratch is about B * C * vocab_tile * 4 * 3 bytes
      plus the [D, V] head gradient. Ignored (one tile) under a multi-device mesh.
    kept_logp_threshold_bt: None (the full vocabulary), or [B, T] float32 thresholds of the sampler's top-k /
      top-p sets: the log-prob of target t is renormalised over {v : log_softmax(logits / T)[v] > threshold}
      plus the target (module docstring); -inf keeps every token.

  Returns:
    ([B, T] float32 log-probs, [B, T] float32 entropies or None).

  Raises:
    ValueError: temperature <= 0, chunk_size <= 0 or vocab_tile <= 0, or thresholds not of the targets' shape.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
  if vocab_tile <= 0:
    raise ValueError(f"vocab_tile must be > 0, got {vocab_tile}")
  b, t, d = hidden_btd.shape
  thr = kept_logp_threshold_bt
  if thr is not None and thr.shape != targets_bt.shape:
    raise ValueError(f"kept_logp_threshold_bt has shape {thr.shape}, expected the targets' {targets_bt.shape}")
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
  y = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
  if thr is not None:
    thr = jnp.pad(thr.astype(jnp.float32), ((0, 0), (0, pad)), constant_values=-jnp.inf)
    thr = thr.reshape(b, n, c).swapaxes(0, 1)
  inv_t = 1.0 / temperature

  if n == 1:
    # one chunk holds all B * T * V logits anyway: recomputing them would add a head matmul and save no memory
    logp, ent, *_ = _chunk_forward(h[0], head_dv, y[0], inv_t, return_entropy, None if thr is None else thr[0])
    logp, ent = logp[None], None if ent is None else ent[None]
  else:
    n_vtiles = _num_vocab_tiles(head_dv.shape[1], vocab_tile)
    logp, ent = _chunked(h, head_dv, y, thr, inv_t, return_entropy, n_vtiles)
    ent = ent if return_entropy else None
  logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  if ent is not None:
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return logp, ent


def token_logprobs(
    model: Transformer,
    tokens_bt: jax.Array,
    segment_ids_bt: jax.Array | None = None,
    positions_bt: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    return_entropy: bool = False,
    routes_btlk: jax.Array | None = None,
    kept_logp_threshold_bt: jax.Array | None = None,
) -> TokenLogprobs:
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
    routes_btlk: optional [B, T, L, k] int experts to replay (MoE; `Transformer`), NO_ROUTE (-1) where not.
    kept_logp_threshold_bt: optional [B, T] float32 kept-set threshold of token t at index t (the layout of
      `RolloutBatch.kept_logp_threshold`; column 0 is ignored): renormalise over the sampler's top-k / top-p sets
      (`logprobs_from_hidden`).

  Returns:
    `TokenLogprobs` with logp[:, t] = log p(tokens[:, t] | tokens[:, <t]) (column 0 is 0; values at
    padding or across segment boundaries are meaningless and must be masked by the caller).

  Raises:
    ValueError: temperature <= 0 or chunk_size <= 0 (`logprobs_from_hidden`), or inputs of the wrong shape
      (`Transformer.__call__`).
  """
  out = model(tokens_bt, positions_bt, segment_ids_bt, return_hidden=True, routes_btlk=routes_btlk)
  logp, ent = logprobs_from_hidden(
      out.out[:, :-1],
      model.head_weight(),
      tokens_bt[:, 1:],
      temperature=temperature,
      chunk_size=chunk_size,
      return_entropy=return_entropy,
      kept_logp_threshold_bt=None if kept_logp_threshold_bt is None else kept_logp_threshold_bt[:, 1:],
  )
  logp = jnp.pad(logp, ((0, 0), (1, 0)))
  if ent is not None:
    ent = jnp.pad(ent, ((0, 0), (1, 0)))
  return TokenLogprobs(logp, ent, out.router_aux_loss, out.routes)
