"""The proximal policy of decoupled PPO: where pi_prox comes from, and A-3PO's interpolation.

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL's decoupled loss; verl's
rollout-correction decoupled mode) keeps three policies: the behaviour policy mu that sampled the tokens, a
proximal policy pi_prox that the trust region is centred on, and the current pi_theta. Here pi_prox is the policy
at the first update of the global step that learns from the batch (`loss.proximal`):

  * ``"score"``: its log-probs from a forward pass over the released batch with the parameters before the step's
    first update (`Learner.score`; the extra pass runs only for this setting, `LossConfig.reads_proximal_logp`);
  * ``"interpolate"``: A-3PO (arXiv 2512.06547; AReaL `prox_logp_method="loglinear"`, docs/algorithms/prox_approx.md)
    approximates it without a forward pass by interpolating between the behaviour and the current log-probs by
    policy version:

        alpha = (v_prox - v_mu) / (v_theta - v_mu),     log pi_prox = log mu + alpha (sg(log pi_theta) - log mu)

    with v_mu the version that sampled the tokens, v_prox the version at the step's first update and v_theta the
    version of the update being taken; alpha = 0 (pi_prox = mu) when v_theta = v_mu, where all three are the same
    policy. So log(pi_prox / mu) = alpha sg(l) and log(pi_theta / pi_prox) = l - alpha sg(l), l = log pi_theta - log mu.
"""

from __future__ import annotations

import numpy as np

PROXIMAL_SOURCES = ("score", "interpolate")


def interpolation_alpha(policy_version: np.ndarray, proximal_version: int, current_version: int) -> np.float32:
  """A-3PO's alpha for an update of the mini-batch sampled by `policy_version` (module docstring).

  Args:
    policy_version: [M] int versions that sampled the mini-batch's rows; they must all be equal (the trainer's
      batches are sampled by one version each: `RolloutBatch.policy_version`).
    proximal_version: the version at the first update of the step (v_prox).
    current_version: the version of the update being taken (v_theta >= v_prox >= v_mu).

  Returns:
    float32 alpha in [0, 1].

  Raises:
    ValueError: the rows were sampled by different versions, or the versions are out of order.
  """
  versions = np.unique(np.asarray(policy_version, np.int64))
  if versions.size != 1:
    raise ValueError(
        f"loss.proximal='interpolate' needs one sampling version per mini-batch (A-3PO interpolates by version), "
        f"got versions {versions.tolist()}; use loss.proximal='score'"
    )
  behavior = int(versions[0])
  if not behavior <= proximal_version <= current_version:
    raise ValueError(
        f"policy versions out of order: sampled at {behavior}, proximal {proximal_version}, current {current_version}"
    )
  if current_version == behavior:
    return np.float32(0.0)
  return np.float32((proximal_version - behavior) / (current_version - behavior))
