"""Gradient-only entry point of the learner: several objectives' gradients from one batch without an update.

For a batch of N rows and M loss configs, every objective's gradient is the vector-Jacobian product of the
teacher-forced log-probs logp(theta) [N, L] with that objective's per-token coefficients dL/dlogp: one forward and
one VJP of logp per batch, the M cotangents vmapped through it, instead of M copies of the update (issue 38, part 1,
Tier B). The loss is the learner's own (`minpro_jax.rl.learner.call_policy_loss`, i.e. `policy_loss` on the
whole mini-batch, plus the `kl_coef` k3 term), so each result equals `jax.grad` of the mini-batch loss that
`Learner.update` steps on (tests/test_policy_gradient.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.rl.aggregation import k3
from minpro_jax.rl.learner import Learner, LossConfig, UpdateInputs, call_policy_loss
from minpro_jax.rl.objectives import get_objective, resolve_hparams
from minpro_jax.rl.rollout import RolloutBatch


class PolicyGradients(NamedTuple):
  """grads: the params pytree with a leading [M] axis, f32: dL_m/dtheta of each loss config (the descent direction,
  the sign of `jax.grad`); token_weights: [M, N, L] f32 each objective's per-token weight (`PolicyLossOutput`);
  logp: [N, L] f32 the learner's log-probs of the batch (meaningless off `response_mask`)."""

  grads: Any
  token_weights: jax.Array
  logp: jax.Array


def check_loss_configs(loss_cfgs: Sequence[LossConfig]) -> None:
  """Raises ValueError unless ``loss_cfgs`` is non-empty, shares one temperature and logprob_chunk_size (one
  forward serves all), and has no term that is not a function of logp (entropy, router aux loss, router replay);
  and for a method or hparams that `resolve_hparams` rejects."""
  if not loss_cfgs:
    raise ValueError("loss_cfgs is empty; pass at least one LossConfig")
  first = loss_cfgs[0]
  for i, lc in enumerate(loss_cfgs):
    resolve_hparams(lc.method, lc.hparam_dict)
    for field in ("temperature", "logprob_chunk_size"):
      if getattr(lc, field) != getattr(first, field):
        raise ValueError(
            f"loss_cfgs[{i}].{field} = {getattr(lc, field)!r} differs from loss_cfgs[0]'s {getattr(first, field)!r}; "
            "one forward serves every config: give them the same value"
        )
    for field in ("entropy_coef", "router_aux_coef"):
      if getattr(lc, field):
        raise ValueError(
            f"loss_cfgs[{i}].{field} = {getattr(lc, field)!r}: that term is not a function of the token log-probs; "
            "set it to 0 for gradient estimates"
        )
    if lc.router_replay:
      raise ValueError(f"loss_cfgs[{i}].router_replay: not supported by the gradient-only entry point; set False")


def coefficients(loss_cfg: LossConfig, logp: jax.Array, batch: UpdateInputs) -> tuple[jax.Array, jax.Array]:
  """(dL/dlogp [N, L], token weights [N, L]) of ``loss_cfg``'s mini-batch loss at log-probs ``logp`` [N, L] f32.

  The loss is the learner's: `policy_loss` over the whole mini-batch (an objective's ``prepare`` inputs from the
  whole batch, as `Learner.update` computes them), plus ``kl_coef`` times the token-mean k3 against
  ``behavior_logp``."""
  mask = batch.response_mask
  prepared = {}
  objective = get_objective(loss_cfg.method)
  if objective.prepare is not None:
    prepared = objective.prepare(
        jax.lax.stop_gradient(logp) - batch.behavior_logp,
        batch.advantages,
        mask,
        resolve_hparams(loss_cfg.method, loss_cfg.hparam_dict),
    )
  denom = jnp.maximum(call_policy_loss(loss_cfg, jnp.zeros(mask.shape, jnp.float32), batch, prepared).denominator, 1.0)
  num_tokens = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)

  def loss(lp):
    out = call_policy_loss(loss_cfg, lp, batch, prepared)
    total = out.loss_sum / denom
    if loss_cfg.kl_coef:
      delta = jnp.clip(jnp.where(mask, batch.behavior_logp - lp, 0.0), -20.0, 20.0)
      total = total + loss_cfg.kl_coef * jnp.sum(k3(delta) * mask) / num_tokens
    return total, out.token_weights.astype(jnp.float32)

  return jax.grad(loss, has_aux=True)(logp)


def make_gradient_fn(graphdef, loss_cfgs: Sequence[LossConfig]):
  """The jitted ``(params, UpdateInputs) -> PolicyGradients`` of ``loss_cfgs`` for the model ``graphdef``.

  The whole batch is one forward and one VJP (no micro-batches: memory grows with N x L). Raises ValueError as
  `check_loss_configs`."""
  loss_cfgs = tuple(loss_cfgs)
  check_loss_configs(loss_cfgs)
  lc0 = loss_cfgs[0]

  def fn(params, batch: UpdateInputs) -> PolicyGradients:
    if batch.advantages.ndim != 1:
      raise ValueError("gradient estimates take unpacked rows (advantages [N]); pass a RolloutBatch, not packed rows")

    def logp_of(p):
      return token_logprobs(
          nnx.merge(graphdef, p, copy=True),
          batch.tokens,
          batch.segment_ids,
          batch.positions,
          temperature=lc0.temperature,
          chunk_size=lc0.logprob_chunk_size,
          kept_logp_threshold_bt=batch.kept_logp_threshold,
      ).logp

    logp, vjp = jax.vjp(logp_of, params)
    cw = [coefficients(lc, logp, batch) for lc in loss_cfgs]
    (grads,) = jax.vmap(vjp)(jnp.stack([c for c, _ in cw]))
    return PolicyGradients(grads, jnp.stack([w for _, w in cw]), logp)

  return jax.jit(fn)


def policy_gradients(learner: Learner, params, batch: RolloutBatch, loss_cfgs: Sequence[LossConfig]):
  """Each of ``loss_cfgs``' gradient dL/dtheta on ``batch`` at ``params`` (`PolicyGradients`), with the learner's
  model; compiles on each call (keep `make_gradient_fn`'s function to reuse it)."""
  return make_gradient_fn(learner.graphdef, loss_cfgs)(params, UpdateInputs.of(batch))


def flatten(grads) -> jax.Array:
  """[M, D] f32: the leaves of a `PolicyGradients.grads` pytree (leading axis M) flattened and concatenated."""
  return jnp.concatenate([x.reshape(x.shape[0], -1).astype(jnp.float32) for x in jax.tree.leaves(grads)], axis=1)
