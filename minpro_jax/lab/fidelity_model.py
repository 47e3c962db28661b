"""Gradient fidelity on the real (tiny) transformer (issue 38, part 1, Tier B; docs/mechanism.md).

    python -m minpro_jax.lab.fidelity_model --out=results/fidelity_model                # the default plan, resumable
    python -m minpro_jax.lab.fidelity_model --out=results/fidelity_model --report       # tables + plot, no runs
    python -m minpro_jax.lab.fidelity_model --setting=worked --seed=0 --out=results/fidelity_model_worked   # T ~ 70

The setting (`--setting`, `SETTINGS`) is the staleness study's at delay 0 (`configs/studies/mipu.py`'s fixed fields:
three-term chain_sum, answers of ~6 tokens, 8 updates per global step on 32 prompts x 8, lr 1e-4, GRPO) with an
fp32 sampler, seed 1 by default; ``worked`` puts the long-response study's task on top of it
(`configs/studies/minpro_long.py`: eight-term chain_sum, worked-step SFT target, 128 new tokens, answers of ~60
tokens, its learning rate).
A GRPO trajectory runs from the SFT warm start for k = `--updates` optimizer updates; the parameters at k (pi),
at k - s for each drift ``s<s>`` (mu) and Adam's second moments at k are kept under `<out>/trajectory/` (not
committed; a rerun reloads them). Then:

  * the truth g* = grad J(pi): two independent on-policy halves of `--truth-prompts` x 8 samples each, every
    half's gradient the sequence-sum REINFORCE estimate (cispo on-policy, `seq-mean-token-sum`, leave-one-out
    advantages: unbiased for grad J up to one constant), in chunks of `--chunk-prompts` prompts, each chunk's
    gradient kept; |g*|^2 is estimated without bias by <g_A, g_B> and <g, g*> by <g, (g_A + g_B) / 2> (g
    independent of both), and eta's intervals resample the truth's chunks within each half as well as the batches
    (`fidelity_toy.truth_error_intervals`: they carry the truth's own error, issue 55);
  * per drift, `--batches` batches of `--prompts` x 8 samples of mu, each scored by the learner at pi and given
    GRPO advantages, and every method of `fidelity_toy.METHODS` (the same objectives and hparams as Tier A) gets
    its estimate g = -dL/dtheta from one VJP (`minpro_jax.lab.policy_gradient`). The metrics are Tier A's
    (`fidelity_toy.summarize`, with |g*|^2 := <g_A, g_B>), once in the Euclidean metric and once in Adam's
    (inner products weighted by 1 / (sqrt(nu_hat) + eps), the optimizer's preconditioner at k); per response
    position the token weight's mean, 5/95 % quantiles and ESS; and each method's mean token weight on rewarded
    and on unrewarded responses (issue 55: does the real model look like Tier A's c3i or c1d toy?).

Each finished cell (drift) is one small JSON `<out>/<drift>.json`, written atomically last, skipped on a rerun; the
truth is `<out>/trajectory/truth.npz`. A killed run loses at most one batch: the truth keeps its running sums in
`<out>/trajectory/truth.partial.npz` after every chunk and a cell its accumulators in
`<out>/trajectory/<drift>.partial.npz` after every batch, and a rerun with the same plan goes on from there (the
batches' prompts and seeds are functions of (seed, drift, batch), so the result is the same as an unbroken run's).
The report is `minpro_jax.lab.fidelity_model_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax.config_lib import set_fields
from minpro_jax.config_lib.defaults import get_config
from minpro_jax.config_lib.files import load_module
from minpro_jax.lab import fidelity_model_report as fmr
from minpro_jax.lab import fidelity_toy as ft
from minpro_jax.lab.fidelity_run import REFERENCE, cpu_model, finite_or_none
from minpro_jax.lab.mipu_power import derived_seed, train_step
from minpro_jax.lab.policy_gradient import flatten, make_gradient_fn
from minpro_jax.lab.settings import SETTINGS, setting_overrides
from minpro_jax.rl import mipu
from minpro_jax.rl.advantages import group_advantages
from minpro_jax.rl.learner import LossConfig, UpdateInputs
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.study import results

FP8 = "fp8"  # the drift of an fp8 sampler at pi's weights (MIPU's mismatch), beside the s<s> drifts
TRUTH_CFG = LossConfig("cispo", (("loss_agg_mode", "seq-mean-token-sum"),))
_SALT_TRAIN, _SALT_TRUTH, _SALT_STALE = 1, 201, 202


@dataclasses.dataclass(frozen=True)
class Plan:
  """The study's sizes (module docstring); drifts ``s<s>`` with s a multiple of the updates per global step."""

  updates: int = 128
  drifts: tuple[str, ...] = ("s0", "s8", "s32", "s128")
  prompts: int = 8
  batches: int = 32
  truth_prompts: int = 256
  chunk_prompts: int = 32
  seed: int = 1
  setting: str = "short"


