"""Learner: exact micro-batch accumulation, sharded == single device, non-finite guard, optimizer state across a
checkpoint (case B24) and the learning-rate schedule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.rl.aggregation import masked_mean
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.objectives import OBJECTIVES, register_objective
from minpro_jax.rl.optimizer import OptimizerConfig, make_schedule
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.run.checkpoint import RunCheckpointer
from minpro_jax.runtime.sharding import make_mesh, use_mesh

VOCAB = 64
MODEL_KW = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
)


MOE_KW = dict(MODEL_KW, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def _model(mesh=None, preset="tiny", rules=None, **overrides):
  kw = {**(MOE_KW if preset == "tiny-moe" else MODEL_KW), **overrides}
  return init_model(get_preset(preset, **kw), seed=0, mesh=mesh, rules=rules)


def _batch(model, n=8, length=12, seed=0):
  """Rows = left-padded prompt + response of unequal lengths; behavior log-probs = the model's plus noise so ratios
  differ from 1 (clipping and prefix statistics are exercised)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (n, length)).astype(np.int32)
  seg = np.zeros((n, length), np.int32)
  pos = np.zeros((n, length), np.int32)
  mask = np.zeros((n, length), bool)
  for i in range(n):
    pad = int(rng.integers(0, 3))
    prompt = int(rng.integers(2, 4))
    resp = int(rng.integers(1, length - pad - prompt + 1))
    end = pad + prompt + resp
    seg[i, pad:end] = 1
    pos[i, pad:end] = np.arange(end - pad)
    mask[i, pad + prompt : end] = True
    tokens[i, :pad] = 0
    tokens[i, end:] = 0
  logp = np.asarray(token_logprobs(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)).logp)
  behavior = np.where(mask, logp + rng.normal(0, 0.3, logp.shape), 0.0).astype(np.float32)
  adv = rng.normal(size=n).astype(np.float32)
  return RolloutBatch(
      tokens=tokens,
      segment_ids=seg,
      positions=pos,
      response_mask=mask,
      behavior_logp=behavior,
      learner_logp=np.where(mask, logp, 0.0).astype(np.float32),
      advantages=adv,
      rewards=np.zeros(n, np.float32),
      group_ids=np.arange(n, dtype=np.int64) // 2,
      policy_version=np.zeros(n, np.int64),
      response_lengths=mask.sum(1).astype(np.int32),
      truncated=np.zeros(n, bool),
  )


def _sgd_delta(model, loss_cfg, batch, mb, mesh=None):
  """-gradient of the mini-batch loss as the learner computes it (optimizer replaced by SGD with lr 1)."""
  learner = Learner(model, loss_cfg, OptimizerConfig(max_grad_norm=0.0), micro_batch_size=mb, mesh=mesh)
  learner.optimizer = optax.sgd(1.0)
  _, params = nnx.split(model)
  before = jax.tree.map(np.asarray, params)
  with use_mesh(mesh):
    state, metrics = learner.update(learner.init_state(jax.tree.map(jnp.array, params)), batch)
  delta = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, state.params, before)
  return delta, metrics, state


def _max_abs_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _max_abs(a):
  return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(a))


CASES = [
    ("minpro", ()),
    ("grpo", ()),
    ("gspo", ()),
    ("cispo", ()),
    ("m2po", ()),
    ("grpo", (("loss_agg_mode", "seq-mean-token-sum"),)),
]
SLOW_CASES = [
    ("minpro", (("prefix_statistic", "mean"),)),
    ("gspo_token", ()),
    ("grpo", (("loss_agg_mode", "seq-mean-token-mean"),)),
    ("minpro", (("loss_agg_mode", "seq-mean-token-sum-norm"), ("max_response_length", 12))),
]


@pytest.fixture(scope="module")
def model_and_batch():
  model = _model()
  return model, _batch(model)


