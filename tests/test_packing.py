"""Packed learner rows (minpro_jax/rl/packing.py): first-fit decreasing against a hand-computed case, the packer
against a naive loop, and a packed update equal to the unpacked one (loss, gradient, parameters after a step, the
metrics) for every objective, with TIS / MIS and with MoE router replay; the score pass unpacked back to the batch's
layout; the config check of `learner.row_tokens`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_learner import _batch, _model
from train_helpers import coin_grade, make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.models.moe import NO_ROUTE
from minpro_jax.rl import packing
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.run.run_config import validate_config, validate_shapes_config


# ------------------------------------------------------------------------------------------------- the packer
def test_first_fit_decreasing_hand_case():
  # W = 10; longest first: 9 -> row 0; 7 -> row 1; 5 -> row 2; 4 -> row 2 @5; 3 -> row 1 @7; 2 -> row 3
  row, offset, rows = packing.first_fit_decreasing([3, 5, 2, 7, 4, 9], 10)
  assert rows == 4
  np.testing.assert_array_equal(row, [1, 2, 3, 1, 2, 0])
  np.testing.assert_array_equal(offset, [7, 0, 0, 0, 5, 0])


def test_an_oversize_sample_gets_a_row_of_its_own():
  row, offset, rows = packing.first_fit_decreasing([12, 2, 3], 10)
  assert rows == 2 and row[0] == 0 and offset[0] == 0
  np.testing.assert_array_equal(row[1:], [1, 1])  # nothing joins the oversize row
  p = packing.plan(np.ones((3, 12), np.int32) * (np.arange(12) < np.array([[12], [2], [3]])), 10, 1)
  assert p.width == 12 and p.used_rows == 2


def _naive_pack(batch, row_tokens):
  """Packed rows by a plain loop: FFD over the samples' real tokens, segment ids by order in the row."""
  seg = batch.segment_ids
  lengths = [int((s != 0).sum()) for s in seg]
  rows: list[list[int]] = []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    for r in rows:
      if sum(lengths[j] for j in r) + lengths[i] <= row_tokens:
        r.append(i)
        break
    else:
      rows.append([i])
  out = {f: np.zeros((len(rows), row_tokens), getattr(batch, f).dtype) for f in packing.SCORE_FIELDS}
  out["advantages"] = np.zeros((len(rows), row_tokens), np.float32)
  out["response_mask"] = np.zeros((len(rows), row_tokens), bool)
  for r, members in enumerate(rows):
    col = 0
    for k, i in enumerate(members):
      for t in np.flatnonzero(seg[i]):
        out["tokens"][r, col] = batch.tokens[i, t]
        out["positions"][r, col] = batch.positions[i, t]
        out["response_mask"][r, col] = batch.response_mask[i, t]
        out["segment_ids"][r, col] = k + 1
        out["advantages"][r, col] = batch.advantages[i]
        col += 1
  return out


@pytest.fixture(scope="module")
def model_and_batch():
  model = _model()
  return model, _batch(model, n=8, length=12)


