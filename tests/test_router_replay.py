"""Router replay in the model (`models.moe`, `Transformer(routes_btlk=...)`): a forward told which experts each
token uses computes exactly that, with gate weights from its own router; a numpy reference of one block; replaying
a forward's own routes changes nothing; the routes of a bf16 forward differ from fp32 on some tokens and replaying
them moves the fp32 forward onto the bf16 routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minpro_jax.models import get_preset, init_model
from minpro_jax.models.moe import NO_ROUTE, MoE, route_mismatch
from minpro_jax.rl.learner import Learner, LossConfig
from minpro_jax.rl.optimizer import OptimizerConfig
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.sampling import Sampler, SamplingParams, engines


def _block(norm_topk=True, moe_impl="ragged"):
  cfg = get_preset("tiny-moe", norm_topk_prob=norm_topk, moe_impl=moe_impl)
  with nnx.use_eager_sharding(False):
    moe = MoE(cfg, rngs=nnx.Rngs(3))
  rng = np.random.RandomState(0)
  moe.router[...] = jnp.asarray(rng.randn(64, 8).astype(np.float32) * 0.5)
  return cfg, moe, rng.randn(2, 5, 64).astype(np.float32)


@pytest.mark.parametrize("moe_impl", ["ragged", "dense"])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_a_replayed_block_matches_numpy_with_the_recorded_experts(norm_topk, moe_impl):
  cfg, moe, x = _block(norm_topk, moe_impl)
  routes = np.full((2, 5, 2), NO_ROUTE, np.int16)
  routes[0, 1] = (7, 3)
  routes[1, 0] = (0, 5)
  routes[1, 4] = (2, 2 + 4)
  valid = np.ones((2, 5), bool)
  y, _, own = moe(jnp.asarray(x), jnp.asarray(valid), jnp.asarray(routes))
  wr, wg, wu, wd = (np.asarray(getattr(moe, n)[...]) for n in ("router", "gate_proj", "up_proj", "down_proj"))
  logits = x @ wr
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  want = np.zeros_like(x)
  want_own = np.zeros((2, 5, 2), np.int64)
  for b in range(2):
    for t in range(5):
      want_own[b, t] = np.argsort(-probs[b, t], kind="stable")[:2]
      experts = routes[b, t] if routes[b, t, 0] >= 0 else want_own[b, t]
      gates = probs[b, t, experts]
      if norm_topk:
        gates = gates / gates.sum()
      for e, gate in zip(experts, gates):
        g, u = x[b, t] @ wg[e], x[b, t] @ wu[e]
        want[b, t] += gate * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.sort(np.asarray(own), -1), np.sort(want_own, -1))  # the router's own choice
  assert own.dtype == jnp.int16


def test_the_router_gets_a_gradient_through_a_replayed_expert_it_would_not_choose():
  """With renormalised top-k gates, an expert outside the token's own top-k gets no router gradient unless it is
  replayed."""
  cfg, moe, x = _block(norm_topk=True)
  graphdef, params = nnx.split(moe)
  x1 = jnp.asarray(x[:1, :1])
  own = np.asarray(moe(x1, jnp.ones((1, 1), bool))[2])[0, 0]
  outsider = next(e for e in range(cfg.num_experts) if e not in own)
  forced = jnp.asarray(np.array([[[own[0], outsider]]], np.int16))

  def router_grad(routes):
    def loss(p):
      y, _, _ = nnx.merge(graphdef, p)(x1, jnp.ones((1, 1), bool), routes)
      return jnp.sum(y)

    return np.asarray(jax.grad(loss)(params)["router"][...])[:, outsider]

  assert np.abs(router_grad(None)).max() < 1e-10  # float rounding of the cancelling softmax denominator
  assert np.abs(router_grad(forced)).max() > 1e-6


def _tokens_and_segments():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 512, size=(2, 24)), jnp.int32)
  seg = np.ones((2, 24), np.int32)
  seg[0, :5] = 0
  return tokens, jnp.asarray(seg)


@pytest.mark.parametrize("overrides", [{}, {"scan_layers": True}, {"stack_layers": False}])
def test_replaying_a_forwards_own_routes_changes_nothing(overrides):
  model = init_model(get_preset("tiny-moe", **overrides), seed=0)
  tokens, seg = _tokens_and_segments()
  live = model(tokens, segment_ids_bt=seg)
  assert live.routes.shape == (2, 24, 2, 2) and live.routes.dtype == jnp.int16
  replayed = model(tokens, segment_ids_bt=seg, routes_btlk=live.routes)
  np.testing.assert_array_equal(np.asarray(replayed.out), np.asarray(live.out))
  none = model(tokens, segment_ids_bt=seg, routes_btlk=jnp.full_like(live.routes, NO_ROUTE))
  np.testing.assert_array_equal(np.asarray(none.out), np.asarray(live.out))


def test_replay_moves_an_fp32_forward_onto_a_bf16_forwards_routing():
  """A bf16 forward (a sampler at lower precision, same parameters) routes some tokens differently from fp32.
  The fp32 forward replaying the bf16 routes uses exactly those experts; dense and ragged dispatch agree on the
  replayed forward, and it differs from live fp32 routing where the routes differ."""
  tokens, seg = _tokens_and_segments()
  fp32 = init_model(get_preset("tiny-moe", num_experts=16, num_experts_per_tok=4), seed=1)
  bf16 = init_model(fp32.config.replace(dtype="bfloat16"), seed=1)  # the same fp32 parameters, bf16 compute
  sampler_routes = bf16(tokens, segment_ids_bt=seg).routes
  live = fp32(tokens, segment_ids_bt=seg)
  differ = np.any(np.sort(np.asarray(sampler_routes), -1) != np.sort(np.asarray(live.routes), -1), -1)  # [B, T, L]
  assert 0 < differ.mean() < 0.5, differ.mean()
  replayed = fp32(tokens, segment_ids_bt=seg, routes_btlk=sampler_routes)
  # the router's own choice is what is reported; in layer 0 its input is the same as without replay
  np.testing.assert_array_equal(np.asarray(replayed.routes)[:, :, 0], np.asarray(live.routes)[:, :, 0])
  dense = init_model(fp32.config.replace(moe_impl="dense"), seed=1)
  forced_dense = dense(tokens, segment_ids_bt=seg, routes_btlk=sampler_routes)
  np.testing.assert_allclose(np.asarray(replayed.out), np.asarray(forced_dense.out), atol=1e-5)
  first = np.argmax(differ.reshape(-1, differ.shape[-1]).any(-1))  # the first token whose route differs
  b, t = divmod(int(first), differ.shape[1])
  assert np.abs(np.asarray(replayed.out)[b, t:] - np.asarray(live.out)[b, t:]).max() > 1e-4


def test_routes_for_a_dense_model_or_of_the_wrong_shape_are_refused():
  tokens, seg = _tokens_and_segments()
  with pytest.raises(ValueError, match="router replay needs a MoE"):
    init_model(get_preset("tiny"), seed=0)(tokens, routes_btlk=jnp.zeros((2, 24, 2, 2), jnp.int16))
  with pytest.raises(ValueError, match=r"shape \(2, 24, 2, 2\)"):
    init_model(get_preset("tiny-moe"), seed=0)(tokens, routes_btlk=jnp.zeros((2, 24, 2), jnp.int16))


# ------------------------------------------------------------------------------------------------ sampler + learner
MOE = get_preset("tiny-moe")
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400], [3, 3], [71, 72, 73]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=tuple(range(3, 512, 9)))


@pytest.fixture(scope="module")
def moe_state():
  return nnx.split(init_model(MOE, seed=3))[1]


@pytest.fixture(scope="module")
def recorded(moe_state):
  """The same requests through the static sampler and the continuous one (4 decode rows: refills), routes on."""
  kw = dict(prompt_buckets=(16,), record_routes=True)
  static = Sampler(MOE, **kw, engine="static").generate(moe_state, PROMPTS, SAMPLING, 0, group_size=2)
  cont = Sampler(MOE, **kw, engine=engines.Continuous(decode_rows=4, refill_rows=1)).generate(
      moe_state, PROMPTS, SAMPLING, 0, group_size=2
  )
  return static, cont


def test_the_sampler_records_the_routes_of_every_token_it_fed_forward(moe_state, recorded):
  """Static and continuous samplers record the same routes; each is the router's choice in a teacher-forced fp32
  forward of the same sequence; the last response token (never fed forward), padding and prompts hold NO_ROUTE."""
  static, cont = recorded
  assert static.routes.shape == (10, 12, MOE.num_layers, MOE.num_experts_per_tok) and static.routes.dtype == np.int16
  np.testing.assert_array_equal(cont.routes, static.routes)
  assert 0 < static.lengths.min() < static.lengths.max() <= 12  # ragged rows: some stop early
  fed = np.arange(12)[None, :] < (static.lengths - 1)[:, None]  # response indices 0 .. length - 2
  assert np.all(static.routes[fed] >= 0) and np.all(static.routes[~fed] == NO_ROUTE)  # padding never expert 0
  batch = RolloutBatch.from_generation(static, rewards=np.zeros(10), advantages=np.zeros(10))
  assert np.all(batch.routes[:, :16] == NO_ROUTE)
  model = nnx.merge(nnx.split(init_model(MOE, seed=3))[0], moe_state)
  teacher = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions), jnp.asarray(batch.segment_ids)).routes
  at = batch.routes[..., 0] >= 0  # [N, L, layers]
  assert route_mismatch(np.asarray(teacher)[at], batch.routes[at]) == (0.0, int(at.sum()))


@pytest.mark.parametrize("replay", [False, True])
def test_replay_at_equal_parameters_and_precision_changes_no_log_prob(moe_state, recorded, replay):
  """An fp32 sampler's routes are the fp32 learner's own: scoring with replay gives the log-probs without it and
  the sampler's behavior log-probs; an update step with replay runs and reports finite values."""
  static, _ = recorded
  batch = RolloutBatch.from_generation(static, rewards=np.zeros(10), advantages=np.linspace(-1, 1, 10))
  model = nnx.merge(nnx.split(init_model(MOE, seed=3))[0], moe_state)
  learner = Learner(model, LossConfig(method="minpro", router_replay=replay), OptimizerConfig(), micro_batch_size=5)
  logp, routes = learner.score(moe_state, batch, return_routes=True)
  mask = batch.response_mask
  np.testing.assert_allclose(logp[mask], batch.behavior_logp[mask], atol=1e-5)
  assert route_mismatch(routes, batch.routes) == (0.0, int((batch.routes[..., 0] >= 0).sum()))
  state, metrics = learner.update(learner.init_state(jax.tree.map(jnp.array, moe_state)), batch)
  assert np.isfinite(float(metrics["loss"])) and not bool(metrics["update_skipped"])


