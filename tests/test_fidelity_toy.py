"""The exact gradient-fidelity toy (minpro_jax/lab/fidelity_toy.py): exact J and grad J against Monte Carlo, the
gradient-only entry point against jax.grad of each loss, and the metrics by hand."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.lab import fidelity_run as fr
from minpro_jax.lab import fidelity_structure as fs
from minpro_jax.lab import fidelity_toy as ft
from minpro_jax.rl.advantages import group_advantages


def _toy(horizon=6, vocab=4, seed=0, bias=1.5):
  key = jax.random.PRNGKey(seed)
  correct = ft.random_correct_sets(jax.random.fold_in(key, 1), horizon, vocab, 2)
  return ft.init_logits(jax.random.fold_in(key, 2), correct, bias), correct


def test_exact_return_brute_force_and_monte_carlo():
  theta, correct = _toy(horizon=4, vocab=3)
  # Brute force over all 3^4 responses.
  grid = np.stack(np.meshgrid(*[np.arange(3)] * 4, indexing="ij"), -1).reshape(-1, 4)
  p = np.exp(np.asarray(ft.token_logp(theta, jnp.asarray(grid, jnp.int32))).sum(1))
  assert p.sum() == pytest.approx(1.0, abs=1e-5)
  for tol in (0, 1, 2):
    r = np.asarray(ft.rewards(jnp.asarray(grid, jnp.int32), correct, tol))
    assert float(ft.exact_return(theta, correct, tol)) == pytest.approx(float(p @ r), abs=1e-6)
  # Monte Carlo on a longer toy: within 4 standard errors.
  theta, correct = _toy(horizon=12)
  toks = ft.sample(jax.random.PRNGKey(3), theta, 20_000)
  r = np.asarray(ft.rewards(toks, correct, 2))
  j = float(ft.exact_return(theta, correct, 2))
  assert 0.1 < j < 0.9
  assert abs(r.mean() - j) < 4 * r.std() / np.sqrt(r.size)


def test_on_policy_reinforce_mean_is_grad_j():
  """RLOO advantages with a sequence-sum loss through `policy_loss` is unbiased for grad J on-policy."""
  theta, correct = _toy(horizon=4, vocab=3, bias=1.0)
  tol, num, batches = 0, 16, 600
  method = ft.Method("reinforce", "cispo", (("loss_agg_mode", "seq-mean-token-sum"),))

  @jax.jit
  @jax.vmap
  def estimate(key):
    toks = ft.sample(key, theta, num)
    adv = group_advantages(ft.rewards(toks, correct, tol), jnp.zeros(num, jnp.int32), mode="rloo")
    return ft.gradient_estimates(theta, toks, ft.token_logp(theta, toks), adv, (method,))[0][0]

  g = np.asarray(estimate(jax.random.split(jax.random.PRNGKey(0), batches))).reshape(batches, -1)
  g_star = np.asarray(jax.grad(ft.exact_return)(theta, correct, tol)).reshape(-1)
  se = g.std(0, ddof=1) / np.sqrt(batches)
  z = (g.mean(0) - g_star)[se > 0] / se[se > 0]
  assert np.max(np.abs(z)) < 4.5
  assert np.abs(g_star).max() > 10 * se.max()  # the test has the power to see a wrong gradient
  # The check has power: an estimate 20 % too large fails it.
  assert np.max(np.abs((1.2 * g.mean(0) - g_star)[se > 0] / se[se > 0])) > 4.5


def test_gradient_entry_point_equals_grad_of_each_loss():
  """One VJP with every method's coefficients vmapped == -jax.grad of each method's loss w.r.t. theta."""
  theta, _ = _toy(horizon=5, vocab=3)
  mu = theta + 0.3 * jax.random.normal(jax.random.PRNGKey(7), theta.shape)
  toks = ft.sample(jax.random.PRNGKey(8), mu, 8)
  blogp = ft.token_logp(mu, toks)
  adv = jax.random.normal(jax.random.PRNGKey(9), (8,))
  none = ft.Method("minpro:none", "minpro", (("prefix_statistic", "none"),))
  methods = ft.METHODS + (none,)
  grads, w = jax.jit(lambda th: ft.gradient_estimates(th, toks, blogp, adv, methods))(theta)
  assert grads.shape == (len(methods),) + theta.shape and w.shape == (len(methods), 8, 5)

  def grad_of_loss(th):
    return jnp.stack(
        [jax.grad(lambda t: -ft.method_loss(m, ft.token_logp(t, toks), blogp, adv).loss)(th) for m in methods]
    )

  want = jax.jit(grad_of_loss)(theta)
  for i, m in enumerate(methods):
    np.testing.assert_allclose(grads[i], want[i], rtol=1e-5, atol=1e-7, err_msg=m.name)
    assert float(jnp.abs(want[i]).max()) > 0, m.name
  np.testing.assert_array_equal(grads[-1], grads[ft.METHOD_NAMES.index("cispo")])  # minpro "none" == cispo
  assert not np.allclose(grads[0], grads[ft.METHOD_NAMES.index("minpro:prod")])
  # sequence-level IS: every token of a response carries exp(sum_t l_t).
  seq_w = np.exp(np.asarray(ft.token_logp(theta, toks) - blogp).sum(1))
  np.testing.assert_allclose(w[ft.METHOD_NAMES.index("seq_is")], np.repeat(seq_w[:, None], 5, 1), rtol=1e-5)


def test_ess_by_hand():
  w = jnp.asarray([[1.0, 0.0, 2.0], [3.0, 0.0, 2.0]])  # [N=2, P=3]
  np.testing.assert_allclose(ft.ess(w, axis=0), [16 / (2 * 10), 0.0, 1.0])


def test_summarize_by_hand():
  with pytest.raises(ValueError, match="at least 2 batches"):
    ft.summarize(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 2)), np.ones(2))
  proj = np.asarray([[1.0], [3.0]])  # a per batch
  sq = np.asarray([[2.0], [10.0]])  # b per batch
  g_star = np.asarray([1.0, 0.0])
  mean_grad = np.asarray([[2.0, 0.0]])  # the estimates were (1, 1) and (3, -1): a = 1, 3 and b = 2, 10
  s = ft.summarize(proj, sq, mean_grad, g_star)
  assert s["projection"] == [2.0]
  assert s["eta"] == [pytest.approx((2.0**2 - 2.0 / 2) / 6)]  # ((E a)^2 - var(a) / R) / E b, var(1, 3) = 2
  assert ft.summarize(-proj, sq, -mean_grad, g_star)["eta"] == [pytest.approx(-0.5)]  # signed: a descent direction
  assert ft.summarize(proj - 2.0, sq, mean_grad, g_star)["eta"] == [0.0]  # E a = 0 exactly
  # E a = 0.5 within its SE: (0.5^2 - var(-1, 2) / 2) / 6 = (0.25 - 2.25) / 6, not clipped at 0 (issue 55)
  assert ft.summarize(np.asarray([[-1.0], [2.0]]), sq, mean_grad, g_star)["eta"] == [pytest.approx(-1 / 3)]
  assert np.isnan(ft.summarize(0 * proj, 0 * sq, 0 * mean_grad, g_star)["eta"][0])  # every estimate 0
  # tr Cov = sum of the per-coordinate sample variances: var(1, 3) + var(1, -1) = 2 + 2.
  assert s["trace_cov"] == [pytest.approx(4.0)]
  # |E g|^2 debiased: 4 - 4 / 2 = 2, so cos = 2 / sqrt(2) (over 1: the debiasing is loose at R = 2).
  assert s["bias_cos"] == [pytest.approx(2 / np.sqrt(2))]
  assert s["eta_diff_low"] == s["eta_diff_high"] == [0.0]  # against itself (reference 0)


@pytest.mark.parametrize(
    "flag",
    [
        "--T=3",
        "--T=16,x",
        "--drifts=s200",
        "--drifts=fp8",
        "--drifts=lag0",
        "--tolerances=E1",
        "--batches=1",
        "--seeds=-1",
        "--structures=c4i",
        "--structures=c1x",
    ],
)
def test_runner_bad_flags_exit_2(flag, tmp_path, capsys):
  assert fr.main([f"--out={tmp_path}", flag]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1
  assert not list(tmp_path.iterdir())


def test_report_fills_the_doc_between_markers(tmp_path):
  out = tmp_path / "cells"
  out.mkdir()

  def cell(drift, seed, eta_of):
    methods = {
        m: {
            "eta": eta_of(i),
            "eta_diff_low": 0.01 if m == "minpro:min" else -1.0,
            "eta_diff_high": 1.0,
            "weight_mean": [1.0],
            "weight_q05": [0.5],
            "weight_q95": [2.0],
            "ess": [0.9],
        }
        for i, m in enumerate(ft.METHOD_NAMES)
    }
    r = {"T": 16, "tolerance": 0, "drift": drift, "seed": seed, "J_pi": 0.5, "J_mu": 0.3, "log_ratio_seq_sd": 1.0}
    (out / f"{fr.cell_name(16, 'E0', drift, seed)}.json").write_text(
        json.dumps({**r, "positions": [0], "methods": methods})
    )

  for seed in (0, 1):
    cell("s0", seed, lambda i: 0.5)
    cell("s32", seed, lambda i, seed=seed: 0.1 * (i + 1) + seed)
  doc = tmp_path / "doc.md"
  doc.write_text(f"intro\n{fr.BEGIN}\nstale\n{fr.END}\noutro\n")
  assert fr.main([f"--out={out}", "--report", f"--doc={doc}"]) == 0
  text = doc.read_text()
  assert text.startswith("intro\n") and text.endswith(f"{fr.END}\noutro\n") and "stale" not in text
  # eta / on-policy eta: minpro:min's 0.1 and 1.1 over 0.5 are 0.2 and 2.2: mean 1.2, SE 1.
  assert "| minpro:min | 1.2 ±1 |" in text
  # (eta(min) - eta(cispo)) / on-policy eta = (0.1 - 0.5) / 0.5 in both seeds, whose paired intervals are above 0.
  assert "| s32, E0 | -0.8 (2↑ 0↓ /2) |" in text
  assert fr.main([f"--out={out}", "--report", f"--doc={doc}"]) == 0 and doc.read_text() == text  # idempotent
  assert (out / "summary.md").exists() and (out / "eta_by_T.png").exists()


def test_calibrated_start_and_adam_trajectory():
  key = jax.random.PRNGKey(0)
  correct = ft.random_correct_sets(key, 8, 4, 2)
  assert correct.sum(1).tolist() == [2] * 8
  bias = ft.calibrate_bias(key, correct, 1, 0.01)
  theta0 = ft.init_logits(key, correct, bias)
  assert float(ft.exact_return(theta0, correct, 1)) == pytest.approx(0.01, rel=1e-3)
  thetas, k, returns = ft.adam_trajectory(theta0, correct, 1, lr=0.05, keep=4, min_steps=10, stop_return=0.5)
  assert k >= 10 and returns[-1] >= 0.5 > max(returns[:-1]) and len(returns) == k + 1 and len(thetas) == 5
  assert float(ft.exact_return(thetas[-1], correct, 1)) == pytest.approx(returns[-1])
  assert np.all(np.diff(returns) > 0)  # exact-gradient ascent with a small step


# ------------------------------------------------------------------------------------------------ structures (issue 55)
def test_the_dependent_structure_moves_with_the_previous_token():
  one = np.asarray(ft.correct_sets(None, 5, 6, 1, dependent=True))
  t, prev, nxt = np.meshgrid(np.arange(5), np.arange(6), np.arange(6), indexing="ij")
  np.testing.assert_array_equal(one, nxt == (prev + t) % 6)  # x_t correct iff x_t = (x_{t-1} + t) mod V
  three = np.asarray(ft.correct_sets(None, 5, 6, 3, dependent=True))
  assert np.all(three.sum(-1) == 3) and np.all(three[one])
  indep = np.asarray(ft.correct_sets(jax.random.PRNGKey(0), 5, 6, 2, dependent=False))
  assert np.all(indep.sum(-1) == 2) and np.all(indep == indep[:, :1, :])  # the same set after every prev
  toks = jnp.asarray([[0, 1, 3, 0], [1, 2, 4, 1]], jnp.int32)  # row 0: 0, 0+1, 1+2, 3+3 = 0: all correct
  np.testing.assert_array_equal(
      ft.correct_tokens(toks, ft.correct_sets(None, 4, 6, 1, True)), [[1, 1, 1, 1], [0, 1, 1, 1]]
  )
  assert fs.parse_structure("c1d", 6) == (1, True) and fs.parse_structure("c3i", 6) == (3, False)
  with pytest.raises(ValueError, match="c<k>i or c<k>d with 1 <= k <= 3"):
    fs.parse_structure("c4d", 6)


@pytest.mark.parametrize("num_correct,dependent", [(1, True), (3, True), (1, False), (2, False)])
def test_exact_return_of_each_structure_against_brute_force_and_monte_carlo(num_correct, dependent):
  key = jax.random.PRNGKey(num_correct + 10 * dependent)
  small = ft.correct_sets(key, 4, 4, min(num_correct, 2), dependent)
  theta = ft.init_logits(jax.random.fold_in(key, 1), small, 1.0)
  grid = np.stack(np.meshgrid(*[np.arange(4)] * 4, indexing="ij"), -1).reshape(-1, 4)
  p = np.exp(np.asarray(ft.token_logp(theta, jnp.asarray(grid, jnp.int32))).sum(1))
  for tol in (0, 1):
    r = np.asarray(ft.rewards(jnp.asarray(grid, jnp.int32), small, tol))
    assert float(ft.exact_return(theta, small, tol)) == pytest.approx(float(p @ r), abs=1e-6)
  correct = ft.correct_sets(key, 12, 6, num_correct, dependent)
  for tol in (0, 1):
    bias = ft.calibrate_bias(jax.random.fold_in(key, 2), correct, tol, 0.3)
    theta = ft.init_logits(jax.random.fold_in(key, 2), correct, bias)
    r = np.asarray(ft.rewards(ft.sample(jax.random.PRNGKey(7), theta, 20_000), correct, tol))
    j = float(ft.exact_return(theta, correct, tol))
    assert j == pytest.approx(0.3, rel=2e-3)
    assert abs(r.mean() - j) < 4 * r.std() / np.sqrt(r.size)  # 4 standard errors: ~0.013


def test_per_token_drift_exact_against_monte_carlo_and_matched():
  key = jax.random.PRNGKey(3)
  correct = ft.correct_sets(key, 8, 6, 1, True)
  pi = ft.init_logits(key, correct, 2.0)
  mu = pi + 0.4 * fs.noise_of(0, pi.shape)
  toks = ft.sample(jax.random.PRNGKey(4), mu, 20_000)
  per_response = np.abs(np.asarray(ft.token_logp(pi, toks) - ft.token_logp(mu, toks))).mean(1)
  exact = float(ft.token_abs_log_ratio(pi, mu))
  assert abs(per_response.mean() - exact) < 4 * per_response.std() / np.sqrt(per_response.size)
  assert float(ft.token_abs_log_ratio(pi, pi)) == 0.0
  sigma, got = fs.matched_noise(pi, fs.noise_of(0, pi.shape), 0.05)
  assert got == pytest.approx(0.05, rel=1e-3) and 0 < sigma < 0.4
  thetas = [pi + s * fs.noise_of(1, pi.shape) for s in (0.3, 0.2, 0.1, 0.0)]  # the trajectory, pi last
  drifts = [float(ft.token_abs_log_ratio(pi, th)) for th in thetas[::-1]]
  k, d = fs.matched_lag(pi, thetas, 0.5 * (drifts[1] + drifts[2]) + 1e-4)
  assert (k, d) == (2, pytest.approx(drifts[2]))


def test_weight_split_by_hand():
  ok = jnp.asarray([[1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 0, 1]], bool)
  reward = jnp.asarray([1.0, 0.0, 0.0])
  w = jnp.asarray([[[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]])  # one method
  sums, tokens = ft.weight_split(w, ok, reward)
  # success: 1+2+3+4; failed up to and including the first error: 5+6, 9; after it: 7+8, 10+11+12
  np.testing.assert_allclose(sums, [[10.0, 20.0, 48.0]])
  np.testing.assert_allclose(tokens, [4.0, 3.0, 5.0])
  means, share = fs.split_means(np.asarray(np.tile(sums, (len(ft.METHOD_NAMES), 1))), np.asarray(tokens))
  np.testing.assert_allclose(means["cispo"], [2.5, 20 / 3, 9.6], rtol=1e-6)
  np.testing.assert_allclose(share, [4 / 12, 3 / 12, 5 / 12])


def test_truth_error_intervals_reduce_to_the_batch_bootstrap_and_widen_with_a_noisy_truth():
  """Tier B's eta intervals with the truth's own error (issue 55): with identical truth chunks they are
  `summarize`'s (the same batch draws); chunks that scatter around the same mean widen them."""
  rng = np.random.default_rng(0)
  r, m, d, c = 24, 3, 50, 4
  g_star = rng.normal(size=d)
  g = g_star[None, None] * np.asarray([1.0, 0.5, 0.1])[None, :, None] + rng.normal(size=(r, m, d)) * 2.0
  same = np.tile(g_star, (2 * c, 1))
  norm2 = float(g_star @ g_star)
  base = ft.summarize(g @ g_star / norm2, np.sum(g * g, -1) / norm2, g.mean(0), g_star, seed=3)
  flat = ft.truth_error_intervals(g @ same.T, np.sum(g * g, -1), same @ same.T, seed=3)
  for k in ("eta_low", "eta_high", "eta_diff_low", "eta_diff_high"):
    np.testing.assert_allclose(flat[k], base[k], rtol=1e-9, atol=1e-12)
  assert flat["truth_undefined"] == 0.0
  noisy = g_star[None] + rng.normal(size=(2 * c, d)) * 1.5  # the halves agree to cos ~0.6
  wide = ft.truth_error_intervals(g @ noisy.T, np.sum(g * g, -1), noisy @ noisy.T, seed=3)
  assert all(
      w1 - w0 > b1 - b0 for w0, w1, b0, b1 in zip(wide["eta_low"], wide["eta_high"], flat["eta_low"], flat["eta_high"])
  )
  lost = rng.normal(size=(2 * c, d))  # a truth of noise alone: <g_A, g_B> <= 0 in many resamples, no interval
  none = ft.truth_error_intervals(g @ lost.T, np.sum(g * g, -1), lost @ lost.T, seed=3)
  assert none["truth_undefined"] > 0.025 and none["eta_low"] == [None] * m