def _check_accumulation(model, batch, method, hparams, micro_sizes):
  cfg = LossConfig(method=method, hparams=hparams)
  full, m_full, _ = _sgd_delta(model, cfg, batch, mb=8)
  assert _max_abs(full) > 1e-3, "gradient is ~0; the comparison would be vacuous"
  for mb in micro_sizes:
    acc, m_acc, _ = _sgd_delta(model, cfg, batch, mb=mb)
    assert _max_abs_diff(acc, full) <= 1e-6, (method, hparams, mb)
    assert abs(float(m_acc["loss"]) - float(m_full["loss"])) <= 1e-6
    assert abs(float(m_acc["grad_norm"]) - float(m_full["grad_norm"])) <= 1e-6 * max(1.0, float(m_full["grad_norm"]))


@pytest.mark.parametrize("method,hparams", CASES, ids=lambda x: str(x))
def test_micro_batch_accumulation_equals_single_batch(model_and_batch, method, hparams):
  """Gradient of 4 micro-batches of 2 accumulated == gradient of the 8-sample mini-batch (SGD lr 1 exposes it)."""
  _check_accumulation(*model_and_batch, method, hparams, (2,))


@pytest.mark.slow
@pytest.mark.parametrize("method,hparams", CASES + SLOW_CASES, ids=lambda x: str(x))
def test_micro_batch_accumulation_all_sizes(model_and_batch, method, hparams):
  _check_accumulation(*model_and_batch, method, hparams, (1, 4))


def test_an_objective_with_prepare_gets_whole_mini_batch_inputs(model_and_batch):
  """A registered objective whose `prepare` needs the whole mini-batch (a baseline = the mean advantage of all M
  samples) gets its rows of the prepared array in every micro-batch: 4 micro-batches of 2 == one of 8."""
  model, batch = model_and_batch
  seen = []

  def prepare(log_ratio, advantages, response_mask, hparams):
    seen.append((log_ratio.shape, log_ratio.dtype, advantages.shape, hparams["scale"]))
    return {"baseline": jnp.broadcast_to(jnp.mean(advantages), response_mask.shape)}

  @register_objective("toy_baseline_test", defaults={"scale": 1.0, "baseline": None}, prepare=prepare)
  def toy(inputs, hp):
    loss = -hp["scale"] * (inputs.adv - hp["baseline"]) * inputs.logp
    return loss, jnp.where(inputs.valid, 1.0, 0.0), {"baseline_mean": masked_mean(hp["baseline"], inputs.valid)}

  try:
    cfg = LossConfig(method="toy_baseline_test", hparams=(("scale", 2.0),))
    full, m_full, _ = _sgd_delta(model, cfg, batch, mb=8)
    acc, m_acc, _ = _sgd_delta(model, cfg, batch, mb=2)
  finally:
    del OBJECTIVES["toy_baseline_test"]
  assert seen == [((8, 12), jnp.float32, (8,), 2.0)] * 2  # traced once per learner, on the whole mini-batch
  assert _max_abs(full) > 1e-3
  assert _max_abs_diff(acc, full) <= 1e-6
  np.testing.assert_allclose(m_acc["policy/baseline_mean"], batch.advantages.mean(), rtol=1e-5)
  np.testing.assert_allclose(m_full["policy/baseline_mean"], batch.advantages.mean(), rtol=1e-5)


def test_accumulation_check_detects_per_micro_batch_means(model_and_batch):
  """The wrong variant (mean of per-micro-batch token means) differs, so the check above can fail."""
  model, batch = model_and_batch
  cfg = LossConfig(method="minpro")
  full, _, _ = _sgd_delta(model, cfg, batch, mb=8)
  halves = [_sgd_delta(model, cfg, half, mb=4)[0] for half in batch.split(2)]
  wrong = jax.tree.map(lambda a, b: (a + b) / 2, *halves)
  assert _max_abs_diff(wrong, full) > 1e-4


