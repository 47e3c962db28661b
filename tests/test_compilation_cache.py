"""The suite's persistent compilation cache (tests/conftest.py): a learner-like program (log-probs of the tiny model
and their gradient) loaded from the cache by a second process gives bit-identical results to the fresh compile of a
first process, because it is the same executable."""

import json
import os
import subprocess
import sys

import pytest
from train_helpers import REPO

_PROGRAM = r"""
import hashlib, json
import jax, jax.numpy as jnp, numpy as np
from jax import monitoring

jax.config.update("jax_default_matmul_precision", "highest")
hits = []
monitoring.register_event_listener(lambda event, **kw: hits.append(event))
from flax import nnx
from minpro_jax.models import get_preset, init_model, token_logprobs

model = init_model(get_preset("tiny"), seed=0)
graphdef, params = nnx.split(model)
rng = np.random.RandomState(0)
tokens = jnp.asarray(rng.randint(0, 512, (4, 24)), jnp.int32)
seg = jnp.asarray(np.arange(24)[None, :] >= np.array([[0], [3], [7], [0]]), jnp.int32)

@jax.jit
def step(params, tokens, seg):
  def loss(params):
    logp = token_logprobs(nnx.merge(graphdef, params), tokens, seg, chunk_size=8).logp
    return -jnp.sum(logp * seg), logp
  return jax.value_and_grad(loss, has_aux=True)(params)

before = hits.count("/jax/compilation_cache/cache_hits")
(value, logp), grads = step(params, tokens, seg)
digest = hashlib.sha256()
for leaf in [value, logp, *jax.tree.leaves(grads)]:
  digest.update(np.asarray(leaf).tobytes())
print("RESULT " + json.dumps({"hits": hits.count("/jax/compilation_cache/cache_hits") - before,
                              "digest": digest.hexdigest(), "loss": float(value)}))
"""


def _run(cache_dir):
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
  return json.loads(line[len("RESULT ") :]), r.stderr


def test_a_cached_program_gives_the_results_of_a_fresh_compile(tmp_path):
  fresh, _ = _run(tmp_path)
  assert fresh["hits"] == 0 and fresh["loss"] > 0  # an empty cache: compiled afresh
  assert any(name.startswith("jit_step-") for name in os.listdir(tmp_path))  # ... and written to the cache
  cached, err = _run(tmp_path)
  if cached["hits"] == 0 and "Error reading persistent compilation cache entry" in err:
    pytest.skip(f"XLA rejects this CPU's own cached executables (jax-ml/jax#38445): {err.strip()[-300:]}")
  assert cached["hits"] == 1  # the step, loaded from the cache
  assert cached["digest"] == fresh["digest"]  # loss, log-probs and every gradient leaf: bit for bit