def positions(max_new_tokens: int) -> tuple[int, ...]:
  """The response positions reported: 0..7 for answers of up to 16 tokens, else 0, 1, 3, 7, ... (2^i - 1)."""
  if max_new_tokens <= 16:
    return tuple(range(min(8, max_new_tokens)))
  return tuple(2**i - 1 for i in range(max_new_tokens.bit_length()) if 2**i - 1 < max_new_tokens)


def loss_configs(temperature: float) -> tuple[LossConfig, ...]:
  """Tier A's methods (`fidelity_toy.METHODS`) as learner loss configs; ``seq_is`` reads `learner_logp` = pi's."""
  out = []
  for m in ft.METHODS:
    hp = m.hparams + ((("rollout_is", "sequence"), ("tis_cap", ft.SEQUENCE_IS_CAP)) if m.sequence_is else ())
    out.append(LossConfig(m.objective, hp, temperature=temperature))
  return tuple(out)


def study_config(workdir: str, seed: int, overrides: dict | None = None):
  """The MIPU study's fixed fields (GRPO at delay 0) with an fp32 sampler at `seed`, then `overrides`."""
  mipu_study = load_module("configs/studies/mipu.py")

  c = set_fields(get_config(), {**mipu_study.get_grid().fixed, "seed": seed, **(overrides or {})})
  c.workdir = workdir
  c.eval.every = 0
  return c


# ------------------------------------------------------------------------------------------------- trajectory
def _save(path: str, tree) -> None:
  leaves = jax.tree.leaves(tree)
  with open(path + ".tmp", "wb") as f:
    np.savez(f, *[np.asarray(x) for x in leaves])
  os.replace(path + ".tmp", path)


def _load(path: str, like):
  with np.load(path) as z:
    leaves = [jnp.asarray(z[f"arr_{i}"]) for i in range(len(z.files))]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def adam_nu(opt_state):
  """(nu, count) of the first `ScaleByAdamState` in an optax state (the learner's AdamW)."""
  for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "nu") and hasattr(x, "count")):
    if hasattr(s, "nu"):
      return s.nu, s.count
  raise ValueError("the optimizer state holds no Adam second moments (ScaleByAdamState)")


def trajectory(tr, state, plan: Plan, folder: str):
  """{drift: mu params}, pi params, Adam's nu_hat at k (params pytrees): loaded from `folder` or run and saved."""
  ups = tr.c.num_updates_per_step
  lags = {d: int(d[1:]) for d in plan.drifts if d != FP8}
  if plan.updates % ups or any(s % ups or s > plan.updates for s in lags.values()):
    raise ValueError(
        f"--updates ({plan.updates}) and every drift's s ({sorted(lags.values())}) must be multiples of "
        f"num_updates_per_step ({ups}) with s <= --updates"
    )
  os.makedirs(folder, exist_ok=True)
  keep = sorted({plan.updates - s for s in lags.values()} | {plan.updates})
  paths = {u: os.path.join(folder, f"params_{u}.npz") for u in keep}
  nu_path = os.path.join(folder, f"nu_hat_{plan.updates}.npz")
  if not all(os.path.exists(p) for p in [*paths.values(), nu_path]):
    step = 0
    if 0 in paths:
      _save(paths[0], state.params)
    while step * ups < plan.updates:
      state, r = train_step(tr, state, (step, _SALT_TRAIN))
      step += 1
      u = int(state.step)
      print(f"trajectory: update {u}, batch reward {r:.3f}", flush=True)
      if u in paths:
        _save(paths[u], state.params)
    nu, count = adam_nu(state.opt_state)
    b2 = tr.learner.opt_cfg.b2
    _save(nu_path, jax.tree.map(lambda v: v / (1.0 - b2 ** count.astype(jnp.float32)), nu))
  like = state.params
  params = {u: _load(p, like) for u, p in paths.items()}
  mus = {d: params[plan.updates - s] for d, s in lags.items()}
  if FP8 in plan.drifts:
    mus[FP8] = params[plan.updates]
  return mus, params[plan.updates], _load(nu_path, like)