@pytest.mark.parametrize("row_tokens,mb", [(12, 2), (20, 4), (40, 1)])
def test_pack_matches_a_naive_loop_and_unpacks_back(model_and_batch, row_tokens, mb):
  _, batch = model_and_batch
  p = packing.plan(batch.segment_ids, row_tokens, mb)
  rows = packing.pack(batch, p)
  naive = _naive_pack(batch, row_tokens)
  k = len(naive["tokens"])
  assert p.used_rows == k and p.num_rows % mb == 0 and k <= p.num_rows <= batch.size
  assert p.num_rows <= max(mb, -(-2 * batch.size * 12 // row_tokens) + mb)  # the first-fit bound
  for f, want in naive.items():
    np.testing.assert_array_equal(rows[f][:k], want, err_msg=f)
    assert not rows[f][k:].any(), f  # the rows past K are padding
  for f in ("tokens", "positions", "behavior_logp", "learner_logp", "response_mask"):
    back = packing.unpack(rows[f], p, batch.tokens.shape)
    np.testing.assert_array_equal(back, np.where(batch.segment_ids != 0, getattr(batch, f), 0), err_msg=f)


def test_chunk_plans_pack_each_chunk_as_its_own_plan_in_one_shape(model_and_batch):
  """`plan_chunks` / `pack_chunks`: chunk c's rows are `pack` of chunk c alone (the mini-batch an update packs), all
  chunks of one width (the batch's longest sample) and row count; `unpack_chunks` puts every token back."""
  _, batch = model_and_batch
  plans = packing.plan_chunks(batch.segment_ids, 4, 8, 2)
  longest = int((batch.segment_ids != 0).sum(1).max())
  assert longest > 8 and [(p.num_rows, p.width) for p in plans] == [plans[0][:2]] * 2 and plans[0].width == longest
  rows = packing.pack_chunks(batch, plans)
  r = plans[0].num_rows
  for c in range(2):
    alone = packing.plan(batch.segment_ids[4 * c : 4 * c + 4], 8, 2, width=longest)
    want = packing.pack(batch.select(slice(4 * c, 4 * c + 4)), alone)
    for f, v in want.items():
      np.testing.assert_array_equal(rows[f][c * r : c * r + alone.num_rows], v, err_msg=f)
      assert not rows[f][c * r + alone.num_rows : (c + 1) * r].any(), f
  back = packing.unpack_chunks(rows["tokens"], plans, batch.tokens.shape)
  np.testing.assert_array_equal(back, np.where(batch.segment_ids != 0, batch.tokens, 0))
  with pytest.raises(ValueError, match="8 samples do not split into chunks of 3"):
    packing.plan_chunks(batch.segment_ids, 3, 8, 2)


def test_pad_fraction_counts_the_micro_batches_run():
  seg = np.array([[1, 1, 2, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
  assert packing.pad_fraction(seg, 2) == pytest.approx(1 - 4 / 8)  # the second micro-batch is skipped
  assert packing.pad_fraction(seg, 4) == pytest.approx(1 - 4 / 16)


# ------------------------------------------------------------------------------------------------- learner parity
def _sgd_step(model, loss_cfg, batch, mb, row_tokens):
  """(-gradient, metrics, parameters) of one update as the learner computes it, optimizer replaced by SGD(1)."""
  learner = Learner(model, loss_cfg, OptimizerConfig(max_grad_norm=0.0), micro_batch_size=mb, row_tokens=row_tokens)
  learner.optimizer = optax.sgd(1.0)
  params = nnx.split(model)[1]
  before = jax.tree.map(np.asarray, params)
  state, metrics = learner.update(learner.init_state(jax.tree.map(jnp.array, params)), batch)
  delta = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, state.params, before)
  return delta, metrics, state.params


def _assert_same_update(unpacked, packed, what):
  (d0, m0, p0), (d1, m1, p1) = unpacked, packed
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(d0)) > 1e-3, "gradient ~0: a vacuous comparison"
  for a, b in zip(jax.tree.leaves(d0), jax.tree.leaves(d1)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=what)
  for k, v in m0.items():
    if k != "pad_fraction":
      np.testing.assert_allclose(np.asarray(m1[k], np.float64), np.asarray(v, np.float64), rtol=1e-5, atol=1e-6,
                                 err_msg=f"{what}: {k}")  # fmt: skip
  assert m1["pad_fraction"] < m0["pad_fraction"], what


PARITY = [
    ("minpro", ()),
    ("grpo", ()),
    ("gspo", ()),
    ("cispo", ()),
    ("m2po", ()),
    ("minpro", (("rollout_is", "token"),)),
    ("grpo", (("rollout_is", "sequence"), ("rollout_mis", "geometric"))),
]


@pytest.mark.parametrize("method,hparams", PARITY, ids=lambda x: str(x))
def test_packed_update_equals_unpacked(model_and_batch, method, hparams):
  model, batch = model_and_batch
  cfg = LossConfig(method=method, hparams=hparams)
  unpacked = _sgd_step(model, cfg, batch, 2, None)
  packed = _sgd_step(model, cfg, batch, 2, 20)  # 8 samples of <= 12 tokens in ~4 rows: 2 of 4 micro-batches run
  _assert_same_update(unpacked, packed, f"{method} {hparams}")


@pytest.mark.slow  # the SGD steps above check the parameters after a step; this, AdamW's moments too
def test_packed_adamw_step_equals_unpacked(model_and_batch):
  model, batch = model_and_batch
  cfg = LossConfig(method="minpro")
  params = nnx.split(model)[1]
  out = []
  for row_tokens in (None, 24):
    learner = Learner(model, cfg, OptimizerConfig(learning_rate=1e-3), micro_batch_size=4, row_tokens=row_tokens)
    state = learner.init_state(jax.tree.map(jnp.array, params))
    for _ in range(2):
      state, _ = learner.update(state, batch)
    out.append(state)
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_packed_score_equals_unpacked(model_and_batch):
  model, batch = model_and_batch
  params = nnx.split(model)[1]
  cfg = LossConfig(method="minpro")
  want = Learner(model, cfg, OptimizerConfig(), micro_batch_size=4).score(params, batch)
  got = Learner(model, cfg, OptimizerConfig(), micro_batch_size=4, row_tokens=16).score(params, batch)
  resp = batch.response_mask
  np.testing.assert_allclose(got[resp], want[resp], rtol=1e-5, atol=1e-6)
  assert not got[batch.segment_ids == 0].any()
  chunked = Learner(model, cfg, OptimizerConfig(), micro_batch_size=2, row_tokens=16)  # each mini-batch packed alone
  got = chunked.score(params, batch, chunk_rows=4)
  np.testing.assert_allclose(got[resp], want[resp], rtol=1e-5, atol=1e-6)


def test_packed_truncated_sampling_keeps_its_kept_sets(model_and_batch):
  """The sampler's kept-set thresholds (top-k / top-p, docs/truncation.md) travel through the packer: packed score
  and update equal unpacked ones, and differ from the full-vocabulary ones."""
  model, batch = model_and_batch
  thr = np.where(batch.response_mask, np.float32(-4.0), np.float32(0.0)).astype(np.float32)
  truncated = batch.replace(kept_logp_threshold=thr)
  params = nnx.split(model)[1]
  cfg = LossConfig(method="minpro")
  want = Learner(model, cfg, OptimizerConfig(), micro_batch_size=4).score(params, truncated)
  got = Learner(model, cfg, OptimizerConfig(), micro_batch_size=4, row_tokens=16).score(params, truncated)
  full = Learner(model, cfg, OptimizerConfig(), micro_batch_size=4).score(params, batch)
  resp = batch.response_mask
  np.testing.assert_allclose(got[resp], want[resp], rtol=1e-5, atol=1e-6)
  assert float(np.abs(want[resp] - full[resp]).max()) > 1e-2  # the kept sets matter here
  _assert_same_update(_sgd_step(model, cfg, truncated, 2, None), _sgd_step(model, cfg, truncated, 2, 20), "top-p")


def test_packed_update_with_router_replay_equals_unpacked():
  model = _model(preset="tiny-moe")
  batch = _batch(model, n=8, length=12, seed=1)
  rng = np.random.default_rng(0)
  routes = rng.integers(0, 8, (*batch.tokens.shape, 1, 2)).astype(np.int16)
  routes = np.where(batch.response_mask[..., None, None], routes, NO_ROUTE).astype(np.int16)
  batch = batch.replace(routes=routes)
  cfg = LossConfig(method="minpro", router_replay=True)
  _assert_same_update(_sgd_step(model, cfg, batch, 2, None), _sgd_step(model, cfg, batch, 2, 20), "replay")
  params = nnx.split(model)[1]
  learners = [Learner(model, cfg, OptimizerConfig(), micro_batch_size=4, row_tokens=w) for w in (None, 16)]
  (lp0, r0), (lp1, r1) = (learner.score(params, batch, return_routes=True) for learner in learners)
  resp = batch.response_mask
  np.testing.assert_allclose(lp1[resp], lp0[resp], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.sort(r1[resp], -1), np.sort(r0[resp], -1))


def test_learner_refuses_a_norm_mode_without_max_response_length(model_and_batch):
  model, _ = model_and_batch
  cfg = LossConfig(method="grpo", hparams=(("loss_agg_mode", "seq-mean-token-sum-norm"),))
  with pytest.raises(ValueError, match="row_tokens.*max_response_length"):
    Learner(model, cfg, OptimizerConfig(), micro_batch_size=2, row_tokens=32)


# ------------------------------------------------------------------------------------------------- config
def test_row_tokens_below_the_longest_sample_is_a_config_error(tmp_path):
  c = make_config(tiny_overrides(tmp_path))
  longest = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  c.learner.row_tokens = longest - 1
  with pytest.raises(ConfigError, match=rf"config\.learner\.row_tokens: .* >= {longest}"):
    validate_config(c)
  c.learner.row_tokens = longest
  validate_config(c)
  mini_batch = c.prompts_per_step * c.group_size // c.num_updates_per_step
  c.learner.row_tokens = mini_batch * longest + 1  # the compile-only tool's checks refuse it too
  with pytest.raises(ConfigError, match=rf"config\.learner\.row_tokens: .* at most {mini_batch * longest}"):
    validate_shapes_config(c)
  c.learner.row_tokens = mini_batch * longest
  validate_shapes_config(c)
  c.micro_batch_size = mini_batch  # one micro-batch holds every packed row: nothing to skip, said at start
  assert packing.micro_batch_warning(c).startswith(f"learner.row_tokens={mini_batch * longest} with micro_batch_size=")
  c.micro_batch_size = mini_batch // 2
  assert packing.micro_batch_warning(c) is None
  c.learner.row_tokens = 0
  c.micro_batch_size = mini_batch
  assert packing.micro_batch_warning(c) is None


# ------------------------------------------------------------------------------------------------- trainer
def _close(a, b) -> bool:
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
  if a is None or b is None or isinstance(a, (str, bool)):
    return a == b
  return bool(np.isclose(float(a), float(b), rtol=1e-5, atol=1e-6))


def test_a_packed_trainer_step_equals_the_unpacked_one(tmp_path, monkeypatch):
  """The trainer's steps 0-1 (sample, grade, score, one step of updates) with `learner.row_tokens` and without, on
  one trainer (the sampler compiled once): the same metrics, the padding fraction no higher packed."""
  from test_mismatch_every import _steps

  from minpro_jax.run.trainer import Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  ov = tiny_overrides(tmp_path, delay=1, **{"sft.enabled": False, "learner.row_tokens": 38})
  trainer = Trainer.from_config(make_config(ov))
  packed_learner = trainer.learner
  assert packed_learner.row_tokens == 38
  params, loader_state = nnx.split(trainer.model)[1], trainer.loader.get_state()
  _, packed, _ = _steps(trainer, params, loader_state, every=1, num_steps=2)
  trainer.learner = Learner(
      trainer.model, packed_learner.loss_cfg, packed_learner.opt_cfg, micro_batch_size=2, mesh=trainer.mesh
  )
  _, unpacked, _ = _steps(trainer, params, loader_state, every=1, num_steps=2)
  trainer.close()
  assert unpacked[1]["learn/loss"] != 0  # a real update is compared
  # the tiny prompts' bucket leaves rows of ~19 tokens: two samples per packed row of 38, the same slots run
  assert packed[1]["learn/pad_fraction"] <= unpacked[1]["learn/pad_fraction"]
  for step, (p, u) in enumerate(zip(packed, unpacked)):
    assert set(p) == set(u), step
    differ = [k for k in u if k != "learn/pad_fraction" and not _close(p[k], u[k])]
    assert not differ, (step, {k: (p[k], u[k]) for k in differ})


def test_a_packed_update_on_a_mesh_equals_the_unpacked_one_on_one_device(model_and_batch):
  """The packed rows split over data x fsdp (8 CPU devices) and the skipped micro-batches (`jax.lax.cond`) under
  GSPMD: two updates equal the unpacked ones on one device."""
  from minpro_jax.runtime.sharding import make_mesh, use_mesh

  model1, batch = model_and_batch
  mesh = make_mesh({"data": 2, "fsdp": 4})
  cfg, opt = LossConfig(method="minpro"), OptimizerConfig(learning_rate=1e-2)
  l1 = Learner(model1, cfg, opt, micro_batch_size=4)
  s1 = l1.init_state(jax.tree.map(jnp.array, nnx.split(model1)[1]))
  model8 = _model(mesh)
  leaves8, treedef8 = jax.tree.flatten(nnx.split(model8)[1])
  p8 = jax.tree.unflatten(
      treedef8, [jax.device_put(np.asarray(a), b.sharding) for a, b in zip(jax.tree.leaves(s1.params), leaves8)]
  )
  l8 = Learner(model8, cfg, opt, micro_batch_size=4, mesh=mesh, row_tokens=20)
  s8 = l8.init_state(p8)
  for _ in range(2):
    s1, m1 = l1.update(s1, batch)
    with use_mesh(mesh):
      s8, m8 = l8.update(s8, batch)
  assert int(s8.step) == 2 and m8["pad_fraction"] < m1["pad_fraction"]
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5, atol=1e-6)
