"""MIPU Step 2 in the trainer (arXiv 2606.29526; the math is `minpro_jax.rl.mipu`): after a global step's updates,
decide whether to keep them, and roll back to the snapshot taken before them when not.

`config.mipu.mode`:
  * "gap" (the paper): sample `val_prompts` x `val_group_size` validation responses with the updated parameters at
    the sampler's precision (mu'), score the same tokens with the learner (pi'), and keep the updates iff
    T_post >= -gap_tolerance. T_post's standard error over the validation groups is logged beside it. With
    `mipu.ground_truth`, the same prompts are also sampled from pi' (a learner-precision sampler, the same seed, so
    the two draws share their randomness) and J(mu') - J(pi') = the difference of the two reward means is logged:
    the quantity T_post estimates, measured directly (possible here because the learner policy can be sampled).
    `mipu.statistic` picks what is tested against -c: `t_post` (the paper), `delta_t` = T(theta') - T(theta_k) or
    `delta_j` = J(mu') - J(mu_k) (the mean validation reward): the paired ones also sample the same prompts with the
    same seed at theta_k (the snapshot) and score them there, so the sampler's per-row, per-position keys couple the
    two draws; T(theta_k), both differences and their paired standard errors are logged. `mipu.tolerance=calibrated`
    sets c once, at the first check, from `calibration_draws` validation draws of T at the weights before its
    updates (`mipu.calibrated_tolerance`); c is kept in the run's progress, so a resumed run keeps it.
  * "random" (the paper's random-rollback ablation): roll back with probability `random_rate`, or the rollback rate
    measured in the finished run `match_rate_of`; the decision is a pure function of (seed, step) and nothing is
    sampled.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import numpy as np

from minpro_jax.rl import mipu
from minpro_jax.rl.aggregation import inference_gap_terms
from minpro_jax.run import run_config
from minpro_jax.runtime import multihost
from minpro_jax.sampling import Sampler

LEARNER_PRECISION = "fp32"  # the sampler precision whose log-probs are the learner's (rho = 1 at equal weights)


class _Draw(NamedTuple):
  """A validation draw: `batch`, this process's rows of it (a `RolloutBatch`: every row in one process); the [B]
  per-row statistics of every process's rows: `terms` and `has` (`inference_gap_terms`), `rewards`, `group_ids`;
  and T = sum(terms) / sum(has)."""

  batch: Any
  terms: np.ndarray
  has: np.ndarray
  rewards: np.ndarray
  group_ids: np.ndarray
  t: float


class MipuStep:
  """Step 5 of the trainer's global step (`Trainer` builds one when `config.mipu.rollback` is on).

  Args:
    trainer: the `minpro_jax.run.trainer.Trainer` whose sampler, learner, problems and seeds it uses.

  Raises:
    ValueError: `mode="random"` whose rate cannot be resolved (`mipu.reference_rollback_rate`).
  """

  def __init__(self, trainer):
    self.trainer = trainer
    m = self.cfg = trainer.c.mipu
    self.rate = None
    self.last_batch = None  # the validation batch of the last gap check (for inspection)
    if m.mode == "random":
      self.rate = run_config.random_rollback_rate(trainer.c)
    self.truth_sampler = None
    if m.ground_truth and m.mode == "gap":
      self.truth_sampler = Sampler(trainer.model.config, **{**trainer.sampler_kw, "precision": LEARNER_PRECISION})

  def _own_rows(self, num_prompts: int) -> bool:
    """Whether each process samples, grades and scores only its rows of a validation draw (whole groups): in a
    multi-process run whose process count divides `num_prompts`."""
    n = jax.process_count()
    return n > 1 and num_prompts % n == 0

  def _draw(self, state, problems, seed: int) -> _Draw:
    """The validation draw of `problems` at `state.params` (sampler precision), scored by the learner there. In
    several processes each holds its rows (`_own_rows`) and the [B] per-row statistics are all-gathered (one
    [B, 4] table), so T and its standard errors are those of one process."""
    tr, m = self.trainer, self.cfg
    own = self._own_rows(len(problems))
    gen = tr.generate(
        state.params, problems, tr.sampling, seed, m.val_group_size, policy_version=int(state.step), own_rows=own
    )
    batch, _, _ = tr.rollout(state, gen, problems, m.val_group_size)
    terms, has = inference_gap_terms(batch.learner_logp, batch.behavior_logp, batch.advantages, batch.response_mask)
    per_row = np.stack([np.asarray(terms), np.asarray(has), batch.rewards, batch.group_ids], 1).astype(np.float64)
    if own:
      per_row = multihost.gather_rows(per_row, len(problems) * m.val_group_size)
    terms, has = per_row[:, 0].astype(np.float32), per_row[:, 1].astype(bool)
    rewards, group_ids = per_row[:, 2].astype(np.float32), per_row[:, 3].astype(np.int64)
    return _Draw(batch, terms, has, rewards, group_ids, float(terms.sum() / max(has.sum(), 1)))

  def calibrate(self, state) -> float:
    """`mipu.tolerance=calibrated`'s c from `calibration_draws` validation draws of T at `state.params`."""
    tr, m = self.trainer, self.cfg
    t = []
    for d in range(m.calibration_draws):
      idx = mipu.validation_indices(len(tr.train_problems), m.val_prompts, tr.step_seed(d, 5))
      t.append(self._draw(state, [tr.train_problems[i] for i in idx], tr.step_seed(d, 6)).t)
    return mipu.calibrated_tolerance(t, float(m.calibration_z))

  def check(
      self, state, step: int, before=None, tolerance: float | None = None
  ) -> tuple[mipu.GapCheck, dict[str, Any], Any]:
    """The Step-2 test of `state.params` (just updated; read only) against `-tolerance` (default
    `mipu.gap_tolerance`). `before`, the state at theta_k (read only), is needed by the paired statistics. Returns
    the check, its metrics and the validation batch (a `RolloutBatch`: the sampler's mu' and the learner's pi'
    log-probs of its tokens; this process's rows of it in a multi-process run).

    Raises:
      ValueError: a paired `mipu.statistic` without `before`.
    """
    tr, m = self.trainer, self.cfg
    tolerance = float(m.gap_tolerance) if tolerance is None else tolerance
    idx = mipu.validation_indices(len(tr.train_problems), m.val_prompts, tr.step_seed(step, 3))
    problems = [tr.train_problems[i] for i in idx]
    seed = tr.step_seed(step, 4)
    new = self._draw(state, problems, seed)
    paired = {}
    if m.statistic != "t_post":
      if before is None:
        raise ValueError(f"mipu.statistic={m.statistic!r} compares with theta_k: pass its state as `before`")
      old = self._draw(before, problems, seed)  # same prompts and keys: coupled
      d_t, d_t_se = mipu.paired_difference(new.terms, new.has, old.terms, old.has, new.group_ids)
      ones = np.ones(len(new.rewards), bool)
      d_j, d_j_se = mipu.paired_difference(new.rewards, ones, old.rewards, ones, new.group_ids)
      paired = dict(t_before=old.t, delta_t=d_t, delta_t_se=d_t_se, delta_j=d_j, delta_j_se=d_j_se)
    value = {"t_post": new.t, **paired}[m.statistic]
    check = mipu.GapCheck(
        t_post=new.t,
        t_post_se=mipu.t_post_standard_error(new.terms, new.has, new.group_ids),
        accepted=mipu.accept_update(value, tolerance),
        reward_mean=float(new.rewards.mean()),
        num_samples=len(new.rewards),
        statistic=value,
        **paired,
    )
    metrics = {"mipu/t_post": check.t_post, "mipu/t_post_se": check.t_post_se, "mipu/val_reward": check.reward_mean}
    metrics.update({f"mipu/{k}": v for k, v in paired.items()})
    metrics["mipu/tolerance"] = tolerance
    if self.truth_sampler is not None:
      own = self._own_rows(len(problems))
      truth = tr.generate(
          state.params, problems, tr.sampling, seed, m.val_group_size, sampler=self.truth_sampler, own_rows=own
      )
      j_pi = float(tr.grade(truth, problems, m.val_group_size)[1].mean())  # [B] rewards of every process's rows
      metrics.update({"mipu/j_learner": j_pi, "mipu/j_gap": check.reward_mean - j_pi})
    return check, metrics, new.batch

  def __call__(self, state, before, step: int, progress) -> tuple[Any, dict[str, Any]]:
    """Decides on the step's updates; returns the state kept (`before`, the snapshot, on a rollback) and the
    metrics. Counts the check and the rollback in `progress` (a `RunProgress`)."""
    t0 = time.time()
    if self.rate is not None:
      accepted, metrics = not mipu.random_rollback(self.trainer.c.seed, step, self.rate), {}
    else:
      tolerance = None
      if self.cfg.tolerance == "calibrated":
        if progress.mipu_tolerance is None:  # the first check: measured at the weights before its updates
          progress.mipu_tolerance = self.calibrate(before)
        tolerance = progress.mipu_tolerance
      check, metrics, self.last_batch = self.check(state, step, before=before, tolerance=tolerance)
      accepted = check.accepted
      if "mipu/j_gap" in metrics:
        progress.mipu_ground_truth.append([check.t_post, metrics["mipu/j_gap"]])
    progress.mipu_checks += 1
    progress.mipu_rollbacks += int(not accepted)
    metrics.update(
        {
            "mipu/accepted": int(accepted),
            "mipu/rollbacks_total": progress.mipu_rollbacks,
            "time/mipu": time.time() - t0,
        }
    )
    return (state if accepted else before), metrics


def summary(progress) -> dict[str, Any]:
  """The run summary's "mipu" entry: checks, rollbacks, and with ground truth logged, T_post's agreement with it."""
  out: dict[str, Any] = {"checks": progress.mipu_checks, "rollbacks": progress.mipu_rollbacks}
  if progress.mipu_ground_truth:
    t_post, j_gap = zip(*progress.mipu_ground_truth)
    out["ground_truth"] = mipu.ground_truth_agreement(t_post, j_gap)
  return out
