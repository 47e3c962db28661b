"""The offline power study of MIPU's Step 2 (issue 38 part 2; docs/mechanism.md): can a rollback statistic tell an
update that lowered J(mu), the reward of the policy as served, from one that did not?

    python -m minpro_jax.lab.mipu_power --out=results/mipu_power                 # the default plan, resumable
    python -m minpro_jax.lab.mipu_power --out=results/mipu_power --report        # tables, no runs
    python -m minpro_jax.lab.mipu_power --setting=worked --out=results/mipu_power_worked ...   # T ~ 70 (docs)

The setting is the MIPU study's (`configs/studies/mipu.py`: staleness setting at delay 0, GRPO, seed 1, an fp8
e5m2 sampler with per-tensor weight and activation scales) on the task of `--setting` (`settings.SETTINGS`):
``short``, the tiny default task (answers of ~6 tokens), or ``worked``, the long study's (eight-term chain_sum,
worked-step SFT warm start, 128 new tokens, answers of ~60 tokens, lr 3e-5). A GRPO
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
`<out>/k<k>_u<j>.json` (written atomically, last), skipped on a rerun; a rerun computes only the missing pairs. It
goes on from the trajectory's state kept at the latest checkpoint at or before the first missing pair
(`<out>/trajectory/k<k>.npz`; without one it replays the trajectory: every batch is a function of the seed and the
step). With `--chunk-prompts` > 0 every draw runs in chunks of that many prompts (chunk i > 0 with its own sampler
seed), each kept in `<out>/partial/k<k>_old.npz` (theta_k's draws) or `k<k>_u<j>.npz` (theta'_j's) as it finishes,
so a killed run loses at most one chunk and its rerun draws the same samples as an unbroken run (the candidate's
update is recomputed: it is a function of the seed). `trajectory/` and `partial/` are not committed. The analysis
is `mipu_power_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax.config_lib import set_fields
from minpro_jax.config_lib.defaults import get_config
from minpro_jax.config_lib.files import load_module
from minpro_jax.lab import mipu_power_report
from minpro_jax.lab.settings import SETTINGS, setting_overrides
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


@dataclasses.dataclass(frozen=True)
class Plan:
  """The study's sizes (module docstring). `chunk_prompts`: prompts per kept chunk of a draw (0: a draw is one
  chunk, as the T ~ 6 run's)."""

  checkpoints: tuple[int, ...] = CHECKPOINTS
  candidates: int = CANDIDATES
  val_prompts: int = VAL_PROMPTS
  truth: int = TRUTH
  sizes: tuple[int, ...] = SUB_SIZES
  seed: int = SEED
  setting: str = "short"
  chunk_prompts: int = 0


def study_config(workdir: str, seed: int = SEED, setting: str = "short", overrides: dict | None = None):
  """The MIPU study's setting (its grid's fixed fields and fp8 options) with an fp8 sampler, at `seed`, with
  `setting`'s task (`settings.setting_overrides`) and then `overrides` on top."""
  mipu_study = load_module("configs/studies/mipu.py")
  g = mipu_study.get_grid()
  fields = {**g.fixed, "seed": seed, **mipu_study.FP8, "sampling.precision": "fp8", "sampling.decode_rows": DECODE_ROWS}
  c = set_fields(get_config(), {**fields, **setting_overrides(setting), **(overrides or {})})
  c.workdir = workdir
  c.eval.every = 0
  return c


def derived_seed(seed: int, *parts: int) -> int:
  return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0])


def train_step(tr, state, key: tuple[int, ...]):
  """One global step of GRPO updates on a fresh batch whose prompts and sampler seed are a function of `key`."""
  c = tr.c
  idx = mipu.validation_indices(len(tr.train_problems), c.prompts_per_step, derived_seed(c.seed, *key, 0))
  problems = [tr.train_problems[i] for i in idx]
  gen = tr.generate(state.params, problems, tr.sampling, derived_seed(c.seed, *key, 1), c.group_size)
  batch, _, _ = tr.rollout(state, gen, problems, c.group_size, score=tr.learner.loss_cfg.reads_learner_logp)
  state, m = tr.learn_step(state, batch)
  return state, float(batch.rewards.mean())


