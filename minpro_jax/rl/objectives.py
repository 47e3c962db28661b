"""Policy objectives: MinPRO and the GRPO / GSPO / CISPO / M2PO / DPPO / CPPO / decoupled-PPO baselines, as pure
functions, and their registry.

Public surface::

    policy_loss(method, logp, behavior_logp, advantages, response_mask, *, segment_ids=None, **hparams)
        -> PolicyLossOutput(loss, loss_sum, denominator, metrics, token_weights)
    OBJECTIVES: dict[str, Objective]; get_objective(name) -> Objective
    register_objective(name, *, defaults, prepare=None)   # decorator over a token-loss function
    resolve_hparams(method, hparams) -> dict              # COMMON_DEFAULTS + the method's defaults + hparams
    prefix_log_factor(log_ratio, response_mask, statistic="min", segment_ids=None) -> [B, T] f32
    compute_m2po_mask(log_ratio, advantages, response_mask, m2_threshold=0.04) -> [B, T] bool
    aggregate_loss, mismatch_metrics, inference_gap_t_post (from minpro_jax.rl.aggregation)

A method is an `Objective`: a per-token loss over `TokenLossInputs`, its own hparams with their defaults, and
optionally a `prepare` step that needs the whole mini-batch before it is split into micro-batches (M2PO's
keep-mask). `policy_loss` does everything the methods share: input checks and sanitising, rollout correction
(TIS/MIS), aggregation into (loss_sum, denominator), and the common metrics.

Formulas: the MinPRO paper (arXiv 2601.22718) and the baselines cited per method; worked vectors V1-V7
(tests/CASES.md) are checked in tests/test_objectives.py. Conventions:
  * ``logp`` / ``behavior_logp``: [B, T] log-probs of the sampled tokens under pi_theta and the behaviour
    policy mu that generated them; l_t = logp_t - behavior_logp_t is computed in float32.
  * Masked positions may hold NaN/inf garbage: every input is passed through ``jnp.where(valid, x, 0)``
    before any arithmetic, so values, metrics and gradients at valid positions are bit-identical to a
    clean run and gradients at masked positions are exactly 0.
  * No exp of an unclipped log-ratio: weights are clipped in log space before exp; ratios that carry a
    gradient use l clamped to +-20 (verl) (GSPO: log s clamped to at most 10, as verl).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Mapping, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from minpro_jax.rl.aggregation import (
    LOG_RATIO_CLAMP,
    LOSS_AGG_MODES,
    aggregate_loss,
    check_choice,
    inference_gap_t_post,
    masked_mean,
    mismatch_metrics,
    rollout_correction,
)
from minpro_jax.rl.masks import binary_tv_mask, compute_m2po_mask, cppo_mask, negative_veto_mask, token_advantages
from minpro_jax.rl.prefix import PREFIX_STATISTICS, prefix_log_factor
from minpro_jax.rl.proximal import PROXIMAL_SOURCES
from minpro_jax.rl.segments import check_bt, seq_sum, valid_and_starts

__all__ = [
    "PolicyLossOutput",
    "TokenLossInputs",
    "Objective",
    "OBJECTIVES",
    "register_objective",
    "get_objective",
    "resolve_hparams",
    "policy_loss",
    "prefix_log_factor",
    "compute_m2po_mask",
    "aggregate_loss",
    "mismatch_metrics",
    "inference_gap_t_post",
    "COMMON_DEFAULTS",
    "PREFIX_STATISTICS",
    "LOSS_AGG_MODES",
]

GSPO_LOG_RATIO_MAX = 10.0  # verl compute_policy_loss_gspo clamps log s at max=10.

COMMON_DEFAULTS: dict[str, Any] = {
    "loss_agg_mode": "token-mean",
    "max_response_length": None,
    "rollout_logp": None,
    "rollout_is": None,
    "tis_cap": 2.0,
    "rollout_mis": None,
    "rollout_mis_bounds": (0.5, 2.0),
    "negative_veto": None,
}
SURROGATES = ("reinforce", "ppo")


# ------------------------------------------------------------------------------------------------- registry
class TokenLossInputs(NamedTuple):
  """What `policy_loss` hands a method's token loss (all [B, T], masked positions already exact zeros).

  method: the registered name being evaluated (for error messages).
  logp: f32 log-probs under pi_theta (carries the gradient).
  log_ratio: f32 l = logp - sg(behavior_logp), 0 at masked positions.
  behavior_logp: f32 sg(behavior_logp), 0 at masked positions.
  adv: f32 per-token advantages (stop-gradient), 0 at masked positions.
  valid: bool, response tokens that enter the loss (response_mask, and segment id != 0 when packed).
  starts: bool segment-start flags, or None when every row is one sequence (``segment_ids=None``).
  segment_ids: the int packed-row segment ids passed to `policy_loss`, or None.
  """

  method: str
  logp: jax.Array
  log_ratio: jax.Array
  adv: jax.Array
  valid: jax.Array
  starts: jax.Array | None
  segment_ids: jax.Array | None
  behavior_logp: jax.Array


TokenLoss = Callable[[TokenLossInputs, dict[str, Any]], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Objective:
  """One registered policy objective.

  Attributes:
    name: the method name (`LossConfig.method`, `policy_loss`'s first argument).
    token_loss: ``(inputs: TokenLossInputs, hparams: dict) -> (loss [B, T], weights [B, T], metrics)``: the
      per-token loss (before rollout correction and aggregation), the detached per-token weight reported as
      `PolicyLossOutput.token_weights`, and a dict of scalar metrics. ``hparams`` holds every key of
      `COMMON_DEFAULTS` and `defaults`, resolved.
    defaults: the method's own hparams and their defaults (read-only).
    prepare: None, or ``(log_ratio [M, T] f32 (stop-gradient), advantages [M], response_mask [M, T], hparams)
      -> {hparam name: [M, T] array}``: inputs computed once over the WHOLE mini-batch before it is split
      into micro-batches; the learner passes each micro-batch its rows of these arrays as extra hparams.
  """

  name: str
  token_loss: TokenLoss
  defaults: Mapping[str, Any]
  prepare: Callable[..., dict[str, jax.Array]] | None = None


OBJECTIVES: dict[str, Objective] = {}


def register_objective(
    name: str, *, defaults: Mapping[str, Any], prepare: Callable[..., dict[str, jax.Array]] | None = None
) -> Callable[[TokenLoss], TokenLoss]:
  """Decorator: registers the decorated token-loss function as objective ``name`` in `OBJECTIVES`.

  ``defaults`` may also override a `COMMON_DEFAULTS` entry for this method (GSPO's ``loss_agg_mode``).
  Returns the function unchanged.

  Raises:
    ValueError: ``name`` is already registered.
  """
  if name in OBJECTIVES:
    raise ValueError(f"objective {name!r} is already registered; registered: {', '.join(OBJECTIVES)}")
  defaults = dict(defaults)

  def deco(fn: TokenLoss) -> TokenLoss:
    OBJECTIVES[name] = Objective(name, fn, types.MappingProxyType(defaults), prepare)
    return fn

  return deco


def get_objective(name: str) -> Objective:
  """The registered `Objective` called ``name``. Raises ValueError naming it and listing the registered ones."""
  check_choice("method", name, tuple(OBJECTIVES))
  return OBJECTIVES[name]


def resolve_hparams(method: str, hparams: Mapping[str, Any]) -> dict[str, Any]:
  """``COMMON_DEFAULTS``, then ``method``'s defaults, then ``hparams``.

  Raises:
    ValueError: unknown method, or hparams that are neither common nor the method's (listing the valid ones).
  """
  allowed = {**COMMON_DEFAULTS, **get_objective(method).defaults}
  unknown = sorted(set(hparams) - set(allowed))
  if unknown:
    raise ValueError(f"Unknown hparam(s) {unknown} for method {method!r}; valid: {', '.join(sorted(allowed))}.")
  return {**allowed, **hparams}


# ------------------------------------------------------------------------------------------------- helpers
@flax.struct.dataclass
class PolicyLossOutput:
  """Result of :func:`policy_loss` (a pytree: safe to return from ``jax.jit`` / ``jax.value_and_grad(has_aux)``).

  Attributes:
    loss: scalar f32, ``loss_sum / max(denominator, 1)``.
    loss_sum: scalar f32, un-normalised sum (accumulate over micro-batches).
    denominator: scalar f32, tokens (token-mean), sequences (seq-mean-*), or sequences * max length
      (seq-mean-token-sum-norm). Full-batch loss = sum(loss_sum) / sum(denominator).
    metrics: dict of f32 scalars (see :func:`policy_loss`).
    token_weights: [B, T] f32 detached per-token weight (0 at masked positions): minpro/cispo the
      clipped weight w_t; grpo/m2po the ratio rho_t (m2po, dppo, cppo: times the keep-mask; dppo: rho capped);
      gspo the sequence ratio s_i; decoupled_ppo min(pi_prox/mu, C) x pi_theta/pi_prox. Rollout correction (TIS
      weight, MIS mask) and the negative veto are multiplied in.
  """

  loss: jax.Array
  loss_sum: jax.Array
  denominator: jax.Array
  metrics: dict[str, jax.Array]
  token_weights: jax.Array


def _bounds(eps_low, eps_high, name):
  for key, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
    if eps is not None and not (isinstance(eps, (int, float)) and eps >= 0):
      raise ValueError(f"{name}: {key} must be a non-negative float or None, got {eps!r}.")
  if eps_low is not None and eps_low >= 1:
    raise ValueError(f"{name}: eps_low must be < 1 (lower bound 1 - eps_low > 0) or None, got {eps_low!r}.")
  log_lo = -math.inf if eps_low is None else math.log1p(-eps_low)
  log_hi = LOG_RATIO_CLAMP if eps_high is None else math.log1p(eps_high)
  return log_lo, log_hi


def _clipped_ratio(log_ratio, log_lo, log_hi):
  """exp of a log-ratio clipped in log space (no overflow for any finite input)."""
  return jnp.exp(jnp.clip(log_ratio, log_lo, log_hi))


def _ppo_token_loss(log_r, adv, log_lo, log_hi, dual_clip_c=None):
  """Per-token -min(r A, clip(r) A) (optionally dual-clipped for A < 0) and its clip indicators."""
  r = jnp.exp(log_r)
  pg1 = -adv * r
  pg2 = -adv * _clipped_ratio(log_r, log_lo, log_hi)
  loss = jnp.maximum(pg1, pg2)
  clip_high = (adv > 0) & (log_r > log_hi)
  clip_low = (adv < 0) & (log_r < log_lo)
  dual = jnp.zeros_like(clip_high)
  if dual_clip_c is not None:
    if not dual_clip_c > 1:
      raise ValueError(f"dual_clip_c must be > 1 or None, got {dual_clip_c!r}.")
    pg3 = -adv * dual_clip_c
    dual = (adv < 0) & (loss > pg3)
    loss = jnp.where(adv < 0, jnp.minimum(loss, pg3), loss)
  return loss, clip_low, clip_high, dual


def _seq_mean(x, valid, starts):
  count = seq_sum(valid.astype(jnp.float32), starts)
  return seq_sum(jnp.where(valid, x, 0.0), starts) / jnp.maximum(count, 1.0)


# ------------------------------------------------------------------------------------------------- methods
_GSPO_DEFAULTS = {"eps_low": 3e-4, "eps_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}


@register_objective(
    "minpro",
    defaults={
        "eps_low": None,
        "eps_high": 0.28,
        "prefix_statistic": "min",
        "prefix_cap_at_one": False,
        "surrogate": "reinforce",
    },
)
def _minpro(inp: TokenLossInputs, hp):
  """MinPRO (arXiv 2601.22718): -sg(clip(f_t rho_t)) A logp_t, log f_t = exclusive prefix statistic of l."""
  check_choice("surrogate", hp["surrogate"], SURROGATES)
  log_lo, log_hi = _bounds(hp["eps_low"], hp["eps_high"], inp.method)
  lr, adv, valid = inp.log_ratio, inp.adv, inp.valid
  log_f = jax.lax.stop_gradient(prefix_log_factor(lr, valid, hp["prefix_statistic"], inp.segment_ids))
  if hp["prefix_cap_at_one"]:
    log_f = jnp.minimum(log_f, 0.0)
  metrics = {
      "prefix_log_factor_mean": masked_mean(log_f, valid),
      "prefix_factor_mean": masked_mean(jnp.exp(jnp.minimum(log_f, LOG_RATIO_CLAMP)), valid),
  }
  if hp["surrogate"] == "reinforce":
    log_w = jax.lax.stop_gradient(log_f + lr)
    w = _clipped_ratio(log_w, log_lo, log_hi)
    loss = -w * adv * inp.logp
    metrics["clip_frac_low"] = masked_mean((log_w < log_lo).astype(jnp.float32), valid)
    metrics["clip_frac_high"] = masked_mean((log_w > log_hi).astype(jnp.float32), valid)
    return loss, w, metrics
  # "ppo" surrogate (ablation): PPO clipped surrogate on r = sg(f_t) * rho_t.
  log_r = jnp.clip(log_f + lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  lo = math.log1p(-hp["eps_low"]) if hp["eps_low"] is not None else -math.inf
  loss, clip_low, clip_high, _ = _ppo_token_loss(log_r, adv, lo, log_hi)
  metrics["clip_frac_low"] = masked_mean(clip_low.astype(jnp.float32), valid)
  metrics["clip_frac_high"] = masked_mean(clip_high.astype(jnp.float32), valid)
  return loss, jnp.exp(jax.lax.stop_gradient(log_r)), metrics


@register_objective("grpo", defaults={"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": None})
def _grpo(inp: TokenLossInputs, hp):
  """GRPO with DAPO clip-higher, optional verl dual clip."""
  log_lo, log_hi = _bounds(hp["eps_low"], hp["eps_high"], inp.method)
  valid = inp.valid
  log_r = jnp.clip(inp.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  loss, clip_low, clip_high, dual = _ppo_token_loss(log_r, inp.adv, log_lo, log_hi, hp["dual_clip_c"])
  metrics = {
      "clip_frac_low": masked_mean(clip_low.astype(jnp.float32), valid),
      "clip_frac_high": masked_mean(clip_high.astype(jnp.float32), valid),
      "dual_clip_frac": masked_mean(dual.astype(jnp.float32), valid),
  }
  return loss, jnp.exp(jax.lax.stop_gradient(log_r)), metrics


def _gspo_loss(inp: TokenLossInputs, hp, *, token_level: bool):
  """GSPO (arXiv 2507.18071): s_i = exp(mean_t l_{i,t}) per sequence (per segment for packed rows)."""
  log_lo, log_hi = _bounds(hp["eps_low"], hp["eps_high"], inp.method)
  valid, starts = inp.valid, inp.starts
  log_s = _seq_mean(inp.log_ratio, valid, starts)
  if not token_level:
    adv = _seq_mean(inp.adv, valid, starts)  # sequence-level advantage
    log_s = jnp.broadcast_to(log_s, valid.shape)
  else:  # gspo_token: s_{i,t} = sg(s_i) * pi(o_t) / sg(pi(o_t)); same value, per-token gradient.
    adv = inp.adv
    logp = inp.logp
    log_s = jax.lax.stop_gradient(log_s) + logp - jax.lax.stop_gradient(logp)
  log_s = jnp.where(valid, jnp.clip(log_s, -LOG_RATIO_CLAMP, GSPO_LOG_RATIO_MAX), 0.0)
  loss, clip_low, clip_high, _ = _ppo_token_loss(log_s, adv, log_lo, log_hi)
  metrics = {
      "clip_frac_low": masked_mean(clip_low.astype(jnp.float32), valid),
      "clip_frac_high": masked_mean(clip_high.astype(jnp.float32), valid),
  }
  return loss, jnp.exp(jax.lax.stop_gradient(log_s)), metrics


@register_objective("gspo", defaults=_GSPO_DEFAULTS)
def _gspo(inp: TokenLossInputs, hp):
  return _gspo_loss(inp, hp, token_level=False)


@register_objective("gspo_token", defaults=_GSPO_DEFAULTS)
def _gspo_token(inp: TokenLossInputs, hp):
  return _gspo_loss(inp, hp, token_level=True)


@register_objective("cispo", defaults={"eps_low": None, "eps_high": 0.28})
def _cispo(inp: TokenLossInputs, hp):
  """CISPO (MiniMax-M1): MinPRO's REINFORCE form without a prefix factor."""
  return _minpro(inp, {**hp, "prefix_statistic": "none", "prefix_cap_at_one": False, "surrogate": "reinforce"})


def _m2po_prepare(log_ratio, advantages, response_mask, hparams) -> dict[str, jax.Array]:
  """M2PO's keep-mask needs the whole mini-batch's log-ratios."""
  return {"m2po_mask": compute_m2po_mask(log_ratio, advantages, response_mask, hparams["m2_threshold"])}


@register_objective("m2po", defaults={"m2_threshold": 0.04, "m2po_mask": None}, prepare=_m2po_prepare)
def _m2po(inp: TokenLossInputs, hp):
  """M2PO (arXiv 2510.01161): J = (1/N_valid) sum M rho A, no clip, gradient through rho."""
  valid = inp.valid
  mask = hp["m2po_mask"]
  if mask is None:
    mask = compute_m2po_mask(inp.log_ratio, inp.adv, valid, hp["m2_threshold"])
  else:
    check_bt("m2po_mask", mask, valid.shape)
    mask = valid & mask.astype(bool)
  mask = jax.lax.stop_gradient(mask)
  rho = jnp.exp(jnp.clip(inp.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  loss = jnp.where(mask, -rho * inp.adv, 0.0)
  lr = inp.log_ratio
  metrics = {
      "m2po_kept_frac": masked_mean(mask.astype(jnp.float32), valid),
      "m2po_second_moment": masked_mean(lr * lr, valid),
  }
  return loss, jnp.where(mask, jax.lax.stop_gradient(rho), 0.0), metrics


@register_objective("dppo", defaults={"tv_low": 0.15, "tv_high": 0.15, "ratio_cap": 10.0})
def _dppo(inp: TokenLossInputs, hp):
  """DPPO, Binary-TV (arXiv 2602.04879; sail-sg/Stable-RL `compute_policy_loss_with_mask`): -M sg(min(rho, cap)) A logp
  with M the Binary-TV keep-mask (`masks.binary_tv_mask`) against mu. ``ratio_cap`` 10: the authors' code default
  (`clip_ratio_c`); None = no cap (verl's recipe sets 10000)."""
  valid, cap = inp.valid, hp["ratio_cap"]
  if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
    raise ValueError(f"dppo: ratio_cap must be a number > 0 or None, got {cap!r}.")
  keep = jax.lax.stop_gradient(
      binary_tv_mask(jax.lax.stop_gradient(inp.logp), inp.behavior_logp, inp.adv, valid, hp["tv_low"], hp["tv_high"])
  )
  log_max = LOG_RATIO_CLAMP if cap is None else math.log(cap)
  w = jax.lax.stop_gradient(jnp.exp(jnp.minimum(inp.log_ratio, log_max)))
  loss = jnp.where(keep, -w * inp.adv * inp.logp, 0.0)
  metrics = {"tv_masked_frac": masked_mean((valid & ~keep).astype(jnp.float32), valid)}
  return loss, jnp.where(keep, w, 0.0), metrics


@register_objective("cppo", defaults={"tv_delta": 0.2, "tv_position_weight_min": 0.8, "tv_prefix_budget": 0.02})
def _cppo(inp: TokenLossInputs, hp):
  """CPPO, Binary-TV (arXiv 2606.10968; Tencent-Hunyuan/UniRL `_cppo_loss`): -M rho A, the gradient through rho,
  with M the position-weighted cumulative-prefix keep-mask (`masks.cppo_mask`) against mu."""
  valid = inp.valid
  keep = jax.lax.stop_gradient(
      cppo_mask(
          jax.lax.stop_gradient(inp.logp),
          inp.behavior_logp,
          inp.adv,
          valid,
          inp.starts,
          hp["tv_delta"],
          hp["tv_position_weight_min"],
          hp["tv_prefix_budget"],
      )
  )
  rho = jnp.exp(jnp.clip(inp.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  loss = jnp.where(keep, -rho * inp.adv, 0.0)
  metrics = {"tv_masked_frac": masked_mean((valid & ~keep).astype(jnp.float32), valid)}
  return loss, jnp.where(keep, jax.lax.stop_gradient(rho), 0.0), metrics


@register_objective(
    "decoupled_ppo",
    defaults={
        "eps_low": 0.2,
        "eps_high": 0.28,
        "behavior_weight_cap": 2.0,
        "proximal": "score",
        "proximal_logp": None,
        "proximal_alpha": None,
    },
)
def _decoupled_ppo(inp: TokenLossInputs, hp):
  """Decoupled PPO (module `minpro_jax.rl.proximal`): min(pi_prox / mu, C) x -min(r A, clip(r) A), r = pi_theta /
  pi_prox, the behaviour weight detached and truncated as TIS is (C = ``behavior_weight_cap``, 2.0 as verl's
  `rollout_is_threshold`; None = untruncated). pi_prox: ``proximal_logp`` [B, T] (``proximal="score"``) or A-3PO's
  interpolation with the scalar ``proximal_alpha``. Eps defaults are GRPO's, so with pi_prox = mu it is ``grpo``."""
  check_choice("proximal", hp["proximal"], PROXIMAL_SOURCES)
  if hp["rollout_is"] is not None or hp["rollout_mis"] is not None:
    raise ValueError(
        "decoupled_ppo weights each token by its truncated behaviour ratio pi_prox / mu already; rollout_is / "
        "rollout_mis would correct a second time: unset them"
    )
  cap = hp["behavior_weight_cap"]
  if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
    raise ValueError(f"decoupled_ppo: behavior_weight_cap must be a number > 0 or None, got {cap!r}.")
  log_lo, log_hi = _bounds(hp["eps_low"], hp["eps_high"], inp.method)
  valid, lr = inp.valid, inp.log_ratio
  if hp["proximal"] == "score":
    if hp["proximal_logp"] is None:
      raise ValueError("decoupled_ppo with proximal='score' needs proximal_logp ([B, T] log-probs of pi_prox).")
    check_bt("proximal_logp", hp["proximal_logp"], valid.shape)
    prox = jax.lax.stop_gradient(jnp.where(valid, hp["proximal_logp"], 0.0).astype(jnp.float32))
    log_w, log_r = prox - inp.behavior_logp, inp.logp - prox
  else:
    if hp["proximal_alpha"] is None:
      raise ValueError("decoupled_ppo with proximal='interpolate' needs proximal_alpha (A-3PO's scalar weight).")
    alpha = jax.lax.stop_gradient(jnp.asarray(hp["proximal_alpha"], jnp.float32))
    log_w, log_r = alpha * jax.lax.stop_gradient(lr), lr - alpha * jax.lax.stop_gradient(lr)
  log_w = jnp.where(valid, jnp.clip(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
  log_r = jnp.where(valid, jnp.clip(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
  log_cap = LOG_RATIO_CLAMP if cap is None else math.log(cap)
  w = jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_w, log_cap)))
  loss, clip_low, clip_high, _ = _ppo_token_loss(log_r, inp.adv, log_lo, log_hi)
  metrics = {
      "clip_frac_low": masked_mean(clip_low.astype(jnp.float32), valid),
      "clip_frac_high": masked_mean(clip_high.astype(jnp.float32), valid),
      "behavior_weight_mean": masked_mean(w, valid),
      "behavior_weight_clip_frac": masked_mean((log_w > log_cap).astype(jnp.float32), valid),
      "proximal_log_ratio_mean": masked_mean(log_w, valid),
  }
  return w * loss, w * jnp.exp(jax.lax.stop_gradient(log_r)), metrics


# ------------------------------------------------------------------------------------------------- entry point
def policy_loss(
    method: str,
    logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    **hparams,
) -> PolicyLossOutput:
  """Policy-gradient loss of one (micro-)batch for the registered objective ``method`` (see `OBJECTIVES`).

  Per-token losses of the built-ins (l = logp - behavior_logp, A the token advantage, sg = stop_gradient):
    * ``minpro`` (arXiv 2601.22718): -sg(clip(f_t rho_t)) A logp_t with log f_t = ``prefix_log_factor``
      (``prefix_statistic`` min|mean|geomean|prod|none), clipped in log space to
      [log(1-eps_low), log(1+eps_high)] (eps_low None = no lower bound). ``prefix_cap_at_one`` uses
      min(f, 1). ``surrogate="ppo"``: -min(r A, clip(r) A) with r = sg(f_t) rho_t (ablation).
    * ``grpo`` (DAPO clip-higher): -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); with ``dual_clip_c``
      c, for A < 0 the loss is min(that, -c A) (verl dual clip; off by default).
    * ``gspo``: PPO clip on the sequence ratio s = exp(mean_t l) with the sequence advantage (token mean of A);
      ``gspo_token``: s_{i,t} = sg(s_i) rho_t / sg(rho_t) with token advantages. Default
      ``loss_agg_mode="seq-mean-token-mean"`` (verl forces it). Packed rows: per segment.
    * ``cispo`` (MiniMax-M1): -sg(clip(rho, 1-eps_low, 1+eps_high)) A logp.
    * ``m2po``: -M rho A with the mask of :func:`compute_m2po_mask`, denominator = all valid tokens.
      The mask needs the whole mini-batch: call with the full mini-batch, or compute ``m2po_mask`` once
      on it (the objective's ``prepare``) and pass the slice to each micro-batch call.
    * ``dppo`` (arXiv 2602.04879): -M sg(min(rho, ratio_cap)) A logp, M the Binary-TV mask (``tv_low``/``tv_high``).
    * ``cppo`` (arXiv 2606.10968): -M rho A, M the position-weighted cumulative-prefix Binary-TV mask.
    * ``decoupled_ppo``: min(pi_prox/mu, behavior_weight_cap) x -min(r A, clip(r) A), r = pi_theta/pi_prox, pi_prox
      from ``proximal_logp`` (``proximal="score"``) or A-3PO's interpolation (``proximal_alpha``).
  Common hparams: ``loss_agg_mode`` (``LOSS_AGG_MODES``), ``max_response_length``; rollout correction
  ``rollout_logp`` [B, T], ``rollout_is`` None|token|sequence, ``tis_cap`` (2.0), ``rollout_mis``
  None|token|sequence|geometric, ``rollout_mis_bounds`` ((0.5, 2.0)); see
  ``minpro_jax.rl.aggregation.rollout_correction`` (MIS-rejected tokens still count in the denominator);
  ``negative_veto`` None | c > 1: mu-GRPO's negative-advantage veto (`masks.negative_veto_mask`: a response with
  A < 0 loses its loss from the first token with rho > c on; vetoed tokens still count in the denominator).

  Args:
    method: a name in ``OBJECTIVES``.
    logp, behavior_logp: [B, T] float log-probs (computed in fp32 here).
    advantages: [B] or [B, T] float ([B, T] required with ``segment_ids``).
    response_mask: [B, T] bool/0-1.
    segment_ids: optional [B, T] int32 packed-row segment ids (0 = padding).
    **hparams: the method's hparams (``get_objective(method).defaults``) and ``COMMON_DEFAULTS``.

  Returns:
    PolicyLossOutput. Metrics (f32 scalars, over valid tokens): ``ratio_mean/min/max`` of rho,
    ``log_ratio_mean``, ``weight_mean`` (mean of token_weights), ``num_tokens`` (valid tokens),
    method-specific ``clip_frac_low/high``, ``dual_clip_frac``, ``prefix_factor_mean``,
    ``prefix_log_factor_mean``, ``m2po_kept_frac``, ``m2po_second_moment``, ``tis_weight_mean``,
    ``tis_clip_frac``, ``mis_kept_frac``, ``negative_veto_frac``, ``tv_masked_frac`` (dppo, cppo),
    ``behavior_weight_mean``, ``behavior_weight_clip_frac``, ``proximal_log_ratio_mean`` (decoupled_ppo).

  Raises:
    ValueError: unknown method / hparam / statistic / agg mode (listing the valid choices), bad shapes
      or dtypes, invalid hparam values.
  """
  hp = resolve_hparams(method, hparams)
  objective = OBJECTIVES[method]
  check_bt("logp", logp)
  check_bt("behavior_logp", behavior_logp, logp.shape)
  check_bt("response_mask", response_mask, logp.shape)
  if segment_ids is not None and advantages.ndim == 1:
    raise ValueError("With segment_ids (packed rows) pass advantages as [B, T] (one value per token).")
  valid, starts = valid_and_starts(response_mask, segment_ids)
  # Sanitise before any arithmetic (where-NaN-gradient trap): masked positions become exact zeros.
  logp_s = jnp.where(valid, logp, 0.0).astype(jnp.float32)
  blogp_s = jax.lax.stop_gradient(jnp.where(valid, behavior_logp, 0.0).astype(jnp.float32))
  log_ratio = jnp.where(valid, logp_s - blogp_s, 0.0)
  adv = jax.lax.stop_gradient(token_advantages(advantages, valid))
  inputs = TokenLossInputs(
      method=method,
      logp=logp_s,
      log_ratio=log_ratio,
      adv=adv,
      valid=valid,
      starts=starts,
      segment_ids=segment_ids,
      behavior_logp=blogp_s,
  )

  loss_bt, weights, metrics = objective.token_loss(inputs, hp)
  rc_weight, rc_keep, rc_metrics = rollout_correction(
      blogp_s,
      hp["rollout_logp"],
      valid,
      starts,
      rollout_is=hp["rollout_is"],
      tis_cap=hp["tis_cap"],
      rollout_mis=hp["rollout_mis"],
      rollout_mis_bounds=hp["rollout_mis_bounds"],
  )
  if hp["negative_veto"] is not None:  # mu-GRPO: a negative response loses its suffix from the trigger on
    kept = jax.lax.stop_gradient(negative_veto_mask(log_ratio, adv, valid, starts, hp["negative_veto"]))
    metrics = {**metrics, "negative_veto_frac": masked_mean((valid & ~kept).astype(jnp.float32), valid)}
    rc_keep = rc_keep & kept
  loss_bt = jnp.where(rc_keep, loss_bt * rc_weight, 0.0)
  weights = jnp.where(rc_keep, jax.lax.stop_gradient(weights) * rc_weight, 0.0)
  loss_sum, denominator = aggregate_loss(
      loss_bt, valid, hp["loss_agg_mode"], segment_ids=segment_ids, max_response_length=hp["max_response_length"]
  )

  ratio = jax.lax.stop_gradient(jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
  any_valid = jnp.any(valid)
  metrics = {
      **metrics,
      **rc_metrics,
      "ratio_mean": masked_mean(ratio, valid),
      "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid, ratio, jnp.inf)), 0.0),
      "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid, ratio, -jnp.inf)), 0.0),
      "log_ratio_mean": jax.lax.stop_gradient(masked_mean(log_ratio, valid)),
      "weight_mean": masked_mean(weights, valid),
      "num_tokens": jnp.sum(valid).astype(jnp.float32),
  }
  metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
  loss = loss_sum / jnp.maximum(denominator, 1.0)
  return PolicyLossOutput(loss=loss, loss_sum=loss_sum, denominator=denominator, metrics=metrics, token_weights=weights)
