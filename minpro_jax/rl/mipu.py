"""MIPU Step 2 (arXiv 2606.29526): keep an update only if it survives the sync to the inference policy.

After the updates of a global step turn theta_k into theta', the sampler (at its own precision, e.g. simulated
fp8: the inference policy mu') samples validation prompts, the learner scores the same tokens at theta'
(the training policy pi'), and

    T_post = -mean_i( rho_i * A_i ),   rho_i = exp( mean_t log pi'(y_t) / mu'(y_t) )

(`minpro_jax.rl.aggregation.inference_gap_t_post`). The update is accepted iff T_post >= -gap_tolerance; otherwise the
parameters, the optimizer state and the update counters go back to the snapshot taken before the updates,
and the consumed batch is dropped. T_post estimates the post-update inference gap J(mu') - J(pi') (with
group-centred advantages, J(pi) - J(mu) = E_mu[(pi/mu) A]): it is negative when the trainer policy puts more
weight on well-rewarded answers than the deployed sampler does, i.e. when the improvement did not survive
quantisation. Step 1 (truncated IS against the sampler) is
`config.loss.rollout_is = "token"` with `tis_cap = 2`.

Assumptions where the paper's project page is silent:
  * validation prompts are fresh draws from the training problems (never the held-out evaluation sets), a
    pure function of (seed, global step) so a resumed run makes the same decisions;
  * the validation advantages use the run's `advantage_mode` (group-normalised, as the training batch);
  * a rollback restores the optimizer state too, and the rejected batch is not re-used.

Also here: T_post's standard error over validation groups, the random-rollback ablation (`mode="random"`: roll back
with probability p, a pure function of seed and step, p set or matched to a reference run) and the ground-truth
check of T_post (`ground_truth_agreement`: the sign agreement and correlation of T_post with a directly sampled
J(mu') - J(pi')).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("gap", "random")  # the T_post test (the paper's Step 2) | rollback at random (its ablation)
# mode=gap's statistic: the paper's T_post at theta' | T(theta') - T(theta_k), paired | J(mu') - J(mu_k), paired
STATISTICS = ("t_post", "delta_t", "delta_j")
TOLERANCES = ("fixed", "calibrated")  # c = mipu.gap_tolerance | c from draws of T at the starting weights
_RANDOM_SALT = 0x4D495055  # "MIPU": keeps the rollback draws apart from every other draw of (seed, step)


class GapCheck(NamedTuple):
  """Result of one Step-2 acceptance test.

  t_post: float, the T_post statistic (in advantage units: a mean of ratio x advantage).
  t_post_se: float, its standard error over validation groups (`t_post_standard_error`).
  accepted: bool, t_post >= -gap_tolerance (a non-finite t_post is rejected).
  reward_mean: float, mean reward of the validation samples (J(mu') estimated).
  num_samples: int, validation responses scored.
  statistic: float, the value tested against -c (`config.mipu.statistic`: t_post, delta_t or delta_j).
  t_before, delta_t, delta_t_se, delta_j, delta_j_se: with a paired statistic (delta_t, delta_j; else nan): T at
    theta_k on the same prompts and seed, T_post - t_before and J(mu') - J(mu_k) with their paired standard errors
    (`paired_difference`).
  """

  t_post: float
  t_post_se: float
  accepted: bool
  reward_mean: float
  num_samples: int
  statistic: float = math.nan
  t_before: float = math.nan
  delta_t: float = math.nan
  delta_t_se: float = math.nan
  delta_j: float = math.nan
  delta_j_se: float = math.nan


def t_post_standard_error(terms: np.ndarray, has: np.ndarray, group_ids: np.ndarray) -> float:
  """Standard error of T_post = sum(terms) / sum(has), with the validation groups as the sampling units.

  The responses of one prompt share its advantage normalisation, so groups (not responses) are independent: the
  cluster (linearised ratio-estimator) variance G / (G - 1) * sum_g (S_g - T n_g)^2 / (sum_g n_g)^2, S_g and n_g
  the group's sum of terms and count of responses with tokens. With equal group sizes this is the standard
  deviation of the group means (ddof 1) over sqrt(G).

  Args:
    terms: [B] float, `aggregation.inference_gap_terms`' first output.
    has: [B] bool, its second output.
    group_ids: [B] int, the prompt group of each response.

  Returns nan with fewer than 2 groups holding a response. Raises ValueError on mismatched shapes.
  """
  terms, has, group_ids = np.asarray(terms, np.float64), np.asarray(has, bool), np.asarray(group_ids)
  if not terms.shape == has.shape == group_ids.shape or terms.ndim != 1:
    raise ValueError(f"terms, has, group_ids must be [B] arrays; got {terms.shape}, {has.shape}, {group_ids.shape}")
  _, g = np.unique(group_ids[has], return_inverse=True)
  if g.size == 0 or g.max() < 1:
    return math.nan
  s_g = np.bincount(g, weights=terms[has])
  n_g = np.bincount(g).astype(np.float64)
  t = s_g.sum() / n_g.sum()
  num_groups = len(s_g)
  return float(math.sqrt(num_groups / (num_groups - 1) * np.sum((s_g - t * n_g) ** 2)) / n_g.sum())


def paired_difference(
    terms_new: np.ndarray, has_new: np.ndarray, terms_old: np.ndarray, has_old: np.ndarray, group_ids: np.ndarray
) -> tuple[float, float]:
  """D = T_new - T_old of two ratio means T = sum(terms[has]) / sum(has) over the same rows, and D's paired
  standard error with the validation groups as the units.

  The two draws share their prompts and sampler keys row by row (the sampler keys each row and position, so at
  equal weights they are the same tokens), so their difference is far less noisy than either. The linearised
  (delta-method) contribution of group g is u_g = (S'_g - T' n'_g) / N' - (S_g - T n_g) / N (S_g the group's sum
  of terms, n_g its rows with tokens, N the total), and SE(D) = sqrt(G / (G - 1) * sum_g u_g^2): for one draw alone
  this is `t_post_standard_error`; with every row present, the standard deviation (ddof 1) of the per-group
  differences of means over sqrt(G). `delta_t` passes `inference_gap_terms` of both draws, `delta_j` the rewards
  (with `has` all True).

  Args:
    terms_new, has_new: [B] float, [B] bool of the draw at the new weights.
    terms_old, has_old: the same rows at the old weights.
    group_ids: [B] int, the prompt group of each row (the same in both draws).

  Returns (D, SE): SE is nan with fewer than 2 groups; D is nan when either draw has no row. Raises ValueError on
  mismatched shapes.
  """
  arrays = [np.asarray(a) for a in (terms_new, has_new, terms_old, has_old, group_ids)]
  if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
    raise ValueError(
        f"terms_new, has_new, terms_old, has_old, group_ids must be [B] arrays; got {[a.shape for a in arrays]}"
    )
  t_new, h_new, t_old, h_old = (np.asarray(a, np.float64) for a in arrays[:4])
  _, g = np.unique(arrays[4], return_inverse=True)
  if not h_new.sum() or not h_old.sum():
    return math.nan, math.nan
  num_groups = int(g.max()) + 1
  infl = np.zeros(num_groups)
  mean = {}
  for sign, t, h in ((1.0, t_new, h_new), (-1.0, t_old, h_old)):
    s_g = np.bincount(g, weights=t * h, minlength=num_groups)
    n_g = np.bincount(g, weights=h, minlength=num_groups)
    mean[sign] = s_g.sum() / n_g.sum()
    infl += sign * (s_g - mean[sign] * n_g) / n_g.sum()
  diff = float(mean[1.0] - mean[-1.0])
  if num_groups < 2:
    return diff, math.nan
  return diff, float(math.sqrt(num_groups / (num_groups - 1) * np.sum(infl**2)))


def calibrated_tolerance(t_start: Sequence[float], z: float) -> float:
  """`mipu.tolerance="calibrated"`'s c from T at the starting weights over several validation draws: the test then
  accepts T_post >= mean - z * sd (sd with ddof 1), i.e. c = z * sd - mean. The standing training-inference gap
  (mean < 0 with an fp8 sampler, docs/mipu.md) no longer rejects by itself; an update must lower the gap by more
  than z draws' standard deviations to be rolled back.

  Raises:
    ValueError: fewer than 2 finite values, or z is not finite.
  """
  t = np.asarray(t_start, np.float64)
  if t.ndim != 1 or t.size < 2 or not np.isfinite(t).all() or not math.isfinite(z):
    raise ValueError(f"calibration needs >= 2 finite T values and a finite z; got {t.tolist()} and z={z}")
  return float(z * t.std(ddof=1) - t.mean())


def random_rollback(seed: int, step: int, rate: float) -> bool:
  """The random-rollback ablation's decision at global `step`: True (roll back) with probability `rate`, a pure
  function of (seed, step), so a resumed run decides the same. Raises ValueError unless 0 <= rate <= 1."""
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"config.mipu.random_rate must lie in [0, 1], got {rate}")
  return bool(np.random.default_rng([seed, step, _RANDOM_SALT]).random() < rate)


def reference_rollback_rate(path: str) -> float:
  """The measured rollback rate (rollbacks / checks) of a finished run: `path` is its workdir or its summary.json.

  Raises:
    ValueError: no summary.json there, or it records no MIPU check.
  """
  p = pathlib.Path(path)
  p = p / "summary.json" if p.is_dir() else p
  if not p.is_file():
    raise ValueError(f"config.mipu.match_rate_of={path!r}: no summary.json there; give a finished run's workdir")
  m = json.loads(p.read_text()).get("mipu", {})
  if not m.get("checks"):
    raise ValueError(f"config.mipu.match_rate_of={path!r}: that run made no MIPU check (mipu.rollback was off)")
  return m["rollbacks"] / m["checks"]


def ground_truth_agreement(t_post: Sequence[float], j_gap: Sequence[float]) -> dict[str, Any]:
  """How well T_post tracks the post-update gap it estimates, over a run's checks.

  Args:
    t_post: the checks' T_post values.
    j_gap: the same checks' J(mu') - J(pi'), measured by sampling the validation prompts from both policies.

  Returns {"checks", "sign_agreement" (fraction of checks whose signs agree, a zero agreeing only with a zero),
  "pearson_r" (None below 3 checks or when either series is constant)}.
  """
  t, j = np.asarray(t_post, np.float64), np.asarray(j_gap, np.float64)
  if t.shape != j.shape:
    raise ValueError(f"t_post and j_gap differ in length: {t.shape} vs {j.shape}")
  out: dict[str, Any] = {"checks": int(t.size), "sign_agreement": None, "pearson_r": None}
  if t.size:
    out["sign_agreement"] = float(np.mean(np.sign(t) == np.sign(j)))
  if t.size >= 3 and t.std() > 0 and j.std() > 0:
    out["pearson_r"] = float(np.corrcoef(t, j)[0, 1])
  return out


def accept_update(t_post: float, gap_tolerance: float) -> bool:
  """MIPU's acceptance rule: True iff `t_post >= -gap_tolerance` and `t_post` is finite.

  Args:
    t_post: the post-update inference-gap statistic (`inference_gap_t_post`).
    gap_tolerance: c >= 0 loosens the test, c < 0 tightens it (the paper sweeps 0 and +-1e-4).

  Raises:
    ValueError: `gap_tolerance` is NaN.
  """
  if math.isnan(gap_tolerance):
    raise ValueError("gap_tolerance is NaN; set config.mipu.gap_tolerance to a number such as 1e-4")
  return bool(math.isfinite(t_post) and t_post >= -gap_tolerance)


def validation_indices(num_problems: int, num_prompts: int, seed: int) -> np.ndarray:
  """`num_prompts` distinct indices into the training problems, drawn from `seed` (one draw per global step).

  Raises:
    ValueError: `num_prompts` is not in [1, num_problems].
  """
  if not 1 <= num_prompts <= num_problems:
    raise ValueError(
        f"config.mipu.val_prompts={num_prompts} must lie in [1, {num_problems}] (the training "
        "problems it draws from)"
    )
  return np.sort(np.random.default_rng(seed).choice(num_problems, size=num_prompts, replace=False))


def snapshot(state: Any) -> Any:
  """A copy of a pytree of arrays that outlives donation of the original (the learner donates its state).

  Costs one extra parameter + optimizer-state buffer while the test runs; shardings are kept.
  """
  return jax.tree.map(jnp.copy, state)