def draw(tr, params, problems, seed: int, group: int, score_state=None) -> dict[str, np.ndarray]:
  """One fp8 draw of `group` samples per problem at `params`: rewards, and with `score_state` (the learner state
  at the same params) the T terms (`inference_gap_terms`: -rho_i * A_i), their mask and the group ids."""
  gen = tr.generate(params, problems, tr.sampling, seed, group)
  if score_state is None:
    return {"rewards": np.asarray(tr.grade(gen, problems, group)[1], np.float64)}
  batch, _, _ = tr.rollout(score_state, gen, problems, group)
  tokens = np.where(gen.response_mask, gen.response_tokens, -1)  # to count the rows both draws share
  terms, has = inference_gap_terms(batch.learner_logp, batch.behavior_logp, batch.advantages, batch.response_mask)
  return {
      "rewards": np.asarray(batch.rewards, np.float64),
      "terms": np.asarray(terms, np.float64),
      "has": np.asarray(has, bool),
      "group_ids": np.asarray(batch.group_ids),
      "tokens": tokens,
  }


def group_share(rewards: np.ndarray, group_ids: np.ndarray) -> float:
  """The share of the groups whose rewards are not all equal: the groups with a nonzero advantage, the only ones
  that add to T (issue 55: T normalised by it does not drift toward 0 as fewer groups hold a success)."""
  groups = np.unique(group_ids)
  return float(np.mean([np.ptp(rewards[group_ids == u]) > 0 for u in groups])) if groups.size else math.nan


def statistics(new: dict, old: dict, rows: slice) -> dict[str, float]:
  """The three statistics and their standard errors on the rows `rows` of a paired validation draw, and the share
  of its groups at theta' with a nonzero advantage (`group_share`)."""
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
      "group_share": group_share(new["rewards"][rows], g),
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
  if "tokens" in old:  # T: the mean response length (tokens, with the eos) at theta_k
    out["response_len"] = float(np.mean(np.sum(old["tokens"] >= 0, axis=1)))
  if "tokens" in new and len(new["tokens"]) == len(old["tokens"]):  # rows whose response is the same tokens
    both = _concat([{"tokens": new["tokens"]}, {"tokens": old["tokens"]}])["tokens"]  # one width
    a, b = np.split(both, 2)
    out["same_response_frac"] = float(np.mean(np.all(a == b, axis=1)))
  total = new["rewards"].size
  for n in sizes:
    out["by_n"][str(n)] = [statistics(new, old, slice(i, i + n)) for i in range(0, total - n + 1, n)]
  return out


def _atomic_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- resume
def _key(plan: Plan) -> str:
  """The plan fields the draws depend on (a partial file of another plan is refused)."""
  fields = ("seed", "setting", "val_prompts", "truth", "chunk_prompts")
  return json.dumps({f: getattr(plan, f) for f in fields}, sort_keys=True)


class _Partial:
  """The finished chunks of one policy's draws at one checkpoint, kept in `path` (npz, rewritten atomically after
  every chunk) and removed with `done`. `get(name, fn)` returns chunk `name` from the file or `fn()`, saved.

  Raises:
    ValueError: the file was made with another plan's `key` (naming it and the file to delete).
  """

  def __init__(self, path: str, key: str):
    self.path, self.key, self.chunks = path, key, {}
    if os.path.exists(path):
      with np.load(path) as z:
        if str(z["key"]) != key:
          raise ValueError(f"{path} was made with the plan {z['key']}, this run's is {key}: delete it or use that plan")
        for name in z.files:
          if name != "key":
            chunk, field = name.split("__")
            self.chunks.setdefault(chunk, {})[field] = z[name]

  def get(self, name: str, fn) -> dict[str, np.ndarray]:
    if name not in self.chunks:
      self.chunks[name] = fn()
      arrays = {f"{c}__{f}": v for c, d in self.chunks.items() for f, v in d.items()}
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with open(self.path + ".tmp", "wb") as f:
        np.savez(f, key=self.key, **arrays)
      os.replace(self.path + ".tmp", self.path)
    return self.chunks[name]

  def done(self) -> None:
    if os.path.exists(self.path):
      os.remove(self.path)


def _concat(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """The chunks' arrays end to end along the rows; `tokens` right-padded with -1 to the widest chunk."""
  out = {}
  for f in pieces[0]:
    arrs = [p[f] for p in pieces]
    if f == "tokens":
      width = max(a.shape[1] for a in arrs)
      arrs = [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1) for a in arrs]
    out[f] = np.concatenate(arrs)
  return out