def test_update_reports_the_learner_entropy_and_k3_against_the_behavior(model_and_batch):
  """Issue 39 item 5: token means over the response tokens, at the parameters before the update, accumulated over
  micro-batches: the entropy of the learner's distribution and k3 = mean(exp(d) - 1 - d), d = behavior - learner."""
  model, batch = model_and_batch
  _, metrics, _ = _sgd_delta(model, LossConfig(method="grpo"), batch, mb=2)
  lp = token_logprobs(
      model,
      jnp.asarray(batch.tokens),
      jnp.asarray(batch.segment_ids),
      jnp.asarray(batch.positions),
      return_entropy=True,
  )
  m = batch.response_mask
  d = (batch.behavior_logp - np.asarray(lp.logp, np.float64))[m]
  np.testing.assert_allclose(metrics["entropy_mean"], np.asarray(lp.entropy)[m].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["learner_behavior/k3"], np.mean(np.expm1(d) - d), rtol=1e-4)
  assert 0.02 < float(metrics["learner_behavior/k3"]) < 0.1  # behavior = learner + N(0, 0.3^2): k3 ~ 0.045
  assert 0.0 < float(metrics["entropy_mean"]) <= np.log(VOCAB)
  # the step record: the mean over its updates and the values update by update
  from minpro_jax.rl.update_metrics import combine_update_metrics

  ups = [{"entropy_mean": np.float32(e), "learner_behavior/k3": np.float32(k)} for e, k in ((1.0, 0.25), (2.0, 0.5))]
  rec = combine_update_metrics(ups)
  assert rec["learn/entropy_mean"] == 1.5 and rec["learn/entropy_mean_by_update"] == [1.0, 2.0]
  assert rec["learn/learner_behavior/k3"] == 0.375 and rec["learn/learner_behavior/k3_by_update"] == [0.25, 0.5]


SHARDED_UPDATE_CASES = [
    ("tiny", {"data": 2, "fsdp": 4}, "fsdp", ""),
    ("tiny", {"fsdp": 4, "tensor": 2}, "tensor", ""),  # heads, mlp and vocab split over tensor (issue 58)
    ("tiny", {"fsdp": 4, "tensor": 2}, "fsdp", "default:mlp=fsdp,q_heads=,kv_heads=,vocab=,embed="),  # mesh.rules
    ("tiny-moe", {"expert": 4, "data": 2}, "expert", ""),
    ("tiny-moe", {"expert": 4, "fsdp": 2}, "expert", ""),
]