def test_structure_report_tables_and_block(tmp_path):
  out = tmp_path / "cells"
  out.mkdir()
  for structure in ("c3i", "c1d"):
    for seed in (0, 1):
      for drift, eta in (("s0", 0.5), ("lag0.05", 0.25 + 0.05 * seed)):
        methods = {
            m: {
                "eta": eta * (1.2 if m == "minpro:min" and structure == "c1d" else 1.0),
                "eta_diff_low": 0.01,
                "eta_diff_high": 0.2,
            }
            for m in ft.METHOD_NAMES
        }
        split = {m: [1.0, 0.9, 0.2 if (m == "minpro:min" and structure == "c1d") else 0.8] for m in ft.METHOD_NAMES}
        r = {
            "structure": structure,
            "T": 16,
            "tolerance": 0,
            "drift": drift,
            "seed": seed,
            "J_pi": 0.5,
            "J_mu": 0.4,
            "log_ratio_seq_sd": 1.0,
            "abs_log_ratio_token": 0.05 if drift != "s0" else 0.0,
            "methods": methods,
            "weight_split": split,
            "split_token_share": [0.5, 0.2, 0.3],
        }
        (out / f"{fr.cell_name(16, 'E0', drift, seed, structure)}.json").write_text(json.dumps(r))
  doc = tmp_path / "doc.md"
  doc.write_text(f"a\n<!-- {fr.STRUCTURE_BLOCK}:begin (x) -->\nold\n<!-- {fr.STRUCTURE_BLOCK}:end -->\nb\n")
  assert fr.main([f"--out={out}", "--report", f"--doc={doc}"]) == 0
  text = doc.read_text()
  assert "old" not in text and "c1d: 1 of 6 tokens correct per position, set by the previous token; lag0.05, E0" in text
  # eta / on-policy eta of minpro:min in c1d: 1.2 * (0.25, 0.30) / (0.6, 0.6): 0.5 and 0.6
  assert "| minpro:min | 0.55 ±0.05 |" in text and "| *per-token abs log ratio* | 0.050 |" in text
  assert "| lag0.05, T=16, E0 | 0.050 | 1.00 / 0.90 / 0.20 | 1.00 / 0.90 / 0.80 |" in text
  assert (out / "summary.md").read_text().count("| seq_is |") == 2 * 1  # every method in summary.md, per structure
