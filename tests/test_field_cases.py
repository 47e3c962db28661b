"""Field cases B26-B43 of /work/shared/cases.md ("Added 2026-12-01"), each through the project's public API.

Cases and the function each goes through:
  B26 CISPO bounds             minpro_jax.rl.objectives.policy_loss("cispo", ...)
  B28 KL estimators            minpro_jax.rl.aggregation.mismatch_metrics (k1 / k3 and their fp32 precision)
  B30 temperature              minpro_jax.sampling.methods.get_next_tokens
  B35 mismatch before clipping policy_loss metrics, rollout_correction, mismatch_metrics
  B36 advantage scaling        minpro_jax.rl.advantages.group_advantages
  B37 rope_theta / head_dim    minpro_jax.models.hf_io.config_from_hf, models.rope.rope_inv_freq / apply_rope
  B39 GGUF Q/K rows            minpro_jax.models.gguf_io.permute_rope_rows / unpermute_rope_rows
  B40, B41, B43 grading        minpro_jax.data.rewards.math_reward (conventions: module docstring, docs/data.md)
Expected numbers are the ones of cases.md (recomputed there with numpy, fp64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.data.rewards import math_reward
from minpro_jax.models.gguf_io import permute_rope_rows, unpermute_rope_rows
from minpro_jax.models.hf_io import config_from_hf
from minpro_jax.models.rope import apply_rope, rope_inv_freq
from minpro_jax.rl.advantages import group_advantages
from minpro_jax.rl.aggregation import mismatch_metrics, rollout_correction
from minpro_jax.rl.objectives import policy_loss
from minpro_jax.sampling.methods import SamplingParams, get_next_tokens

TOL = dict(rtol=1e-5, atol=1e-6)


def _loss_and_grad(method, logp, behavior, adv, **hp):
  """(PolicyLossOutput, d loss / d logp) for one row of tokens."""
  logp, behavior = jnp.asarray([logp], jnp.float32), jnp.asarray([behavior], jnp.float32)
  adv = jnp.asarray([adv], jnp.float32)
  mask = jnp.ones(logp.shape, bool)
  out = policy_loss(method, logp, behavior, adv, mask, **hp)
  grad = jax.grad(lambda lp: policy_loss(method, lp, behavior, adv, mask, **hp).loss)(logp)
  return out, np.asarray(grad[0])


# ------------------------------------------------------------------------------------------------ B26
B26_R = np.array([0.3, 1.0, 3.0, 7.0])
B26_A = [1.0, -1.0, 1.0, -1.0]
B26_LP = np.array([-1.2, -0.5, -2.0, -0.1])


def test_b26_cispo_scalerl_bounds_are_offsets_from_one():
  """The project's CISPO bounds are offsets from 1: [1 - eps_low, 1 + eps_high]; eps_low=None is no lower bound
  (0). ScaleRL's absolute [0, 5] is therefore eps_low=None, eps_high=4 (eps_low=1 would put log 0 in the clip and
  is refused)."""
  out, grad = _loss_and_grad("cispo", B26_LP, B26_LP - np.log(B26_R), B26_A, eps_low=None, eps_high=4.0)
  np.testing.assert_allclose(out.token_weights[0], [0.3, 1.0, 3.0, 5.0], **TOL)
  np.testing.assert_allclose(out.loss, 1.34, **TOL)
  np.testing.assert_allclose(grad, [-0.075, 0.25, -0.75, 1.25], **TOL)
  with pytest.raises(ValueError, match="eps_low must be < 1"):
    _loss_and_grad("cispo", B26_LP, B26_LP - np.log(B26_R), B26_A, eps_low=1.0, eps_high=4.0)


def test_b26_offset_bug_values_and_default_keeps_small_ratios():
  # offsets 0 and 5 are the bounds [1, 6]: what the SkyRL bug computed; here it has to be asked for explicitly
  out, grad = _loss_and_grad("cispo", B26_LP, B26_LP - np.log(B26_R), B26_A, eps_low=0.0, eps_high=5.0)
  np.testing.assert_allclose(out.token_weights[0], [1.0, 1.0, 3.0, 6.0], **TOL)
  np.testing.assert_allclose(out.loss, 1.525, **TOL)
  np.testing.assert_allclose(grad, [-0.25, 0.25, -0.75, 1.5], **TOL)
  # the default (eps_low=None, eps_high=0.28) keeps a ratio below 1 as it is
  out, _ = _loss_and_grad("cispo", B26_LP, B26_LP - np.log(B26_R), B26_A)
  np.testing.assert_allclose(out.token_weights[0], [0.3, 1.0, 1.28, 1.28], **TOL)


# ------------------------------------------------------------------------------------------------ B28
def test_b28_kl_estimators_and_direction():
  """mismatch_metrics(logp, behavior) estimates KL(behavior || logp-policy): with delta = logp - behavior,
  k1 = mean(-delta), k3 = mean(e^delta - 1 - delta). B28's KL to a reference (d = lp - ref) is therefore
  mismatch_metrics(ref, lp)."""
  lp, ref = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-1.5, -1.0, -0.5]])
  m = mismatch_metrics(ref, lp, jnp.ones((1, 3), bool))
  np.testing.assert_allclose(m["mismatch_k1"], -0.166667, atol=1e-6)
  np.testing.assert_allclose(m["mismatch_k3"], 0.274937, atol=1e-6)
  assert abs(float(m["mismatch_k3"]) - 0.172200) > 0.1  # not the wrong direction e^d - 1 - d

  # (b) one SGD step (lr 0.5) on mean k3 with lp free lowers it (the KL term is a penalty, added)
  k3 = lambda x: mismatch_metrics(ref, x, jnp.ones((1, 3), bool))["mismatch_k3"]  # noqa: E731
  g = jax.grad(k3)(lp)
  np.testing.assert_allclose(g[0], [0.131156, -0.572761, 0.0], atol=1e-6)
  np.testing.assert_allclose(k3(lp - 0.5 * g), 0.136603, atol=1e-6)


def test_b28_k3_fp32_precision_near_zero():
  d = np.linspace(-1e-3, 1e-3, 201).astype(np.float32)
  got = np.array(
      [float(mismatch_metrics(jnp.array([[x]]), jnp.zeros((1, 1)), jnp.ones((1, 1), bool))["mismatch_k3"]) for x in d]
  )
  true = np.expm1(d.astype(np.float64)) - d.astype(np.float64)
  assert (got >= 0).all()
  np.testing.assert_allclose(got, true, rtol=1e-3, atol=0)


# ------------------------------------------------------------------------------------------------ B30
@pytest.mark.parametrize(
    "t,probs,lp0",
    [(0.5, [0.866813, 0.117310, 0.015876], -0.142932), (2.0, [0.506480, 0.307196, 0.186324], -0.680270)],
)
def test_b30_temperature_applied_once(t, probs, lp0):
  n = 20_000
  logits = jnp.tile(jnp.array([[2.0, 1.0, 0.0]], jnp.float32), (n, 1))
  keys = jax.random.split(jax.random.key(0), n)
  exact = np.array([2.0, 1.0, 0.0]) / t
  exact = np.exp(exact - np.logaddexp.reduce(exact))  # fp64 softmax(logits / T), once divided
  np.testing.assert_allclose(exact, probs, atol=1e-6)
  for fn in (get_next_tokens, jax.jit(get_next_tokens, static_argnums=2)):
    out = fn(logits, keys, SamplingParams(temperature=t))
    tokens, logp = np.asarray(out.tokens), np.asarray(out.logp)
    freq = np.bincount(tokens, minlength=3) / n
    np.testing.assert_allclose(freq, probs, atol=0.01)
    np.testing.assert_allclose(logp[tokens == 0], lp0, atol=1e-5)  # log of the distribution sampled from
    np.testing.assert_allclose(logp, np.log(exact)[tokens], atol=1e-5)
  # top-k over all 3 tokens and top-p 1.0 are the same distribution
  for sp in (SamplingParams(temperature=t, top_k=3), SamplingParams(temperature=t, top_p=1.0)):
    out = get_next_tokens(logits[:8], keys[:8], sp)
    np.testing.assert_allclose(np.asarray(out.logp), np.log(exact)[np.asarray(out.tokens)], atol=1e-5)
  # greedy reports log_softmax at T = 1, whatever the token
  g = get_next_tokens(logits[:2], keys[:2], SamplingParams(temperature=0.0))
  assert np.asarray(g.tokens).tolist() == [0, 0]
  np.testing.assert_allclose(g.logp, -0.407606, atol=1e-5)


# ------------------------------------------------------------------------------------------------ B35
def test_b35_mismatch_measured_before_truncation_and_weight_detached():
  d = jnp.array([[-0.5, 2.5, -0.2]])  # lp_train - lp_rollout
  valid = jnp.ones((1, 3), bool)
  # the ratio mean that policy_loss reports is the unclipped one, whatever the clip
  for hp in ({"eps_high": 4.0}, {"eps_high": None}, {"eps_high": 0.28}):
    out, _ = _loss_and_grad("cispo", d[0], np.zeros(3), [1.0, 1.0, 1.0], **hp)
    np.testing.assert_allclose(out.metrics["ratio_mean"], 4.535918, **TOL)
  out, _ = _loss_and_grad("cispo", d[0], np.zeros(3), [1.0, 1.0, 1.0], eps_high=4.0)
  np.testing.assert_allclose(out.metrics["weight_mean"], 2.141754, **TOL)
  # TIS (cap 5) and MIS ([0.5, 5]) on the trainer/inference log-ratio
  w, keep, m = rollout_correction(d, jnp.zeros((1, 3)), valid, None, rollout_is="token", tis_cap=5.0)
  np.testing.assert_allclose(m["tis_weight_mean"], 2.141754, **TOL)
  w, keep, m = rollout_correction(d, jnp.zeros((1, 3)), valid, None, rollout_mis="token", rollout_mis_bounds=(0.5, 5))
  np.testing.assert_allclose(m["mis_kept_frac"], 2 / 3, **TOL)
  np.testing.assert_allclose(jnp.mean(jnp.where(keep, jnp.exp(d), 0.0)), 0.475087, **TOL)
  # mismatch KL over response tokens only (a masked 4th token holding garbage changes nothing)
  lp_train = jnp.array([[-1.0, -0.5, -2.0, 50.0]])
  lp_roll = jnp.array([[-1.2, -0.5, -1.5, -50.0]])
  mm = mismatch_metrics(lp_train, lp_roll, jnp.array([[1, 1, 1, 0]], bool))
  np.testing.assert_allclose(mm["mismatch_k1"], 0.1, **TOL)
  np.testing.assert_allclose(mm["mismatch_k3"], 0.042644, atol=1e-6)
  # no gradient through the IS weight: d/dlp of -sg(w) A lp at lp=-0.5, b=-1.0, A=1
  _, grad = _loss_and_grad("cispo", [-0.5], [-1.0], [1.0], eps_high=None)
  np.testing.assert_allclose(grad, [-1.648721], **TOL)


# ------------------------------------------------------------------------------------------------ B36
def test_b36_advantage_scaling_modes_differ():
  """The project's modes: "drgrpo" = group mean, no scaling; "grpo" = group mean / group std (ddof 0 or 1).
  There is no batch-std ("PPO-Lite") mode: asking for one is an error, never a silent group-std fallback."""
  r = jnp.array([1.0, 0, 0, 0, 1, 1, 0, 0])
  g = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
  none = group_advantages(r, g, mode="drgrpo")
  np.testing.assert_allclose(none, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5], **TOL)
  grp1 = group_advantages(r, g, mode="grpo", std_ddof=1, eps=0.0)
  np.testing.assert_allclose(grp1, [1.5, -0.5, -0.5, -0.5, 0.866025, 0.866025, -0.866025, -0.866025], **TOL)
  grp0 = group_advantages(r, g, mode="grpo", std_ddof=0, eps=0.0)
  np.testing.assert_allclose(grp0, [1.732051, -0.577350, -0.577350, -0.577350, 1, 1, -1, -1], **TOL)
  assert not np.allclose(none, grp1) and not np.allclose(grp1, grp0)
  with pytest.raises(ValueError, match="Unknown advantage mode"):
    group_advantages(r, g, mode="batch")


# ------------------------------------------------------------------------------------------------ B37
_QWEN3_06B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    num_hidden_layers=2,
    vocab_size=1000,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "rope", [{"rope_theta": 1000000}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000}}]
)
def test_b37_rope_theta_location_and_explicit_head_dim(rope):
  cfg = config_from_hf({**_QWEN3_06B, **rope})
  assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
  assert cfg.head_dim == 128  # read from the config, not 1024 / 16 = 64
  inv = np.asarray(rope_inv_freq(cfg))
  assert inv.shape == (64,)
  np.testing.assert_allclose([inv[1], inv[32]], [0.805842, 1e-3], rtol=1e-5)
  # rotate-half RoPE of the unit vector at dim 32, position 100: nonzero only at dims 32 and 96
  x = jnp.zeros((1, 1, 1, 128)).at[0, 0, 0, 32].set(1.0)
  ang = 100.0 * jnp.asarray(inv)[None, None, :]
  out = np.asarray(apply_rope(x, (jnp.cos(ang), jnp.sin(ang))))[0, 0, 0]
  assert set(np.flatnonzero(np.abs(out) > 1e-7)) == {32, 96}
  np.testing.assert_allclose(out[[32, 96]], [0.995004, 0.099833], atol=1e-6)


def test_b37_unsupported_rope_type_raises():
  with pytest.raises(ValueError, match="yarn"):
    config_from_hf({**_QWEN3_06B, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}})


# ------------------------------------------------------------------------------------------------ B39
def test_b39_llama_gguf_qk_row_permutation():
  one = np.arange(8.0)[:, None]
  assert permute_rope_rows(one, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
  assert unpermute_rope_rows(permute_rope_rows(one, 1), 1)[:, 0].tolist() == list(range(8))
  two = np.arange(16.0)[:, None]
  assert permute_rope_rows(two, 2)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
  assert unpermute_rope_rows(permute_rope_rows(two, 2), 2)[:, 0].tolist() == list(range(16))
  # the llama inverse applied to already rotate-half (qwen) rows scrambles them: why it must not be applied there
  assert unpermute_rope_rows(one, 1)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# ------------------------------------------------------------------------------------------- B40 / B41 / B43
GRADING = [
    # B40 intervals and pairs ("ft" inside \left / \infty is never a unit)
    ("B40", "(2,\\infty)", "\\boxed{(2, \\infty)}", 1),
    ("B40", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3,\\frac{\\pi}{2})}", 1),
    ("B40", "(-\\infty, 0]", "\\boxed{(-\\infty,0]}", 1),
    ("B40", "(-\\infty, 0]", "\\boxed{(-\\infty,0)}", 0),
    ("B40", "[1,3)", "\\boxed{[1,3]}", 0),
    ("B40", "(-\\infty,-2)\\cup(2,\\infty)", "\\boxed{(-\\infty,-2)\\cup(2,\\infty)}", 1),
    ("B40", "(-\\infty,-2)\\cup(2,\\infty)", "\\boxed{(2,\\infty)}", 0),
    # B40 units, degrees, \dfrac / \tfrac, \text
    ("B40", "12", "\\boxed{12 \\text{ ft}}", 1),
    ("B40", "5", "\\boxed{5\\text{ cm}}", 1),
    ("B40", "2\\sqrt{3}", "\\boxed{2\\sqrt3\\text{ cm}^2}", 1),
    ("B40", "18.90", "\\boxed{\\$18.90}", 1),
    ("B40", "30", "\\boxed{30^\\circ}", 1),
    ("B40", "30", "\\boxed{30^{\\circ}}", 1),
    ("B40", "30", "\\boxed{30 \\text{ degrees}}", 1),
    ("B40", "30", "\\boxed{30°}", 1),  # the recommended answer (math-verify 0.9.0 says 0)
    ("B40", "\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1),
    ("B40", "\\frac{3}{4}", "\\boxed{\\tfrac34}", 1),
    ("B40", "\\frac{3}{4}", "\\boxed{0.75}", 1),
    ("B40", "\\text{Tuesday}", "\\boxed{\\text{Tuesday}}", 1),
    ("B40", "\\text{Tuesday}", "\\boxed{Wednesday}", 0),
    # B40 percent: the project's convention (docs/data.md): a percent sign is optional on either side, and
    # N% also equals N/100 (math-verify's reading), so 25\% = 25 = 0.25
    ("B40", "25\\%", "\\boxed{25\\%}", 1),
    ("B40", "25\\%", "\\boxed{25}", 1),
    ("B40", "25\\%", "\\boxed{0.25}", 1),
    ("B43", "20\\%", "\\boxed{20}", 1),
    ("B40", "25\\%", "\\boxed{26}", 0),
    ("B40", "25", "\\boxed{25\\%}", 1),
    # B41 multi-part answers: the whole set, in any order, nothing more or less
    ("B41", "1331, 1728", "\\boxed{1728}", 0),
    ("B41", "1331, 1728", "\\boxed{1728, 1331}", 1),
    ("B41", "1331, 1728", "\\boxed{1331, 1728, 2197}", 0),
    ("B41", "\\{1331, 1728\\}", "\\boxed{1728}", 0),
    ("B41", "\\{1331, 1728\\}", "\\boxed{1728, 1331}", 1),
    ("B41", "\\{1331, 1728\\}", "\\boxed{1331, 1728, 2197}", 0),
    ("B41", "1331 \\text{ and } 1728", "\\boxed{1728}", 0),
    ("B41", "1331 \\text{ and } 1728", "\\boxed{1728, 1331}", 1),
    ("B41", "1331 \\text{ and } 1728", "\\boxed{1331, 1728, 2197}", 0),
    ("B41", "(1,2)", "\\boxed{(2,1)}", 0),
    ("B41", "(1,2)", "\\boxed{(1,2)}", 1),
    ("B41", "1331 and 1728", "\\boxed{1728}", 0),  # plain-text gold: math-verify 0.9.0 says 1 here
    # B43 a first thousands group must start with 1-9
    ("B43", "125", "\\boxed{0,125}", 0),
    ("B43", "1125", "\\boxed{1,125}", 1),
    ("B43", "12345", "\\boxed{12,345}", 1),
    ("B43", "-1234.5", "\\boxed{-1,234.5}", 1),
]


@pytest.mark.parametrize("case,gold,pred,expected", GRADING, ids=[f"{c[0]}-{i}" for i, c in enumerate(GRADING)])
def test_grading_cases(case, gold, pred, expected):
  del case
  assert math_reward(pred, gold) == float(expected)
  assert math_reward(f"Reasoning first. {pred}", gold) == float(expected)  # the box inside a response


def test_b41_gold_comes_first():
  """math_reward(response, ground_truth) takes the response first and extracts an answer from it only; the gold is
  never searched for a box. A subset or superset prediction is wrong."""
  assert math_reward("\\boxed{1331, 1728, 2197}", "1331, 1728") == 0.0
  assert math_reward("\\boxed{1728}", "1331, 1728") == 0.0
  assert math_reward("1331, 1728", "\\boxed{1728}") == 0.0  # no box and no answer phrase in the "response"
  assert math_reward("\\boxed{1728, 1331}", "1331, 1728") == 1.0