@pytest.mark.parametrize(
    "preset,layout,sharded_axis,rules",
    SHARDED_UPDATE_CASES,
    ids=[f"{p}-{l}{'-rules' if r else ''}" for p, l, _, r in SHARDED_UPDATE_CASES],
)
def test_sharded_update_equals_single_device(preset, layout, sharded_axis, rules):
  """Two learner updates on a mesh equal them on one device, also with a tensor axis and with the learner's rules
  from config (`config.mesh.rules`: here no tensor split at all, the weights over fsdp on their mlp / heads side).
  For the MoE, the single device runs the dense dispatch (every expert on every token) and the mesh the ragged one
  (the default), with experts sharded."""
  from minpro_jax.runtime.rules import parse_rules

  assert len(jax.devices()) == 8
  mesh = make_mesh(layout)
  table = parse_rules(rules, "default", "mesh.rules")
  extra = {"num_kv_heads": 2} if "tensor" in layout else {}  # heads that split over tensor=2
  cfg = LossConfig(method="minpro")
  opt = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0)
  model1 = _model(preset=preset, **({"moe_impl": "dense"} if preset == "tiny-moe" else {}), **extra)
  batch = _batch(model1)
  l1 = Learner(model1, cfg, opt, micro_batch_size=4)
  s1 = l1.init_state(nnx.split(model1)[1])
  model8 = _model(mesh, preset=preset, rules=table, **extra)
  _, p8 = nnx.split(model8)
  leaves8, treedef8 = jax.tree.flatten(p8)
  p8 = jax.tree.unflatten(
      treedef8,
      [
          jax.device_put(np.asarray(a), b.sharding)  # same values, sharded
          for a, b in zip(jax.tree.leaves(nnx.split(model1)[1]), leaves8)
      ],
  )
  l8 = Learner(model8, cfg, opt, micro_batch_size=4, mesh=mesh)
  s8 = l8.init_state(p8)
  assert _max_abs_diff(jax.tree.map(np.asarray, s1.params), jax.tree.map(np.asarray, s8.params)) == 0.0
  shardings = {str(x.sharding.spec) for x in jax.tree.leaves(s8.params)}
  assert any(sharded_axis in s for s in shardings), shardings
  if rules:  # the rules moved every weight off the tensor axis
    assert not any("tensor" in s for s in shardings), shardings
  for _ in range(2):
    s1, m1 = l1.update(s1, batch)
    with use_mesh(mesh, table):
      s8, m8 = l8.update(s8, batch)
  assert int(s8.step) == 2
  # Adam divides by sqrt(v): an expert that few tokens reach has tiny gradients whose float-rounding differences
  # it amplifies (dense on this mesh vs one device: 1.9e-5 after two steps of lr 1e-2); a wrong route moves 1e-2.
  tol = 1e-4 if preset == "tiny-moe" else 1e-5
  assert _max_abs_diff(jax.tree.map(np.asarray, s1.params), jax.tree.map(np.asarray, s8.params)) <= tol
  assert abs(float(m1["loss"]) - float(m8["loss"])) <= 1e-5
  assert abs(float(m1["grad_norm"]) - float(m8["grad_norm"])) <= 1e-5
  assert any(sharded_axis in str(x.sharding.spec) for x in jax.tree.leaves(s8.params))  # still sharded