# ------------------------------------------------------------------------------------------------- batches
_COLUMNS = ("tokens", "segment_ids", "positions", "response_mask", "behavior_logp", "learner_logp")


def fit_width(batch: RolloutBatch, length: int) -> RolloutBatch:
  """``batch`` without its columns that are padding in every row, right-padded to ``length`` columns (token 0,
  segment 0, no response), so that batches of every prompt bucket share one compiled program of the width the
  rows need. Raises ValueError when the rows need more than ``length``."""
  real = np.flatnonzero(np.any(batch.segment_ids != 0, axis=0))
  lo, hi = (int(real[0]), int(real[-1]) + 1) if real.size else (0, 0)
  if hi - lo > length:
    raise ValueError(f"rows of {hi - lo} columns exceed the fitted width {length}")
  fit = lambda a: np.pad(a[:, lo:hi], ((0, 0), (0, length - (hi - lo))))  # noqa: E731
  return batch.replace(**{f: fit(getattr(batch, f)) for f in _COLUMNS})


def draw(tr, params, pi_state, problems, seed: int, width: int) -> RolloutBatch:
  """Samples of `params` (the trainer's sampler), graded, GRPO advantages, scored by the learner at pi."""
  gen = tr.generate(params, problems, tr.sampling, seed, tr.c.group_size)
  batch, _, _ = tr.rollout(pi_state, gen, problems, tr.c.group_size)
  return fit_width(batch, width)


def _problems(tr, num: int, seed: int):
  return [tr.train_problems[i] for i in mipu.validation_indices(len(tr.train_problems), num, seed)]


def _partial_key(plan: Plan, *fields: str) -> str:
  """The plan fields a partial file was made with (a resumed loop must see the same draws)."""
  return json.dumps({f: getattr(plan, f) for f in ("seed", "updates", "setting", *fields)}, sort_keys=True)


def _load_partial(path: str, key: str) -> dict | None:
  """The arrays of the partial file `path` made with `key`, or None when there is none.

  Raises:
    ValueError: the file was made with another plan (naming both and the file to delete).
  """
  if not os.path.exists(path):
    return None
  with np.load(path) as z:
    got = {k: z[k] for k in z.files}
  if str(got["key"]) != key:
    raise ValueError(f"{path} was made with the plan {got['key']}, this run's is {key}: delete it or use that plan")
  return got


def _save_partial(path: str, **arrays) -> None:
  with open(path + ".tmp", "wb") as f:
    np.savez(f, **arrays)
  os.replace(path + ".tmp", path)


