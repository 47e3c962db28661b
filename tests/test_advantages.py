"""group_advantages: case B07 (zero-variance groups, ddof, leave-one-out) and id-keyed grouping under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.rl.advantages import group_advantages

jit_adv = jax.jit(group_advantages, static_argnames=("mode", "std_ddof", "eps"))


@pytest.mark.parametrize("value", [0.1, 0.35, 1.0 / 3.0])
@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_b07a_all_equal_group_is_exactly_zero(value, mode):
  rewards = jnp.full((7,), value, jnp.float32)
  adv = jit_adv(rewards, jnp.zeros((7,), jnp.int32), mode=mode)
  np.testing.assert_array_equal(adv, np.zeros(7, np.float32))


@pytest.mark.parametrize(
    "ddof,expected", [(1, [1.5, -0.5, -0.5, -0.5]), (0, [1.732051, -0.577350, -0.577350, -0.577350])]
)
def test_b07b_ddof_convention(ddof, expected):
  adv = jit_adv(jnp.array([1.0, 0, 0, 0]), jnp.array([3, 3, 3, 3]), std_ddof=ddof)
  np.testing.assert_allclose(adv, expected, rtol=1e-5)


def test_b07c_rloo_singleton_outlier():
  rewards = jnp.array([0.35] * 7 + [0.0], jnp.float32)
  adv = jit_adv(rewards, jnp.zeros((8,), jnp.int32), mode="rloo")
  np.testing.assert_allclose(adv[7], -0.35, rtol=1e-5)
  np.testing.assert_allclose(adv[:7], 0.35 / 7, rtol=1e-4)


def test_groups_keyed_by_id_not_position_and_shuffle_invariant():
  rng = np.random.default_rng(0)
  ids = np.repeat(np.array([17, -4, 1000, 5]), [3, 4, 1, 2]).astype(np.int32)
  rewards = rng.integers(0, 2, ids.size).astype(np.float32)
  rewards[:3] = [1, 0, 1]
  for mode in ("grpo", "drgrpo", "rloo"):
    adv = np.asarray(jit_adv(jnp.asarray(rewards), jnp.asarray(ids), mode=mode))
    perm = rng.permutation(ids.size)
    adv_p = np.asarray(jit_adv(jnp.asarray(rewards[perm]), jnp.asarray(ids[perm]), mode=mode))
    np.testing.assert_allclose(adv_p, adv[perm], rtol=1e-6, atol=1e-7)
    # naive per-group reference
    for g in np.unique(ids):
      r = rewards[ids == g].astype(np.float64)
      n = r.size
      if n == 1:
        ref = r / (1 + 1e-6) if mode == "grpo" else r
      elif np.all(r == r[0]):
        ref = np.zeros(n)
      elif mode == "grpo":
        ref = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
      elif mode == "drgrpo":
        ref = r - r.mean()
      else:
        ref = r - (r.sum() - r) / (n - 1)
      np.testing.assert_allclose(adv[ids == g], ref, rtol=1e-5, atol=1e-6)


def test_singleton_group_follows_verl():
  adv = jit_adv(jnp.array([0.7, 1.0, 0.0]), jnp.array([9, 1, 1]))
  np.testing.assert_allclose(adv[0], 0.7 / (1 + 1e-6), rtol=1e-7)
  np.testing.assert_allclose(adv[1:], [0.707106, -0.707106], rtol=1e-5)


def test_errors():
  with pytest.raises(ValueError, match=r"mode 'ppo'.*grpo, drgrpo, rloo"):
    group_advantages(jnp.zeros(3), jnp.zeros(3, jnp.int32), mode="ppo")
  with pytest.raises(ValueError, match="group_ids must be integers"):
    group_advantages(jnp.zeros(3), jnp.zeros(3))
  with pytest.raises(ValueError, match=r"\[N\]"):
    group_advantages(jnp.zeros(3), jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match="std_ddof"):
    group_advantages(jnp.zeros(3), jnp.zeros(3, jnp.int32), std_ddof=2)
