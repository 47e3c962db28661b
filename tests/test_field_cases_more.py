"""Field cases B31, B32, B34 and B38 (tests/CASES.md) through the project's real API: the stop token's log-prob,
DAPO's capped overlong penalty, resume past partial checkpoints, and HF export of every tensor and expert."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.data.rewards import math_reward, overlong_penalty
from minpro_jax.errors import CheckpointError
from minpro_jax.models import get_preset, init_model
from minpro_jax.models.hf_io import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from minpro_jax.rl.objectives import policy_loss
from minpro_jax.run.checkpoint import RunCheckpointer
from minpro_jax.sampling import SamplingParams
from minpro_jax.sampling.loop import decode_loop, init_loop_state, sample_step


# ------------------------------------------------------------------------------------------------ B31
def test_b31_the_stop_token_has_its_logprob_and_gets_a_gradient():
  """Scripted 4-token vocabulary, EOS = 3; step distributions P1, P2, P3 whose most likely tokens are 0, 1, 3."""
  probs = jnp.array([[0.5, 0.3, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.2, 0.1, 0.1, 0.6]])
  sp = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(3,))
  logits = lambda step: jnp.log(probs[jnp.minimum(step, 2)])[None]  # noqa: E731
  st = init_loop_state(jax.random.split(jax.random.key(0), 1), jnp.ones(1, bool), 5, jnp.zeros(()), pad_id=0)
  st = decode_loop(lambda c, t, s: (logits(s), c), sample_step(st, logits(0), sp), sp)
  mask = np.asarray(st.mask[0])
  tokens, b = np.asarray(st.tokens[0])[mask], np.asarray(st.logp[0])[mask]
  np.testing.assert_array_equal(tokens, [0, 1, 3])
  np.testing.assert_allclose(b, [-0.693147, -0.356675, -0.510826], atol=1e-6)  # the stop token's own log-prob
  assert len(b) == len(tokens) == 3 and abs(b.sum() - -1.560648) < 1e-5
  # the learner at identical parameters: ratio 1 everywhere, and the stop token is in the loss with a gradient
  lp, m = jnp.asarray(b)[None], jnp.ones((1, 3), bool)
  out = policy_loss("grpo", lp, lp, jnp.array([1.0]), m)
  assert float(out.metrics["ratio_min"]) == float(out.metrics["ratio_max"]) == 1.0
  g = jax.grad(lambda x: policy_loss("grpo", x, lp, jnp.array([1.0]), m).loss)(lp)
  assert float(g[0, 2]) != 0.0


# ------------------------------------------------------------------------------------------------ B32
@pytest.mark.parametrize(
    "length,penalty", [(14, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (21, -1.0), (23, -1.0)]
)
def test_b32_overlong_penalty_is_capped(length, penalty):
  assert overlong_penalty(length, max_length=20, buffer=5, factor=1.0) == pytest.approx(penalty, abs=1e-12)


def test_b32_a_correct_long_answer_and_a_truncated_one_without_answer():
  correct = math_reward(r"so \boxed{7}", "7", mode="integer")
  assert correct + overlong_penalty(18, 20, 5) == pytest.approx(0.4)
  # truncated responses keep the grader's score of their text (plus the penalty): without a final answer it is <= 0
  no_answer = math_reward("the sum is 3 + 4 = 7 and", "7", mode="integer", truncated=True, last_number=True)
  assert no_answer + overlong_penalty(20, 20, 5) <= 0
  with pytest.raises(ValueError, match="buffer"):
    overlong_penalty(5, 20, 0)


# ------------------------------------------------------------------------------------------------ B34
def _state(v: float):
  return {"w": jnp.full((4,), v, jnp.float32), "step": jnp.asarray(int(v), jnp.int32)}


def _meta(step):
  return {"global_step": step}


def test_b34_resume_skips_partial_checkpoints_and_leftover_tmp_dirs(tmp_path):
  ck = RunCheckpointer(str(tmp_path), keep=5)
  buf = {"steps": np.zeros((0,), np.int64), "batches": {}}
  for s in (10, 20):
    ck.save(s, _state(s), buf, _meta(s))
  ckdir = tmp_path / "checkpoints"
  shutil.copytree(ckdir / "20", ckdir / "30")  # step 30: "params" written, the rest missing
  shutil.rmtree(ckdir / "30" / "buffer")
  os.remove(next(p for p in (ckdir / "30").rglob("*") if p.is_file() and "meta" in str(p)))
  (ckdir / "40.orbax-checkpoint-tmp-0").mkdir()  # a save that never finished
  ck.close()
  ck = RunCheckpointer(str(tmp_path), keep=5)
  step, state, _, meta = ck.restore_latest(_state(0))
  assert step == 20 and meta["global_step"] == 20 and float(state["w"][0]) == 20.0
  assert not (ckdir / "30").exists() and os.listdir(tmp_path / "checkpoints_unreadable")  # set aside, not loaded
  ck.save(30, _state(30), buf, _meta(30))  # saving step 30 again works
  assert 30 in ck._mngr.all_steps()
  # a complete checkpoint copied to another directory stays restorable
  other = tmp_path / "copy"
  shutil.copytree(ckdir / "20", other / "checkpoints" / "20")
  assert RunCheckpointer(str(other), keep=5).restore_latest(_state(0))[0] == 20
  # only partial checkpoints: a clear error, nothing moved
  only = tmp_path / "only"
  shutil.copytree(ckdir / "20", only / "checkpoints" / "20")
  shutil.rmtree(only / "checkpoints" / "20" / "state")
  with pytest.raises(CheckpointError, match="no run checkpoint .* reads back"):
    RunCheckpointer(str(only), keep=5).restore_latest(_state(0))
  assert (only / "checkpoints" / "20").exists()


# ------------------------------------------------------------------------------------------------ B38
@pytest.mark.parametrize(
    "preset,overrides,per_layer,extra",
    [
        ("tiny", {"tie_embeddings": True}, 11, 0),
        ("tiny", {"tie_embeddings": False}, 11, 1),
        ("tiny-moe", {"num_experts": 4, "num_experts_per_tok": 2, "tie_embeddings": True}, 9 + 3 * 4, 0),
        ("tiny-moe", {"num_experts": 4, "num_experts_per_tok": 2, "tie_embeddings": False}, 9 + 3 * 4, 1),
    ],
)
def test_b38_export_writes_every_tensor_and_expert(tmp_path, preset, overrides, per_layer, extra):
  cfg = get_preset(preset, num_layers=2, **overrides)
  model = init_model(cfg, seed=0)
  if cfg.is_moe:  # expert e's weights are the constant e + 1: an export that overwrites experts shows it
    for name in ("gate_proj", "up_proj", "down_proj"):
      p = getattr(model.layers.mlp, name)
      p.set_value(jnp.broadcast_to(jnp.arange(1.0, 5.0)[None, :, None, None], p.get_value().shape))
  names = [n for n, _ in hf_state_dict(model)]
  assert len(names) == len(set(names)) == 2 * per_layer + 2 + extra
  assert sum("q_norm" in n for n in names) == sum("k_norm" in n for n in names) == 2
  if cfg.is_moe:
    for name, arr in hf_state_dict(model):
      if ".experts." in name:
        e = int(name.split(".experts.")[1].split(".")[0])
        assert np.all(arr == e + 1), name
  files = save_hf_checkpoint(model, str(tmp_path / "hf"), max_shard_bytes=20_000)
  assert len(files) > 1
  with open(tmp_path / "hf" / "model.safetensors.index.json") as f:
    weight_map = json.load(f)["weight_map"]
  assert sorted(weight_map) == sorted(names)
  from safetensors import safe_open

  for key, fn in weight_map.items():
    with safe_open(str(tmp_path / "hf" / fn), framework="numpy") as h:
      assert key in h.keys()
  back, _ = load_hf_checkpoint(str(tmp_path / "hf"))
  for a, b in zip(jax.tree.leaves(nnx.split(model)[1]), jax.tree.leaves(nnx.split(back)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # import(export(p)) == p bitwise


def test_b32_the_trainer_adds_the_penalty_to_every_response(tmp_path):
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.run.trainer import Trainer

  # the buffer is the whole budget, so every response of n tokens loses n / 6; the tiny warm start answers wrongly
  ov = tiny_overrides(tmp_path, total_steps=1, delay=0, **{"reward.overlong_buffer": 6})
  tr = Trainer.from_config(make_config(ov))
  batch, metrics = tr.sample_step(tr.learner.init_state(nnx.split(tr.model)[1]), 0)
  graded = np.asarray(batch.rewards) + np.asarray(batch.response_lengths) / 6.0
  assert metrics["reward/mean"] < 0 and set(np.round(graded, 6)) <= {0.0, 1.0}
  tr.close()