def truth(tr, pi_state, plan: Plan, grad_fn, width: int, path: str):
  """[2C, D] f64 the truth's chunk gradients (ascent directions; half A's C chunks first: g_A is the mean of the
  first C), the rewards' mean and the halves' size, from `path` or computed and saved; the chunks are kept after
  every one in `path` with ``.partial`` (a rerun goes on from there).

  Raises:
    ValueError: `path` is a truth from before issue 55 (its halves' sums only): delete it to recompute.
  """
  if os.path.exists(path):
    with np.load(path) as z:
      if "chunks" not in z.files:
        raise ValueError(f"{path} holds a truth from before issue 55 without its chunks: delete it to recompute")
      return z["chunks"], float(z["reward"]), int(z["samples"])
  chunks = plan.truth_prompts // plan.chunk_prompts
  partial_path = path.replace(".npz", ".partial.npz")
  key = _partial_key(plan, "truth_prompts", "chunk_prompts") + "+chunks"  # not a partial of the sums-only format
  p = _load_partial(partial_path, key)
  done = int(p["done"]) if p is not None else 0  # chunks finished over both halves
  kept = p["chunks"] if p is not None else None  # [2C, D] f64, the first `done` filled
  rewards = [p["rewards"]] if p is not None else []
  if done:
    print(f"truth: resuming after chunk {done} of {2 * chunks}", flush=True)
  for i in range(done, 2 * chunks):
    h, c = divmod(i, chunks)
    seed = derived_seed(plan.seed, _SALT_TRUTH, h, c)
    b = draw(tr, pi_state.params, pi_state, _problems(tr, plan.chunk_prompts, seed), seed + 1, width)
    adv = group_advantages(jnp.asarray(b.rewards), jnp.asarray(b.group_ids), mode="rloo")
    b = b.replace(behavior_logp=b.learner_logp, advantages=np.asarray(adv, np.float32))
    g = np.asarray(flatten(grad_fn(pi_state.params, UpdateInputs.of(b)).grads)[0], np.float64)
    if kept is None:
      kept = np.zeros((2 * chunks, g.size))
    kept[i] = -g  # an ascent direction
    rewards.append(np.asarray(b.rewards, np.float64))
    _save_partial(partial_path, key=key, done=i + 1, chunks=kept, rewards=np.concatenate(rewards))
    print(f"truth half {h}: chunk {c + 1}/{chunks}", flush=True)
  reward = float(np.mean(np.concatenate(rewards)))
  samples = plan.truth_prompts * tr.c.group_size
  np.savez(path + ".tmp.npz", chunks=kept, reward=reward, samples=samples)
  os.replace(path + ".tmp.npz", path)
  os.remove(partial_path)
  return kept, reward, samples


def _position_weights(weights: np.ndarray, mask: np.ndarray, pos) -> tuple[np.ndarray, np.ndarray]:
  """([M, N, P] the token weights at response positions `pos`, [N, P] whether the response reaches them)."""
  idx = np.cumsum(mask, axis=1) - 1  # response position of each column
  m, n, _ = weights.shape
  out, has = np.zeros((m, n, len(pos))), np.zeros((n, len(pos)), bool)
  for j, p in enumerate(pos):
    hit = mask & (idx == p)
    has[:, j] = hit.any(1)
    col = hit.argmax(1)
    out[:, :, j] = np.take_along_axis(weights, col[None, :, None], axis=2)[..., 0]
  return out, has


def _weight_summary(w: np.ndarray, has: np.ndarray) -> dict[str, list]:
  """Per position over the rows that reach it: mean, 5/95 % quantiles and the ESS fraction (sum w)^2/(n sum w^2)."""
  keys = ("weight_mean", "weight_q05", "weight_q95", "ess")
  out = {k: [] for k in keys}
  for j in range(w.shape[1]):
    x = w[has[:, j], j]
    if x.size == 0:
      for k in keys:
        out[k].append(None)
      continue
    s2 = float(np.sum(x * x))
    out["weight_mean"].append(float(x.mean()))
    out["weight_q05"].append(float(np.quantile(x, 0.05)))
    out["weight_q95"].append(float(np.quantile(x, 0.95)))
    out["ess"].append(float(np.sum(x) ** 2 / (x.size * s2)) if s2 > 0 else 0.0)
  return out


def _drift_id(drift: str) -> int:
  return 10_000 if drift == FP8 else int(drift[1:])