@pytest.mark.parametrize("bad", ["advantages", "behavior_logp"])
def test_non_finite_guard_skips_update(model_and_batch, bad):
  model, batch = model_and_batch
  learner = Learner(model, LossConfig(method="grpo"), OptimizerConfig(learning_rate=1e-2), micro_batch_size=4)
  state = learner.init_state(jax.tree.map(jnp.array, nnx.split(model)[1]))
  state, m = learner.update(state, batch)  # one good update so the optimizer moments are non-zero
  assert int(state.step) == 1 and not bool(m["update_skipped"])
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  arr = getattr(batch, bad).copy()
  if bad == "advantages":
    arr[3] = np.nan
  else:
    arr[batch.response_mask] = np.where(np.arange(batch.response_mask.sum()) == 0, np.nan, 0.0)
  poisoned = batch.replace(**{bad: arr})
  state, m = learner.update(state, poisoned)
  assert bool(m["update_skipped"])
  assert int(state.step) == 1 and int(state.skipped) == 1
  after = jax.tree.map(np.asarray, (state.params, state.opt_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  state, m = learner.update(state, batch)  # training continues
  assert int(state.step) == 2 and int(state.skipped) == 1 and not bool(m["update_skipped"])


# ----------------------------------------------------------------------------------------- case B24
def _b24_tx():
  return optax.adam(lambda t: 0.1 * jnp.minimum(1.0, (t + 1) / 4), b1=0.9, b2=0.999, eps=1e-8)


def _b24_steps(tx, params, opt_state, k):
  grad_fn = jax.grad(lambda p: jnp.sum(p["w"] ** 2))
  for _ in range(k):
    updates, opt_state = tx.update(grad_fn(params), opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state


@pytest.mark.parametrize(
    "variant,expected", [("restore", 0.850279), ("full_reset", 0.900037), ("count_reset", 0.886028)]
)
def test_b24_optimizer_step_count_survives_checkpoint(tmp_path, variant, expected):
  """Case B24 (tests/CASES.md): Adam + warmup schedule; save after 2 steps, restore, 1 step == 3 uninterrupted steps. The two
  wrong variants (optimizer state rebuilt; only the count reset) give the documented different values."""
  from minpro_jax.rl.learner import TrainState

  tx = _b24_tx()
  p0 = {"w": jnp.ones((), jnp.float32)}
  p3, _ = _b24_steps(tx, p0, tx.init(p0), 3)
  assert abs(float(p3["w"]) - 0.850279) <= 1e-6
  p2, o2 = _b24_steps(tx, p0, tx.init(p0), 2)
  ckpt = RunCheckpointer(str(tmp_path), keep=2)
  state = TrainState(params=p2, opt_state=o2, step=jnp.asarray(2, jnp.int32), skipped=jnp.asarray(0, jnp.int32))
  ckpt.save(2, state, {"steps": np.zeros((0,), np.int64), "batches": {}}, {"global_step": 2})
  template = TrainState(
      params=p0, opt_state=tx.init(p0), step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32)
  )
  restored, _, meta = RunCheckpointer(str(tmp_path), keep=2).restore(ckpt.latest_step(), template)
  ckpt.close()
  assert meta["global_step"] == 2 and int(restored.step) == 2
  params, opt = restored.params, restored.opt_state
  if variant == "full_reset":
    opt = tx.init(params)
  elif variant == "count_reset":
    opt = jax.tree.map(lambda x: x, opt)  # every step counter (Adam's bias correction and the schedule's) -> 0
    opt = tuple(o._replace(count=jnp.zeros((), jnp.int32)) if hasattr(o, "count") else o for o in opt)
  p, _ = _b24_steps(tx, params, opt, 1)
  # the restored run must match to 1e-6; the wrong variants only need to land on the values of CASES.md (fp32: 1.2e-6 off)
  assert abs(float(p["w"]) - expected) <= (1e-6 if variant == "restore" else 5e-6)
  assert (abs(float(p["w"]) - 0.850279) <= 1e-6) == (variant == "restore")


# ----------------------------------------------------------------------------------------- schedule
def test_lr_schedule_warmup_then_cosine():
  s = make_schedule(
      OptimizerConfig(learning_rate=1e-3, warmup_steps=4, schedule="cosine", decay_steps=10, final_lr_ratio=0.1)
  )
  got = [float(s(t)) for t in range(16)]
  want = [1e-3 * t / 4 for t in range(4)]
  want += [1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(t, 10) / 10))) for t in range(0, 12)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_lr_schedule_linear_constant_and_unknown():
  s = make_schedule(
      OptimizerConfig(learning_rate=2e-3, warmup_steps=2, schedule="linear", decay_steps=4, final_lr_ratio=0.0)
  )
  np.testing.assert_allclose([float(s(t)) for t in range(8)], [0, 1e-3, 2e-3, 1.5e-3, 1e-3, 5e-4, 0, 0], atol=1e-9)
  c = make_schedule(OptimizerConfig(learning_rate=3e-4))
  assert float(c(0)) == pytest.approx(3e-4) and float(c(1000)) == pytest.approx(3e-4)
  with pytest.raises(ValueError, match="schedule"):
    make_schedule(OptimizerConfig(schedule="exp"))


def test_learner_reports_lr_of_the_update_index(model_and_batch):
  model, batch = model_and_batch
  learner = Learner(model, LossConfig(), OptimizerConfig(learning_rate=1e-3, warmup_steps=4), micro_batch_size=8)
  state = learner.init_state(jax.tree.map(jnp.array, nnx.split(model)[1]))
  lrs = []
  for _ in range(3):
    state, m = learner.update(state, batch)
    lrs.append(float(m["lr"]))
  np.testing.assert_allclose(lrs, [0.0, 2.5e-4, 5e-4], atol=1e-10)
  assert int(state.opt_state[-1][0].count) == 3 if hasattr(state.opt_state[-1][0], "count") else True


