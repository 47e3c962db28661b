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
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class GapCheck(NamedTuple):
  """Result of one Step-2 acceptance test.

  t_post: float, the T_post statistic (in advantage units: a mean of ratio x advantage).
  accepted: bool, t_post >= -gap_tolerance (a non-finite t_post is rejected).
  reward_mean: float, mean reward of the validation samples.
  num_samples: int, validation responses scored.
  """

  t_post: float
  accepted: bool
  reward_mean: float
  num_samples: int


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