def test_replay_needs_routes_in_the_batch(moe_state, recorded):
  static, _ = recorded
  batch = RolloutBatch.from_generation(static, rewards=np.zeros(10), advantages=np.zeros(10)).replace(routes=None)
  model = nnx.merge(nnx.split(init_model(MOE, seed=3))[0], moe_state)
  learner = Learner(model, LossConfig(method="grpo", router_replay=True), OptimizerConfig(), micro_batch_size=5)
  with pytest.raises(ValueError, match="router_replay=True but the batch has no routes"):
    learner.score(moe_state, batch)
  with pytest.raises(ValueError, match="record_routes=True needs a MoE"):
    Sampler(get_preset("tiny"), record_routes=True)


def test_a_lower_precision_sampler_routes_differently_and_replay_follows_it():
  """A bf16 sampler at the fp32 learner's parameters: some recorded routes differ from the learner's own, the
  learner's replayed log-probs differ from its live ones, and the mismatch is measured."""
  cfg = get_preset("tiny-moe", num_experts=16, num_experts_per_tok=4)
  state = nnx.split(init_model(cfg, seed=5))[1]
  gen = Sampler(cfg, precision="bf16", prompt_buckets=(16,), record_routes=True, engine="static").generate(
      state, PROMPTS, SAMPLING, 1, group_size=2
  )
  batch = RolloutBatch.from_generation(gen, rewards=np.zeros(10), advantages=np.zeros(10))
  model = nnx.merge(nnx.split(init_model(cfg, seed=5))[0], state)
  scored = {}
  for replay in (False, True):
    learner = Learner(model, LossConfig(router_replay=replay), OptimizerConfig(), micro_batch_size=10)
    scored[replay] = learner.score(state, batch, return_routes=True)
  frac, count = route_mismatch(scored[False][1], batch.routes)
  assert count > 0 and 0 < frac < 0.5, frac
  mask = batch.response_mask
  assert np.abs(scored[True][0][mask] - scored[False][0][mask]).max() > 1e-5