def run_cell(tr, pi_state, mu, plan: Plan, drift: str, grad_fn, width: int, chunks, precond, partial: str) -> dict:
  """One drift's record (JSON-ready): the metrics of every method in the Euclidean and Adam's metric, against the
  truth's chunk gradients `chunks` [2C, D]; ``tr``'s sampler draws the stale batches (for drift `FP8` a trainer
  with the fp8 sampler). The accumulators are kept in the file `partial` after every batch, and a call that finds
  it goes on from there."""
  t0 = time.time()
  half = len(chunks) // 2
  g_a, g_b = chunks[:half].mean(0), chunks[half:].mean(0)
  g_star = 0.5 * (g_a + g_b)
  metrics = {"euclid": (1.0, g_star, float(g_a @ g_b))}
  metrics["adam"] = (precond, precond * g_star, float((precond * g_a) @ (precond * g_b)))
  pos = positions(tr.c.sampling.max_new_tokens)
  key = _partial_key(plan, "prompts", "batches") + "+chunks"
  acc = _load_partial(partial, key)
  m_count, c_count = len(ft.METHODS), len(chunks)
  if acc is None:
    acc = {f"{x}_{k}": np.zeros((0, m_count)) for x in ("proj", "sq", "gsq") for k in metrics}
    acc.update({f"chunk_proj_{k}": np.zeros((0, m_count, c_count)) for k in metrics})
    acc.update(w_split=np.zeros((m_count, 2)), split_tokens=np.zeros(2))
    acc.update(gsum=0.0, weights=np.zeros((len(ft.METHODS), 0, len(pos))), reach=np.zeros((0, len(pos)), bool))
    acc.update({k: np.zeros(0) for k in ("rewards", "lr_seq", "response_tokens")}, done=0, seconds=0.0)
  done, before = int(acc["done"]), float(acc["seconds"])
  if done:
    print(f"{drift}: resuming after batch {done}/{plan.batches}", flush=True)
  for r in range(done, plan.batches):
    seed = derived_seed(plan.seed, _SALT_STALE, _drift_id(drift), r)
    b = draw(tr, mu, pi_state, _problems(tr, plan.prompts, seed), seed + 1, width)
    out = grad_fn(pi_state.params, UpdateInputs.of(b))
    g = -np.asarray(flatten(out.grads), np.float64)  # [M, D] ascent directions
    for k, (scale, gs, norm2) in metrics.items():
      gk = g * scale
      acc[f"proj_{k}"] = np.concatenate([acc[f"proj_{k}"], (gk @ gs / norm2)[None]])
      acc[f"sq_{k}"] = np.concatenate([acc[f"sq_{k}"], (np.sum(gk * gk, axis=1) / norm2)[None]])
      acc[f"gsq_{k}"] = np.concatenate([acc[f"gsq_{k}"], np.sum(gk * gk, axis=1)[None]])
      acc[f"chunk_proj_{k}"] = np.concatenate([acc[f"chunk_proj_{k}"], (gk @ (chunks * scale).T)[None]])
    acc["gsum"] = acc["gsum"] + g  # Adam's metric: precond * gsum
    tw, mask = np.asarray(out.token_weights, np.float64), np.asarray(b.response_mask, bool)
    rewarded = (np.asarray(b.rewards) > 0)[:, None] & mask
    for j, part in enumerate((rewarded, mask & ~rewarded)):
      acc["w_split"][:, j] += np.sum(np.where(part[None], tw, 0.0), axis=(1, 2))
      acc["split_tokens"][j] += part.sum()
    w, has = _position_weights(np.asarray(out.token_weights), b.response_mask, pos)
    acc["weights"], acc["reach"] = np.concatenate([acc["weights"], w], axis=1), np.concatenate([acc["reach"], has])
    lr_seq = np.sum(np.where(b.response_mask, b.learner_logp - b.behavior_logp, 0.0), axis=1)
    for name, v in (("rewards", b.rewards), ("lr_seq", lr_seq), ("response_tokens", b.response_mask.sum(1))):
      acc[name] = np.concatenate([acc[name], np.asarray(v, np.float64)])
    acc.update(done=r + 1, seconds=before + time.time() - t0, key=key)
    _save_partial(partial, **acc)
    if (r + 1) % 4 == 0:
      print(f"{drift}: batch {r + 1}/{plan.batches}, {before + time.time() - t0:.0f} s", flush=True)
  methods, undefined = {name: {} for name in ft.METHOD_NAMES}, {}
  for k, (scale, gs, norm2) in metrics.items():
    s = ft.summarize(
        acc[f"proj_{k}"],
        acc[f"sq_{k}"],
        acc["gsum"] * scale / plan.batches,
        gs,
        reference=REFERENCE,
        seed=plan.seed,
        g_star_norm2=norm2,
    )
    scale = metrics[k][0]
    gram = (chunks * scale) @ (chunks * scale).T
    s.update(
        ft.truth_error_intervals(acc[f"chunk_proj_{k}"], acc[f"gsq_{k}"], gram, reference=REFERENCE, seed=plan.seed)
    )
    undefined[k] = s.pop("truth_undefined")
    for i, name in enumerate(ft.METHOD_NAMES):
      methods[name].update({(f"{key}" if k == "euclid" else f"adam_{key}"): v[i] for key, v in s.items()})
  for i, name in enumerate(ft.METHOD_NAMES):
    methods[name].update(_weight_summary(acc["weights"][i], acc["reach"]))
    split = acc["w_split"][i] / np.maximum(acc["split_tokens"], 1.0)
    methods[name]["weight_rewarded"], methods[name]["weight_unrewarded"] = (float(x) for x in split)
  return {
      "drift": drift,
      "setting": plan.setting,
      "updates": plan.updates,
      "seed": plan.seed,
      "J_pi": None,  # filled by the caller (the truth draw's reward mean)
      "reward_mu": float(np.mean(acc["rewards"])),
      "log_ratio_seq_mean": float(acc["lr_seq"].mean()),
      "log_ratio_seq_sd": float(acc["lr_seq"].std()),
      "response_tokens_mean": float(acc["response_tokens"].mean()),
      "max_new_tokens": int(tr.c.sampling.max_new_tokens),
      "batches": plan.batches,
      "num": plan.prompts * tr.c.group_size,
      "group": tr.c.group_size,
      "positions": list(pos),
      "methods": methods,
      "interval": "bootstrap over batches and the truth's chunks within each half (issue 55)",
      "truth_undefined": undefined,  # the share of resamples whose halves had <g_A, g_B> <= 0, per metric
      "rewarded_token_share": float(acc["split_tokens"][0] / max(acc["split_tokens"].sum(), 1.0)),
      "seconds": round(before + time.time() - t0, 1),
      "date": datetime.date.today().isoformat(),
      "cpu": cpu_model(),
  }


