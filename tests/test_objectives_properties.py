"""Property tests: prefix_log_factor and the MinPRO loss vs a deliberately naive per-token Python loop.

Random shapes, right/left padding, masked holes, packed segments (with padding segments and prompt gaps),
extreme log-ratios (+-100), NaN garbage at masked positions, all statistics; everything jitted, gradients
via jax.grad. Shapes come from a small fixed set so that jit compiles only a few times.
"""

import math

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minpro_jax.rl.objectives import policy_loss, prefix_log_factor

STATS = ("none", "min", "mean", "geomean", "prod")
SHAPES = ((1, 1), (3, 7), (4, 16))
SETTINGS = settings(max_examples=40, deadline=None)


def naive_prefix(lr, valid, seg, stat):
  """Per-token loop in float64 over the strictly preceding valid tokens of the same segment."""
  b, t = lr.shape
  out = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      if not valid[i, j]:
        continue
      k = j - 1
      prev = []
      while k >= 0 and (seg is None or seg[i, k] == seg[i, j]):
        if valid[i, k]:
          prev.append(float(lr[i, k]))
        k -= 1
      if not prev or stat == "none":
        continue
      if stat == "min":
        out[i, j] = min(prev)
      elif stat == "prod":
        out[i, j] = math.fsum(prev)
      elif stat == "geomean":
        out[i, j] = math.fsum(prev) / len(prev)
      else:
        m = max(prev)
        out[i, j] = m + math.log(math.fsum(math.exp(p - m) for p in prev)) - math.log(len(prev))
  return out


def make_batch(seed, shape, layout, extreme):
  rng = np.random.default_rng(seed)
  b, t = shape
  lr = rng.normal(0, 0.5, shape)
  if extreme:
    hit = rng.random(shape) < 0.3
    lr = np.where(hit, rng.choice([-100.0, 100.0, -60.0, 95.0], shape), lr)
  seg = None
  if layout == "packed":
    seg = np.zeros(shape, np.int32)
    valid = np.zeros(shape, bool)
    for i in range(b):
      pos, sid = 0, 1
      while pos < t:
        n = int(rng.integers(1, t + 1))
        this = 0 if rng.random() < 0.2 else sid  # some padding runs
        seg[i, pos : pos + n] = this
        prompt = int(rng.integers(0, n))  # prompt gap inside the segment
        valid[i, pos + prompt : pos + n] = this != 0
        valid[i, pos : pos + n] &= rng.random(min(n, t - pos)) < 0.9
        pos, sid = pos + n, sid + int(rng.integers(1, 3))
  else:
    lengths = rng.integers(0, t + 1, b)
    valid = np.arange(t)[None] < lengths[:, None]
    if layout == "left":
      valid = valid[:, ::-1]
    elif layout == "holes":
      valid = rng.random(shape) < 0.6
  lr_garbage = np.where(valid, lr, np.nan).astype(np.float32)
  return lr_garbage, lr.astype(np.float32).astype(np.float64), valid, seg


_prefix = jax.jit(prefix_log_factor, static_argnames="statistic")


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    shape=st.sampled_from(SHAPES),
    stat=st.sampled_from(STATS),
    layout=st.sampled_from(["right", "left", "holes", "packed"]),
    extreme=st.booleans(),
)
def test_prefix_log_factor_matches_naive_loop(seed, shape, stat, layout, extreme):
  lr, lr64, valid, seg = make_batch(seed, shape, layout, extreme)
  got = np.asarray(_prefix(lr, valid, statistic=stat, segment_ids=seg))
  ref = naive_prefix(lr64, valid if seg is None else valid & (seg != 0), seg, stat)
  assert got.dtype == np.float32 and np.all(np.isfinite(got))
  scale = 1.0 + np.abs(np.where(valid, lr64, 0)).sum(axis=1, keepdims=True)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * scale.max())
  assert np.all(got[~valid] == 0.0)


def _make_minpro(stat, eps_low, cap, mode, packed):
  def f(logp, old, adv, valid, seg):
    return policy_loss(
        "minpro",
        logp,
        old,
        adv,
        valid,
        segment_ids=seg if packed else None,
        prefix_statistic=stat,
        eps_low=eps_low,
        prefix_cap_at_one=cap,
        loss_agg_mode=mode,
    )

  return jax.jit(jax.value_and_grad(lambda *a: (lambda o: (o.loss, o))(f(*a)), has_aux=True))


_CACHE = {}


# (statistic, eps_low, prefix_cap_at_one, loss_agg_mode): every option appears, few jit compiles.
COMBOS = [
    (s, (None, 0.2)[i % 2], i in (1, 4), ("token-mean", "seq-mean-token-mean")[i // 3 % 2]) for i, s in enumerate(STATS)
]


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    combo=st.sampled_from(COMBOS),
    layout=st.sampled_from(["right", "left", "packed"]),
    extreme=st.booleans(),
)
def test_minpro_loss_and_grad_match_naive_loop(seed, combo, layout, extreme):
  stat, eps_low, cap, mode = combo
  shape = SHAPES[-1]
  lr, lr64, valid, seg = make_batch(seed, shape, layout, extreme)
  rng = np.random.default_rng(seed + 1)
  old = rng.uniform(-5, -0.01, shape).astype(np.float32)
  logp = np.where(valid, old + np.nan_to_num(lr), np.inf).astype(np.float32)  # garbage (+inf) where masked
  adv = np.where(valid, rng.normal(size=shape), np.nan).astype(np.float32)
  packed = seg is not None
  key = (stat, eps_low, cap, mode, packed)
  if key not in _CACHE:
    _CACHE[key] = _make_minpro(*key)
  seg_in = seg if packed else np.ones(shape, np.int32)
  (loss, out), grad = _CACHE[key](logp, old, adv, valid, seg_in)

  v = valid if seg is None else valid & (seg != 0)
  lr_exact = np.where(v, logp.astype(np.float64) - old, 0.0)
  log_f = naive_prefix(lr_exact, v, seg, stat)
  if cap:
    log_f = np.minimum(log_f, 0.0)
  lo = -np.inf if eps_low is None else math.log1p(-eps_low)
  w = np.where(v, np.exp(np.clip(log_f + lr_exact, lo, math.log1p(0.28))), 0.0)
  a = np.where(v, adv, 0.0).astype(np.float64)
  lp = np.where(v, logp, 0.0).astype(np.float64)
  tok = -w * a * lp
  # naive aggregation: sequences are rows, or runs of equal segment id
  seq_of = np.zeros(shape, np.int64)
  for i in range(shape[0]):
    for j in range(shape[1]):
      new = j == 0 or (seg is not None and seg[i, j] != seg[i, j - 1])
      seq_of[i, j] = (seq_of[i, j - 1] if j else i * 10_000) + (1 if new and j else 0)
  if mode == "token-mean":
    denom = v.sum()
    ref_loss = tok.sum() / max(denom, 1)
    ref_grad = -w * a / max(denom, 1)
  else:
    ids = np.unique(seq_of[v])
    denom = len(ids)
    counts = {s: (v & (seq_of == s)).sum() for s in ids}
    per_tok_count = np.vectorize(lambda s: counts.get(s, 1))(seq_of)
    ref_loss = (tok / per_tok_count).sum() / max(denom, 1)
    ref_grad = -w * a / per_tok_count / max(denom, 1)
  np.testing.assert_allclose(out.denominator, denom)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out.token_weights, w, rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=2e-4, atol=1e-6)
  assert np.all(np.asarray(grad)[~v] == 0.0)