@pytest.mark.parametrize("remat", ["none", "block"])
def test_scoring_with_scanned_layers_and_remat_gives_the_unrolled_log_probs(remat):
  """The paper configs' layout (scan_layers=True, remat="block"): scoring in micro-batches once failed to trace
  (its loop body used Variables of the enclosing jit's trace); found by compiling the paper config ahead of time."""
  kw = dict(MODEL_KW, num_layers=2)
  ref = init_model(get_preset("tiny", **kw), seed=0)
  scanned = init_model(get_preset("tiny", **kw, scan_layers=True, remat=remat), seed=0)
  batch = _batch(ref)
  want = Learner(ref, LossConfig(), OptimizerConfig(), micro_batch_size=4).score(nnx.split(ref)[1], batch)
  got = Learner(scanned, LossConfig(), OptimizerConfig(), micro_batch_size=4).score(nnx.split(scanned)[1], batch)
  np.testing.assert_allclose(got[batch.response_mask], want[batch.response_mask], atol=1e-5)


# ----------------------------------------------------------------------------------------- MIPU Step 1 wiring
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_the_update_by_learner_over_sampler_capped(model_and_batch, level):
  """MIPU Step 1 (arXiv 2606.29526; TIS): with `rollout_is`, the GRPO update at theta = theta_k is
  -grad (1/N) sum_t A_i w_t logp_t, w_t = min(pi_k / mu, 2) from the batch's learner_logp (pi_k, = the current
  log-probs here, so the PPO ratio is 1 and unclipped) and behavior_logp (mu, the sampler's). Dropping either
  input, or the cap, changes the update: each is checked against the same hand formula."""
  model, batch = model_and_batch
  rng = np.random.default_rng(7)
  mask = batch.response_mask
  mu = np.where(mask, batch.learner_logp + rng.normal(0, 0.8, mask.shape), 0.0).astype(np.float32)
  batch = batch.replace(behavior_logp=mu)
  d = np.where(mask, batch.learner_logp - mu, 0.0).astype(np.float64)
  log_w = d if level == "token" else np.broadcast_to(d.sum(1, keepdims=True), d.shape)
  w = np.where(mask, np.exp(np.minimum(log_w, np.log(2.0))), 0.0)
  assert 0 < (w[mask] == 2.0).mean() < 1, "some tokens must hit the cap, some not"
  n_tok = mask.sum()
  coef = jnp.asarray(batch.advantages[:, None] * w / n_tok, jnp.float32)
  _, params = nnx.split(model)
  graphdef = nnx.graphdef(model)

  def surrogate(p):
    lp = token_logprobs(nnx.merge(graphdef, p), *map(jnp.asarray, (batch.tokens, batch.segment_ids, batch.positions)))
    return jnp.sum(coef * lp.logp)  # minus the loss: the SGD step direction

  want = jax.tree.map(np.asarray, jax.grad(surrogate)(params))
  cfg = LossConfig(method="grpo", hparams=(("rollout_is", level), ("tis_cap", 2.0)))
  got, metrics, _ = _sgd_delta(model, cfg, batch, mb=8)
  assert _max_abs(want) > 1e-3
  assert _max_abs_diff(got, want) <= 1e-5 * _max_abs(want)
  np.testing.assert_allclose(float(metrics["loss"]), -float(np.sum(batch.advantages[:, None] * w) / n_tok), rtol=1e-5)
  # without the correction, or with behavior_logp as the PPO reference, the update is different
  plain, _, _ = _sgd_delta(model, LossConfig(method="grpo"), batch, mb=8)
  assert _max_abs_diff(plain, want) > 1e-2 * _max_abs(want)
  uncapped, _, _ = _sgd_delta(
      model, LossConfig(method="grpo", hparams=(("rollout_is", level), ("tis_cap", 1e9))), batch, mb=8
  )
  assert _max_abs_diff(uncapped, want) > 1e-2 * _max_abs(want)