def run(out: str, plan: Plan, overrides: dict | None = None) -> int:
  """Runs every drift of `plan` whose JSON is not yet in `out` (module docstring), with `overrides` on top of
  `plan.setting`'s config; returns 0."""
  from minpro_jax.run.trainer import Trainer  # heavy import, after the flags are checked

  overrides = {**setting_overrides(plan.setting), **(overrides or {})}
  os.makedirs(out, exist_ok=True)
  todo = [d for d in plan.drifts if not os.path.exists(os.path.join(out, f"{d}.json"))]
  if not todo:
    print("nothing to do", flush=True)
    return 0
  scratch = tempfile.mkdtemp(prefix="fidelity_model_")  # the trainers' workdirs, removed when the run ends
  try:
    tr = Trainer.from_config(study_config(scratch, plan.seed, overrides))
  except BaseException:
    shutil.rmtree(scratch, ignore_errors=True)
    raise
  try:
    state = tr.learner.init_state(nnx.split(tr.model)[1])
    folder = os.path.join(out, "trajectory")
    mus, pi, nu_hat = trajectory(tr, state, plan, folder)
    pi_state = types.SimpleNamespace(params=pi)  # what `Trainer.rollout` reads of a state
    width = max(len(tr.prompt_ids[p.id]) for p in tr.train_problems) + tr.c.sampling.max_new_tokens
    cfgs = loss_configs(tr.learner.loss_cfg.temperature)
    grad_fn = make_gradient_fn(tr.learner.graphdef, cfgs)
    truth_fn = make_gradient_fn(tr.learner.graphdef, (dataclasses.replace(TRUTH_CFG, temperature=cfgs[0].temperature),))
    chunks, j_pi, samples = truth(tr, pi_state, plan, truth_fn, width, os.path.join(folder, "truth.npz"))
    g_a, g_b = chunks[: len(chunks) // 2].mean(0), chunks[len(chunks) // 2 :].mean(0)
    eps = tr.learner.opt_cfg.eps
    precond = np.asarray(flatten(jax.tree.map(lambda v: (1.0 / (jnp.sqrt(v) + eps))[None], nu_hat))[0], np.float64)
    precond = np.sqrt(precond)  # scaling both vectors by sqrt(P) gives the inner product <a, P b>
    for drift in todo:
      sampler_tr = tr
      if drift == FP8:  # the MIPU study's fp8 sampler (its own trainer: the same warm start, data and learner)
        fp8 = {**overrides, **load_module("configs/studies/mipu.py").FP8, "sampling.precision": "fp8"}
        sampler_tr = Trainer.from_config(study_config(tempfile.mkdtemp(dir=scratch), plan.seed, fp8))
      try:
        partial = os.path.join(folder, f"{drift}.partial.npz")
        res = run_cell(sampler_tr, pi_state, mus[drift], plan, drift, grad_fn, width, chunks, precond, partial)
      finally:
        if sampler_tr is not tr:
          sampler_tr.close()
      res.update(
          J_pi=j_pi,
          truth_samples_per_half=samples,
          truth_cos=float(g_a @ g_b / np.sqrt((g_a @ g_a) * (g_b @ g_b))),
          g_star_norm2=float(g_a @ g_b),
          adam_truth_cos=float(
              (precond * g_a) @ (precond * g_b) / np.linalg.norm(precond * g_a) / np.linalg.norm(precond * g_b)
          ),
      )
      path = os.path.join(out, f"{drift}.json")
      with open(path + ".tmp", "w") as f:
        json.dump(finite_or_none(res), f, indent=None, separators=(",", ":"), allow_nan=False)
      os.replace(path + ".tmp", path)
      os.remove(partial)
      eta = {m: v["eta"] for m, v in res["methods"].items()}
      print(f"{drift}: {res['seconds']} s, eta min {eta['minpro:min']}, cispo {eta['cispo']}", flush=True)
  finally:
    tr.close()
    shutil.rmtree(scratch, ignore_errors=True)
  return 0


def main(argv=None) -> int:
  """The command line (module docstring); exit status 2 with one line `error: ...` for bad flags."""
  p = argparse.ArgumentParser(prog="python -m minpro_jax.lab.fidelity_model", description=__doc__.split("\n")[0])
  d = Plan()
  p.add_argument("--out", default="", help=f"the study's folder (default {results.committed('fidelity_model')})")
  p.add_argument("--updates", type=int, default=d.updates, help="k: optimizer updates of the GRPO trajectory")
  p.add_argument("--drifts", default=",".join(d.drifts), help="s<s>: mu = the parameters s updates before k; fp8")
  p.add_argument("--prompts", type=int, default=d.prompts, help="prompts (x group) per stale batch")
  p.add_argument("--batches", type=int, default=d.batches, help="stale batches per drift")
  p.add_argument("--truth-prompts", type=int, default=d.truth_prompts, help="prompts (x group) per truth half")
  p.add_argument("--chunk-prompts", type=int, default=d.chunk_prompts, help="prompts per VJP of the truth")
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--setting", default=d.setting, help=f"the task, one of {SETTINGS}")
  p.add_argument("--report", action="store_true", help="only write the tables and the plot")
  p.add_argument("--block", default=None, help="--report: the docs/mechanism.md block (default from --out)")
  p.add_argument("--compare", default="", help="--report: LABEL=DIR,... studies side by side (no --out report)")
  a = p.parse_args(argv)
  a.out = results.resolve(a.out or results.committed("fidelity_model"), "--out")
  if a.report:
    if a.compare:
      pairs = [x.partition("=") for x in a.compare.split(",") if x]
      if any(not lab or not sep or not path for lab, sep, path in pairs):
        print(f"error: --compare must list LABEL=DIR pairs, got {a.compare!r}", file=sys.stderr)
        return 2
      return fmr.compare_report({lab: path for lab, _, path in pairs})
    return fmr.report(a.out, block=a.block or fmr.block_of(a.out))
  if a.setting not in SETTINGS:
    print(f"error: --setting must be one of {SETTINGS}, got {a.setting!r}", file=sys.stderr)
    return 2
  drifts = tuple(x for x in a.drifts.split(",") if x)
  bad = [x for x in drifts if not (x[:1] == "s" and x[1:].isdigit()) and x != FP8]
  if bad or not drifts:
    print(f"error: --drifts must list s<s> (s >= 0 an integer) or {FP8}, got {a.drifts!r}", file=sys.stderr)
    return 2
  if a.batches < 2 or min(a.prompts, a.chunk_prompts, a.updates) < 1 or a.truth_prompts % a.chunk_prompts:
    print(
        "error: --batches >= 2, --prompts, --chunk-prompts, --updates >= 1, and --truth-prompts a multiple of "
        "--chunk-prompts",
        file=sys.stderr,
    )
    return 2
  plan = Plan(a.updates, drifts, a.prompts, a.batches, a.truth_prompts, a.chunk_prompts, a.seed, a.setting)
  return run(a.out, plan)


if __name__ == "__main__":
  raise SystemExit(main())
