"""The offline power study of MIPU's Step 2 (issue 38 part 2; docs/mechanism.md): can a rollback statistic tell an
update that lowered J(mu), the reward of the policy as served, from one that did not?

    python -m minpro_jax.study.mipu_power --out=results/mipu_power                 # the default plan, resumable
    python -m minpro_jax.study.mipu_power --out=results/mipu_power --report        # tables, no runs

The setting is the MIPU study's (`configs/studies/mipu.py`: staleness setting at delay 0, GRPO, seed 1, an fp8
e5m2 sampler with per-tensor weight and activation scales; the tiny default task, answers of ~6 tokens). A GRPO
trajectory runs from the SFT warm start; at each checkpoint step k of `--checkpoints`, `--candidates` updates
theta_k -> theta'_j each take one global step of updates (8 optimizer updates on a fresh 32 x 8 batch, each
candidate its own batch); the trajectory goes on with candidate 0. For every pair (theta_k, theta'):

  * the truth J(mu') - J(mu_k): the reward mean of `--truth` fp8 samples (one per prompt) at theta' minus that at
    theta_k, on the same prompts and sampler seed (a coupled draw), with its paired standard error;
  * one validation draw of `--val-prompts` x 8 samples at theta' and at theta_k on the same prompts and seed,
    scored by the learner at the same weights, split into disjoint sub-draws of n = 128, 512 and 2048 samples
    (16, 4 and 1 of them for the default 256 x 8); on each sub-draw the three statistics of `mipu.STATISTICS`:
    T_post = T(theta'), delta_t = T(theta') - T(theta_k), delta_j = J_hat(mu') - J_hat(mu_k), with their standard
    errors (`mipu.t_post_standard_error`, `mipu.paired_difference`).

The truth and the validation draws use different prompts' seeds. Each finished pair is one small JSON
`<out>/k<k>_u<j>.json` (written atomically, last), skipped on a rerun; a rerun replays the trajectory (every batch
is a function of the seed and the step) and computes only the missing pairs. The analysis is `mipu_power_report`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
from flax import nnx

from minpro_jax.config_lib import set_fields
from minpro_jax.config_lib.defaults import get_config
from minpro_jax.config_lib.files import load_module
from minpro_jax.rl import mipu
from minpro_jax.rl.aggregation import inference_gap_terms
from minpro_jax.study import results

CHECKPOINTS = (0, 6, 12, 18, 24)
CANDIDATES = 8
VAL_PROMPTS, VAL_GROUP = 256, 8  # one validation draw per pair: 2048 samples, split into sub-draws
SUB_SIZES = (128, 512, 2048)  # validation sizes n (samples); each a multiple of VAL_GROUP
TRUTH = 8192  # prompts of the truth draw, one sample each
SEED = 1
DECODE_ROWS = 256  # the continuous sampler's rows: 4x the CPU default, ~2x faster on these large draws
_SALT_TRAIN, _SALT_VAL, _SALT_TRUTH = 1, 101, 102


def study_config(workdir: str, seed: int = SEED):
  """The MIPU study's setting (its grid's fixed fields and fp8 options) with an fp8 sampler, at `seed`."""
  mipu_study = load_module("configs/studies/mipu.py")
  g = mipu_study.get_grid()
  c = set_fields(get_config(), {**g.fixed, "seed": seed, **mipu_study.FP8, "sampling.precision": "fp8"})
  c.workdir = workdir
  c.eval.every = 0
  c.sampling.decode_rows = DECODE_ROWS
  return c


def _seed(seed: int, *parts: int) -> int:
  return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0])


def train_step(tr, state, key: tuple[int, ...]):
  """One global step of GRPO updates on a fresh batch whose prompts and sampler seed are a function of `key`."""
  c = tr.c
  idx = mipu.validation_indices(len(tr.train_problems), c.prompts_per_step, _seed(c.seed, *key, 0))
  problems = [tr.train_problems[i] for i in idx]
  gen = tr._generate(state.params, problems, tr.sampling, _seed(c.seed, *key, 1), c.group_size)
  batch, _, _ = tr._rollout(state, gen, problems, c.group_size, score=tr.learner.loss_cfg.reads_learner_logp)
  state, m = tr.learn_step(state, batch)
  return state, float(batch.rewards.mean())


def draw(tr, params, problems, seed: int, group: int, score_state=None) -> dict[str, np.ndarray]:
  """One fp8 draw of `group` samples per problem at `params`: rewards, and with `score_state` (the learner state
  at the same params) the T terms (`inference_gap_terms`: -rho_i * A_i), their mask and the group ids."""
  gen = tr._generate(params, problems, tr.sampling, seed, group)
  if score_state is None:
    return {"rewards": np.asarray(tr.grade(gen, problems, group)[1], np.float64)}
  batch, _, _ = tr._rollout(score_state, gen, problems, group)
  tokens = np.where(gen.response_mask, gen.response_tokens, -1)  # to count the rows both draws share
  terms, has = inference_gap_terms(batch.learner_logp, batch.behavior_logp, batch.advantages, batch.response_mask)
  return {
      "rewards": np.asarray(batch.rewards, np.float64),
      "terms": np.asarray(terms, np.float64),
      "has": np.asarray(has, bool),
      "group_ids": np.asarray(batch.group_ids),
      "tokens": tokens,
  }


def statistics(new: dict, old: dict, rows: slice) -> dict[str, float]:
  """The three statistics and their standard errors on the rows `rows` of a paired validation draw."""
  t, h, g = new["terms"][rows], new["has"][rows], new["group_ids"][rows]
  t_post = float(t[h].sum() / max(h.sum(), 1))
  d_t, d_t_se = mipu.paired_difference(t, h, old["terms"][rows], old["has"][rows], g)
  ones = np.ones_like(h)
  d_j, d_j_se = mipu.paired_difference(new["rewards"][rows], ones, old["rewards"][rows], ones, g)
  return {
      "t_post": t_post,
      "t_post_se": mipu.t_post_standard_error(t, h, g),
      "t_before": float(old["terms"][rows][old["has"][rows]].sum() / max(old["has"][rows].sum(), 1)),
      "delta_t": d_t,
      "delta_t_se": d_t_se,
      "delta_j": d_j,
      "delta_j_se": d_j_se,
  }


def evaluate_pair(new: dict, old: dict, truth_new: np.ndarray, truth_old: np.ndarray, sizes) -> dict:
  """The truth and, per validation size n, the statistics of each disjoint sub-draw of n samples."""
  diff = truth_new - truth_old
  out = {
      "truth": float(diff.mean()),
      "truth_se": float(diff.std(ddof=1) / np.sqrt(diff.size)),
      "j_before": float(truth_old.mean()),
      "j_after": float(truth_new.mean()),
      "by_n": {},
  }
  if "tokens" in new and new["tokens"].shape == old["tokens"].shape:  # rows whose response is the same tokens
    out["same_response_frac"] = float(np.mean(np.all(new["tokens"] == old["tokens"], axis=1)))
  total = new["rewards"].size
  for n in sizes:
    out["by_n"][str(n)] = [statistics(new, old, slice(i, i + n)) for i in range(0, total - n + 1, n)]
  return out


def _atomic_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def run(out: str, checkpoints, candidates: int, val_prompts: int, truth: int, sizes, seed: int = SEED) -> None:
  """Runs (or resumes) the plan; see the module docstring."""
  from minpro_jax.trainer import Trainer  # heavy import, after the flags are checked

  os.makedirs(out, exist_ok=True)
  todo = [(k, j) for k in checkpoints for j in range(candidates) if not os.path.exists(f"{out}/k{k}_u{j}.json")]
  if not todo:
    print("nothing to do", flush=True)
    return
  c = study_config(tempfile.mkdtemp(prefix="mipu_power_"), seed)  # the trainer's workdir: nothing kept there
  tr = Trainer.from_config(c)
  state = tr.learner.init_state(nnx.split(tr.model)[1])
  step = 0
  n_val = len(tr.train_problems)
  cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
  for k in checkpoints:
    if k < step:
      continue
    while step < k:  # the GRPO trajectory, candidate 0's batches
      state, r = train_step(tr, state, (step, _SALT_TRAIN))
      step += 1
      print(f"trajectory step {step}: batch reward {r:.3f}", flush=True)
    t0 = time.time()
    val = [tr.train_problems[i] for i in mipu.validation_indices(n_val, val_prompts, _seed(seed, k, _SALT_VAL))]
    tru = [tr.train_problems[i] for i in mipu.validation_indices(n_val, truth, _seed(seed, k, _SALT_TRUTH, 0))]
    val_seed, truth_seed = _seed(seed, k, _SALT_VAL, 1), _seed(seed, k, _SALT_TRUTH, 1)
    old, truth_old = None, None
    next_state = None
    for j in range(candidates):
      path = f"{out}/k{k}_u{j}.json"
      if os.path.exists(path) and j:
        continue
      tc = time.time()
      cand, batch_reward = train_step(tr, mipu.snapshot(state), (k, _SALT_TRAIN) if j == 0 else (k, 1000 + j))
      if j == 0:
        next_state = mipu.snapshot(cand)
        if os.path.exists(path):
          continue
      if old is None:
        old = draw(tr, state.params, val, val_seed, VAL_GROUP, score_state=state)
        truth_old = draw(tr, state.params, tru, truth_seed, 1)["rewards"]
      new = draw(tr, cand.params, val, val_seed, VAL_GROUP, score_state=cand)
      truth_new = draw(tr, cand.params, tru, truth_seed, 1)["rewards"]
      res = evaluate_pair(new, old, truth_new, truth_old, sizes)
      res.update(
          checkpoint=k,
          candidate=j,
          batch_reward=batch_reward,
          seconds=time.time() - tc,
          date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          cpu=cpu or platform.processor(),
          plan={"val_prompts": val_prompts, "val_group": VAL_GROUP, "truth": truth, "seed": seed},
      )
      _atomic_json(path, res)
      print(f"k={k} u={j}: truth {res['truth']:+.4f} ({res['truth_se']:.4f}), {res['seconds']:.0f} s", flush=True)
    print(f"checkpoint {k} done in {time.time() - t0:.0f} s", flush=True)
    state, step = next_state, k + 1
  tr.close()


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="", help=f"the study's folder (default {results.committed('mipu_power')})")
  ap.add_argument("--checkpoints", default=",".join(map(str, CHECKPOINTS)))
  ap.add_argument("--candidates", type=int, default=CANDIDATES)
  ap.add_argument("--val-prompts", type=int, default=VAL_PROMPTS)
  ap.add_argument("--truth", type=int, default=TRUTH)
  ap.add_argument("--sizes", default=",".join(map(str, SUB_SIZES)))
  ap.add_argument("--seed", type=int, default=SEED)
  ap.add_argument("--report", action="store_true", help="write the tables from the finished pairs; run nothing")
  a = ap.parse_args(argv)
  a.out = results.resolve(a.out or results.committed("mipu_power"), "--out")
  try:
    checkpoints = sorted(int(x) for x in a.checkpoints.split(","))
    sizes = tuple(int(x) for x in a.sizes.split(","))
  except ValueError:
    sys.exit("error: --checkpoints and --sizes take comma-separated integers")
  if any(n % VAL_GROUP or n > a.val_prompts * VAL_GROUP for n in sizes) or a.candidates < 1 or min(checkpoints) < 0:
    sys.exit(f"error: --sizes must be multiples of {VAL_GROUP} up to --val-prompts x {VAL_GROUP}; --candidates >= 1")
  if a.report:
    from minpro_jax.study import mipu_power_report

    mipu_power_report.report(a.out)
    return
  run(a.out, checkpoints, a.candidates, a.val_prompts, a.truth, sizes, a.seed)


if __name__ == "__main__":
  main()