def chunked_draw(tr, state, problems, seeds, group: int, chunk: int, part: _Partial, name: str, score=False):
  """`draw` at `state.params` (scored by the learner at `state` when `score`) of `problems` in chunks of `chunk`
  prompts (0: one chunk), chunk i with the sampler seed `seeds(i)`, each kept in `part` as `<name><i>`. The chunks'
  group ids are made distinct (renumbered from the chunk's first prompt)."""
  size = chunk or len(problems)
  pieces = []
  for i, lo in enumerate(range(0, len(problems), size)):
    probs = problems[lo : lo + size]
    d = part.get(f"{name}{i}", lambda: draw(tr, state.params, probs, seeds(i), group, state if score else None))
    if "group_ids" in d:
      d = {**d, "group_ids": np.unique(d["group_ids"], return_inverse=True)[1].reshape(-1) + lo}
    pieces.append(d)
  return _concat(pieces)


def _trajectory_state(folder: str, key: str, k: int, like):
  """(state, step) of the latest trajectory state kept in `folder` at a step <= k, or (None, 0)."""
  kept = (
      [int(f[1:-4]) for f in os.listdir(folder) if f.startswith("k") and f.endswith(".npz")]
      if os.path.isdir(folder)
      else []
  )
  kept = [s for s in kept if s <= k]
  if not kept:
    return None, 0
  with open(os.path.join(folder, "key.json")) as f:
    got = f.read()
  if got != key:
    raise ValueError(f"{folder} was made with the plan {got}, this run's is {key}: delete it or use that plan")
  path = os.path.join(folder, f"k{max(kept)}.npz")
  with np.load(path) as z:
    leaves = [jnp.asarray(z[f"arr_{i}"]) for i in range(len(z.files))]
  return jax.tree.unflatten(jax.tree.structure(like), leaves), max(kept)


def _keep_trajectory_state(folder: str, key: str, k: int, state) -> None:
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "key.json"), "w") as f:
    f.write(key)
  path = os.path.join(folder, f"k{k}.npz")
  with open(path + ".tmp", "wb") as f:
    np.savez(f, *[np.asarray(x) for x in jax.tree.leaves(state)])
  os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------------------------- the study