def test_update_reports_weight_square_and_log_ratio_by_position_bin(model_and_batch):
  """The per-position-bin sums the learner returns (mean weight, mean squared weight, mean |learner - behaviour log
  ratio| over the bin's tokens) equal a naive loop over the tokens; the step record's ESS fraction per bin is
  (sum w)^2 / (n sum w^2) over the step's updates. GRPO with token TIS at theta = theta_k has the known weight
  w_t = min(pi_k / mu, 2) (the PPO ratio is 1), so the expected values come from the batch alone."""
  from minpro_jax.rl.update_metrics import combine_update_metrics

  model = model_and_batch[0]
  batch = _batch(model, length=20, seed=1)  # responses of up to 18 tokens: position bins 0-7, 8-15, 16-31
  rng = np.random.default_rng(3)
  mask = batch.response_mask
  mu = np.where(mask, batch.learner_logp + rng.normal(0, 0.8, mask.shape), 0.0).astype(np.float32)
  batch = batch.replace(behavior_logp=mu)
  d = np.where(mask, batch.learner_logp.astype(np.float64) - mu, 0.0)
  w = np.exp(np.minimum(d, np.log(2.0)))
  index = np.cumsum(mask, axis=1) - 1  # position inside the response
  bins = np.sum(index[..., None] >= np.asarray([8, 16, 32]), axis=-1)
  cfg = LossConfig(method="grpo", hparams=(("rollout_is", "token"), ("tis_cap", 2.0)))
  _, metrics, _ = _sgd_delta(model, cfg, batch, mb=2)
  got = {k: np.asarray(metrics[k]) for k in metrics if k.endswith("_by_position_bin")}
  assert (mask & (bins == 1)).sum() > 0, "the test needs tokens past position 8"
  used = [b for b in range(3) if (mask & (bins == b)).any()]
  for b in used:
    sel = mask & (bins == b)
    assert got["tokens_by_position_bin"][b] == sel.sum()
    np.testing.assert_allclose(got["weight_by_position_bin"][b], w[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(got["weight_sq_by_position_bin"][b], (w[sel] ** 2).mean(), rtol=1e-5)
    np.testing.assert_allclose(got["abs_log_ratio_by_position_bin"][b], np.abs(d[sel]).mean(), rtol=1e-4, atol=1e-6)
  assert np.all(got["tokens_by_position_bin"][len(used) :] == 0)
  # two updates of one step: token-weighted over the updates, ESS from the pooled sums; bins without tokens: None
  ups = [{k: np.asarray(v) for k, v in metrics.items()}] * 2
  rec = combine_update_metrics(ups)
  for b in used:
    sel = mask & (bins == b)
    np.testing.assert_allclose(
        rec["learn/ess_frac_by_position_bin"][b], w[sel].sum() ** 2 / (sel.sum() * (w[sel] ** 2).sum()), rtol=1e-5
    )
    np.testing.assert_allclose(rec["learn/abs_log_ratio_by_position_bin"][b], np.abs(d[sel]).mean(), rtol=1e-4)
  assert rec["learn/ess_frac_by_position_bin"][len(used) :] == [None] * (8 - len(used))
  assert 0 < min(rec["learn/ess_frac_by_position_bin"][: len(used)]) < 1
  assert not any(k.startswith("learn/weight_sq") or k.startswith("learn/tokens_by") for k in rec)


def _minpro_weights_naive(log_ratio, mask, eps_high=0.28):
  """MinPRO's per-token weight by a plain loop over each response's tokens: w_t = min(exp(min_{j<t} l_j + l_t),
  1 + eps_high) with l_j the log ratio of the j-th response token (no prefix at the first token: w = min(r_t, cap)),
  and each token's index inside its response."""
  w = np.zeros(mask.shape)
  index = np.full(mask.shape, -1)
  for i in range(mask.shape[0]):
    prefix_min, k = None, 0
    for t in np.flatnonzero(mask[i]):
      log_w = log_ratio[i, t] + (0.0 if prefix_min is None else prefix_min)
      w[i, t] = min(math.exp(log_w), 1.0 + eps_high)
      index[i, t] = k
      prefix_min = log_ratio[i, t] if prefix_min is None else min(prefix_min, log_ratio[i, t])
      k += 1
  return w, index


def test_minpro_weight_by_position_bin_pins_the_prefix_min_weights(model_and_batch):
  """`weight_by_position_bin` of a MinPRO update at theta = theta_k (so pi_theta = the batch's learner log-probs and
  r_t = pi_theta / mu is set by the behaviour log-probs) equals, per bin of the response index (0-7, 8-15, 16-31),
  the mean of clip(min_{j<t} r_j * r_t) at 1 + eps_high = 1.28:
    * by hand: r_t = 2 before index 8 and 1/2 from it gives w = 1.28 (capped) at indices 0-7, 2 * 1/2 = 1 at index
      8 and 1/2 * 1/2 = 1/4 after it;
    * by a plain loop over the tokens (`_minpro_weights_naive`) for random ratios;
  and the step record's `learn/weight_by_position_bin` (None for bins no response reached) carries the same values."""
  from minpro_jax.rl.update_metrics import combine_update_metrics

  model = model_and_batch[0]
  batch = _batch(model, length=20, seed=1)  # responses of up to 18 tokens
  mask = batch.response_mask
  learner = Learner(model, LossConfig(method="minpro"), OptimizerConfig(max_grad_norm=0.0), micro_batch_size=2)
  params = jax.tree.map(np.asarray, nnx.split(model)[1])

  def weight_by_bin(log_ratio):
    mu = np.where(mask, batch.learner_logp - log_ratio, 0.0).astype(np.float32)
    state = learner.init_state(jax.tree.map(jnp.array, params))  # a fresh copy: the update donates its state
    _, metrics = learner.update(state, batch.replace(behavior_logp=mu))
    return {k: np.asarray(v) for k, v in metrics.items()}

  index = np.cumsum(mask, axis=1) - 1
  n8 = int((mask & (index == 8)).sum())
  n_bin = [int((mask & (index >= lo) & (index < hi)).sum()) for lo, hi in ((0, 8), (8, 16), (16, 32))]
  assert n8 > 0 and n_bin[1] > n8, "the test needs responses past index 9"
  used = 3 if n_bin[2] else 2
  got = weight_by_bin(np.where(index < 8, math.log(2.0), math.log(0.5)))
  want = [1.28, (n8 * 1.0 + (n_bin[1] - n8) * 0.25) / n_bin[1], 0.25][:used]
  np.testing.assert_allclose(got["weight_by_position_bin"][:used], want, rtol=1e-5)
  np.testing.assert_array_equal(got["tokens_by_position_bin"], n_bin[:used] + [0] * (8 - used))
  assert np.all(got["weight_by_position_bin"][used:] == 0)
  rec = combine_update_metrics([got])
  np.testing.assert_allclose(rec["learn/weight_by_position_bin"][:used], want, rtol=1e-5)
  assert rec["learn/weight_by_position_bin"][used:] == [None] * (8 - used)

  log_ratio = np.where(mask, np.random.default_rng(3).normal(0, 0.8, mask.shape), 0.0)
  w, index = _minpro_weights_naive(log_ratio, mask)
  assert 0 < (w[mask] == 1.28).mean() < 0.5, "some tokens must hit the cap, most not"
  got = weight_by_bin(log_ratio)
  for b, (lo, hi) in enumerate(((0, 8), (8, 16), (16, 32))[:used]):
    sel = mask & (index >= lo) & (index < hi)
    np.testing.assert_allclose(got["weight_by_position_bin"][b], w[sel].mean(), rtol=1e-5)
  sel = mask & (index >= 8)  # the prefix matters past the first tokens: clip(r_t) alone gives another mean
  assert abs(np.minimum(np.exp(log_ratio[sel]), 1.28).mean() - w[sel].mean()) > 0.05
