"""Projections as one 2-D matmul: the leading (batch, sequence) axes are flattened before the dot.

Why not `jnp.einsum("btd,df->btf", ...)`: autodiff turns the 3-D einsum's weight gradient into a dot that
contracts over both batch and sequence, and XLA:CPU lowers that as a transposed copy of the [B, T, F]
activation gradient followed by a non-library dot. With the token axes flattened first, the weight gradient
is the canonical `x[N, D]^T @ dy[N, F]` dot and no copy is made. Reshapes that merge or split contiguous axes
are free (bitcasts), also for the parameters, so the stored layouts do not change.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dense(
    x: jax.Array, w: jax.Array, *, n_in: int = 1, w_transposed: bool = False, preferred_element_type=None
) -> jax.Array:
  """Contract the last `n_in` axes of `x` with `w` as one [N, K] x [K, M] matmul.

  Args:
    x: [..., *in] activations; all leading axes are flattened into N.
    w: [*in, *out] weight, or [*out, *in] when `w_transposed` (e.g. a tied [V, D] embedding used as the
      LM head, contracted as stored, without a transposed copy).
    n_in: number of contracted axes (2 for an output projection [H, hd, D] from [..., H, hd]).
    w_transposed: contract with the trailing `n_in` axes of `w` instead of the leading ones.
    preferred_element_type: accumulation/output dtype of the dot (default: the operands' dtype).

  Returns:
    [..., *out], the same values as the equivalent `jnp.einsum`.

  Raises:
    ValueError: the contracted axes of `x` and `w` differ in size.
  """
  in_shape = w.shape[w.ndim - n_in :] if w_transposed else w.shape[:n_in]
  out_shape = w.shape[: w.ndim - n_in] if w_transposed else w.shape[n_in:]
  if tuple(x.shape[x.ndim - n_in :]) != tuple(in_shape):
    raise ValueError(
        f"dense: contracted axes of x {x.shape} and w {w.shape} (n_in={n_in}, " f"w_transposed={w_transposed}) differ"
    )
  k, m = math.prod(in_shape), math.prod(out_shape)
  lead = x.shape[: x.ndim - n_in]
  x_nk = x.reshape(-1, k)
  if w_transposed:
    y = jax.lax.dot_general(
        x_nk, w.reshape(m, k), (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type
    )
  else:
    y = jnp.dot(x_nk, w.reshape(k, m), preferred_element_type=preferred_element_type)
  return y.reshape(*lead, *out_shape)