def run(out: str, plan: Plan, overrides: dict | None = None) -> None:
  """Runs (or resumes) `plan` into `out`, with `overrides` on top of its setting's config; see the module
  docstring."""
  from minpro_jax.run.trainer import Trainer  # heavy import, after the flags are checked

  os.makedirs(out, exist_ok=True)
  pending = lambda k, j: not os.path.exists(f"{out}/k{k}_u{j}.json")  # noqa: E731
  todo = [(k, j) for k in plan.checkpoints for j in range(plan.candidates) if pending(k, j)]
  if not todo:
    print("nothing to do", flush=True)
    return
  key, seed = _key(plan), plan.seed
  folder = os.path.join(out, "trajectory")
  scratch = tempfile.mkdtemp(prefix="mipu_power_")  # the trainer's workdir: nothing kept there
  try:
    tr = Trainer.from_config(study_config(scratch, seed, plan.setting, overrides))
  except BaseException:
    shutil.rmtree(scratch, ignore_errors=True)
    raise
  try:
    state = tr.learner.init_state(nnx.split(tr.model)[1])
    kept, step = _trajectory_state(folder, key, todo[0][0], state)
    state = kept if kept is not None else state
    if step:
      print(f"trajectory: resuming at step {step}", flush=True)
    n_val = len(tr.train_problems)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    for k in sorted({k for k, _ in todo}):
      while step < k:  # the GRPO trajectory, candidate 0's batches
        state, r = train_step(tr, state, (step, _SALT_TRAIN))
        step += 1
        print(f"trajectory step {step}: batch reward {r:.3f}", flush=True)
      if not os.path.exists(os.path.join(folder, f"k{k}.npz")):
        _keep_trajectory_state(folder, key, k, state)
      t0 = time.time()
      val = [
          tr.train_problems[i]
          for i in mipu.validation_indices(n_val, plan.val_prompts, derived_seed(seed, k, _SALT_VAL))
      ]
      tru = [
          tr.train_problems[i]
          for i in mipu.validation_indices(n_val, plan.truth, derived_seed(seed, k, _SALT_TRUTH, 0))
      ]
      val_seeds = lambda i: derived_seed(seed, k, _SALT_VAL, 1, *([i] if i else []))  # noqa: E731 - chunk 0: the T~6 seed
      truth_seeds = lambda i: derived_seed(seed, k, _SALT_TRUTH, 1, *([i] if i else []))  # noqa: E731
      before = _Partial(f"{out}/partial/k{k}_old.npz", key)
      old, truth_old, cand0 = None, None, None
      for j in range(plan.candidates):
        if not pending(k, j):
          continue
        tc = time.time()
        cand, batch_reward = train_step(tr, mipu.snapshot(state), (k, _SALT_TRAIN) if j == 0 else (k, 1000 + j))
        if old is None:
          old = chunked_draw(tr, state, val, val_seeds, VAL_GROUP, plan.chunk_prompts, before, "val", score=True)
          truth_old = chunked_draw(tr, state, tru, truth_seeds, 1, plan.chunk_prompts, before, "truth")["rewards"]
        after = _Partial(f"{out}/partial/k{k}_u{j}.npz", key)
        if after.chunks:
          print(f"k={k} u={j}: resuming after {len(after.chunks)} chunks", flush=True)
        new = chunked_draw(tr, cand, val, val_seeds, VAL_GROUP, plan.chunk_prompts, after, "val", score=True)
        truth_new = chunked_draw(tr, cand, tru, truth_seeds, 1, plan.chunk_prompts, after, "truth")["rewards"]
        res = evaluate_pair(new, old, truth_new, truth_old, plan.sizes)
        res.update(
            checkpoint=k,
            candidate=j,
            batch_reward=batch_reward,
            seconds=time.time() - tc,
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            cpu=cpu or platform.processor(),
            plan={**json.loads(key), "val_group": VAL_GROUP},
        )
        _atomic_json(f"{out}/k{k}_u{j}.json", res)
        after.done()
        cand0 = cand if j == 0 else cand0
        print(f"k={k} u={j}: truth {res['truth']:+.4f} ({res['truth_se']:.4f}), {res['seconds']:.0f} s", flush=True)
      before.done()
      print(f"checkpoint {k} done in {time.time() - t0:.0f} s", flush=True)
      if cand0 is not None:  # the trajectory's step k is candidate 0's update
        state, step = cand0, k + 1
  finally:
    tr.close()
    shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  d = Plan()
  ap.add_argument("--out", default="", help=f"the study's folder (default {results.committed('mipu_power')})")
  ap.add_argument("--setting", default=d.setting, help=f"the task, one of {SETTINGS}")
  ap.add_argument("--checkpoints", default=",".join(map(str, d.checkpoints)))
  ap.add_argument("--candidates", type=int, default=d.candidates)
  ap.add_argument("--val-prompts", type=int, default=d.val_prompts)
  ap.add_argument("--truth", type=int, default=d.truth)
  ap.add_argument("--sizes", default=",".join(map(str, d.sizes)))
  ap.add_argument("--chunk-prompts", type=int, default=d.chunk_prompts, help="prompts per kept chunk (0: one)")
  ap.add_argument("--seed", type=int, default=d.seed)
  ap.add_argument("--report", action="store_true", help="write the tables from the finished pairs; run nothing")
  ap.add_argument("--compare", default="", help="--report: LABEL=DIR,... studies side by side")
  a = ap.parse_args(argv)
  a.out = results.resolve(a.out or results.committed("mipu_power"), "--out")
  if a.report:
    if a.compare:
      pairs = [x.partition("=") for x in a.compare.split(",") if x]
      if any(not lab or not sep or not path for lab, sep, path in pairs):
        sys.exit(f"error: --compare must list LABEL=DIR pairs, got {a.compare!r}")
      mipu_power_report.compare_report({lab: path for lab, _, path in pairs})
      return
    mipu_power_report.report(a.out, block=mipu_power_report.block_of(a.out))
    return
  try:
    checkpoints = tuple(sorted(int(x) for x in a.checkpoints.split(",")))
    sizes = tuple(int(x) for x in a.sizes.split(","))
  except ValueError:
    sys.exit("error: --checkpoints and --sizes take comma-separated integers")
  if any(n % VAL_GROUP or n > a.val_prompts * VAL_GROUP for n in sizes) or a.candidates < 1 or min(checkpoints) < 0:
    sys.exit(f"error: --sizes must be multiples of {VAL_GROUP} up to --val-prompts x {VAL_GROUP}; --candidates >= 1")
  if a.setting not in SETTINGS or a.chunk_prompts < 0:
    sys.exit(f"error: --setting must be one of {SETTINGS} (got {a.setting!r}); --chunk-prompts >= 0")
  run(a.out, Plan(checkpoints, a.candidates, a.val_prompts, a.truth, sizes, a.seed, a.setting, a.chunk_prompts))


if __name__ == "__main__":
  main()