@pytest.mark.slow
def test_a_moe_run_with_replay_logs_the_mismatch_and_resumes_its_buffer(tmp_path):
  """The trainer end to end on a tiny MoE with an fp8 sampler: routes are recorded, the learner's routing mismatch
  is logged every sampling step, the delay buffer (batches with routes) is checkpointed, and re-running the
  finished command restores it."""
  import json

  from train_helpers import make_config, tiny_overrides

  from minpro_jax.run.trainer import Trainer

  ov = tiny_overrides(
      tmp_path,
      total_steps=3,
      **{
          "model.preset": "tiny-moe",
          "loss.router_replay": True,
          "sampling.precision": "fp8",
          "checkpoint.every": 1,
      },
  )
  moe = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16}
  trainer = Trainer.from_config(make_config(ov, model=moe))
  assert trainer.sampler.record_routes and not trainer.eval_sampler.record_routes  # evaluation records none
  summary = trainer.run()
  recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  fracs = [r["sampler_learner/router_mismatch_frac"] for r in recs if "sampler_learner/router_mismatch_frac" in r]
  assert len(fracs) == 3 and all(0.0 <= f <= 1.0 for f in fracs) and max(fracs) > 0.0, fracs
  again = Trainer.from_config(make_config(ov, model=moe)).run()
  assert again["policy_version"] == summary["policy_version"]


def test_replay_on_a_dense_model_is_a_config_error(tmp_path):
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.errors import ConfigError
  from minpro_jax.run.trainer import Trainer

  with pytest.raises(ConfigError, match="config.loss.router_replay: routes exist only in MoE models"):
    Trainer.from_config(make_config(tiny_overrides(tmp_path, **{"loss.router_replay": True})))
