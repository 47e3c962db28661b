"""ParamStore: versions, eviction, clear errors, and no copies."""

import jax.numpy as jnp
import pytest

from minpro_jax.param_store import ParamStore


def test_keep_last_and_latest():
  store = ParamStore(keep_last=2)
  states = {v: {"w": jnp.full((2,), float(v))} for v in range(4)}
  for v, s in states.items():
    store.put(v, s)
  assert store.versions == [2, 3] and store.latest_version == 3 and len(store) == 2
  assert store.get(2) is states[2]  # a reference, not a copy
  assert store.latest()[1]["w"][0] == 3.0 and 1 not in store and 3 in store
  with pytest.raises(KeyError, match=r"policy_version 1 .*held versions: \[2, 3\].*keep_last=2"):
    store.get(1)


def test_shared_buffers_between_versions():
  frozen = jnp.ones((3,))
  store = ParamStore(keep_last=3)
  store.put(0, {"frozen": frozen, "w": jnp.zeros(2)})
  store.put(1, {"frozen": frozen, "w": jnp.ones(2)})
  assert store.get(0)["frozen"] is store.get(1)["frozen"]


def test_bad_input():
  with pytest.raises(ValueError, match="keep_last"):
    ParamStore(keep_last=0)
  store = ParamStore()
  with pytest.raises(LookupError, match="empty"):
    store.latest_version
  with pytest.raises(ValueError, match="version must be an int"):
    store.put(-1, {})
  with pytest.raises(ValueError, match="version must be an int"):
    store.put(1.0, {})
  store.put(5, {})
  with pytest.raises(ValueError, match="not newer than the latest stored version 5"):
    store.put(5, {})
