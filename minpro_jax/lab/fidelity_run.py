"""Runner and report of the Tier A gradient-fidelity study (`minpro_jax.lab.fidelity_toy`; docs/mechanism.md).

    python -m minpro_jax.lab.fidelity_run --out=results/fidelity_toy                  # the default grid, resumable
    python -m minpro_jax.lab.fidelity_run --out=results/fidelity_toy --T=16,64 --seeds=0
    python -m minpro_jax.lab.fidelity_run --out=results/fidelity_toy --report         # tables + plot, no runs
    python -m minpro_jax.lab.fidelity_run --out=results/fidelity_toy_structure --structures=c3i,c1d \
        --T=16,64,256 --tolerances=E0 --drifts=s0,lag0.02,lag0.05,rnd0.05 --batches=200   # issue 55's sweep

A cell is (reward structure, T, tolerance, drift, seed); each finished cell is one small JSON `<out>/<cell>.json`
(written atomically last), and a finished cell is skipped. The setting of (structure, seed, T, tolerance): V = 6
tokens; the structure `c<k>i` / `c<k>d` (`fidelity_structure`; default c3i: 3 correct per position, whatever came
before); logits N(0, 1) plus a bias calibrated so that J = 1e-3 at the start; on-policy Adam on the exact J (lr
0.005) until J >= 0.5 after at least 128 steps (the start is lowered 100-fold while J would already pass 0.7 at step
128); pi = that point. Drifts: ``s<k>`` mu = the trajectory k steps earlier (``s0`` on-policy), ``noise<sigma>`` mu =
pi's logits + sigma N(0, 1), ``lag<x>`` / ``rnd<x>`` the trajectory point / the noise scale whose exact per-token
E_mu|log pi - log mu| is nearest x (`fidelity_structure`). Tolerance ``E0`` (E = 0) or ``Ek`` (E = max(1, T // 32)).
Per cell R batches of N = 64 responses (groups of 8, mode grpo) give every method's estimate; the metrics are
`fidelity_toy.summarize`'s, each cell also records its per-token drift and the token weights' split between
rewarded responses and failed ones before and after their first error.

`--report` writes `<out>/summary.md` (every table), `<out>/eta_by_T.png`, and the compact table between the
markers of docs/mechanism.md. Exit status 2 with one line `error: ...` for bad flags.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from minpro_jax.lab import fidelity_structure as fs
from minpro_jax.lab import fidelity_toy as ft
from minpro_jax.lab.fidelity_model_report import replace_block
from minpro_jax.study import results

VOCAB, NUM, GROUP = 6, 64, 8  # the correct tokens per position: the reward structure (fidelity_structure)
CALL_BATCHES = 8  # batches per jitted call (--batches is rounded up to a multiple)
LR, MIN_STEPS, STOP_RETURN, START_RETURN = 0.005, 128, 0.5, 1e-3
DEFAULT_T = (16, 64, 256, 1024)
DEFAULT_DRIFTS = ("s0", "s8", "s32", "s128", "noise0.3")
ALL_DRIFTS = ("s0", "s8", "s32", "s128", "noise0.1", "noise0.3")  # the report's order
TOLERANCES = ("E0", "Ek")
DOC = os.path.join("docs", "mechanism.md")
BEGIN, END = "<!-- tier-a:begin (python -m minpro_jax.lab.fidelity_run --report) -->", "<!-- tier-a:end -->"
REFERENCE = ft.METHOD_NAMES.index("cispo")  # the paired eta differences are against cispo (= minpro "none")
CONTRASTS = (("minpro:min", "cispo"), ("minpro:min", "minpro:prod"), ("minpro:prod", "cispo"))
DOC_TABLES = (("s32", "E0"), ("noise0.3", "E0"), ("s8", "Ek"), ("noise0.3", "Ek"))


def tolerance_of(label: str, horizon: int) -> int:
  """The errors E a correct response may make: 0 for "E0", else max(1, horizon // 32) (docs/mechanism.md)."""
  return 0 if label == "E0" else max(1, horizon // 32)


def positions_of(horizon: int) -> tuple[int, ...]:
  """The reported positions 0, 1, 3, 7, ..., T - 1."""
  return tuple(sorted({min(2**k - 1, horizon - 1) for k in range(int(math.log2(horizon)) + 2)}))


def cell_name(horizon: int, tol: str, drift: str, seed: int, structure: str = fs.DEFAULT_STRUCTURE) -> str:
  """The cell's file stem under the output folder, e.g. "T64-E0-s32-seed0" (default structure), "c1d-T64-E0-..."."""
  return ("" if structure == fs.DEFAULT_STRUCTURE else f"{structure}-") + f"T{horizon}-{tol}-{drift}-seed{seed}"


def finite_or_none(x):
  """``x`` (nested dicts / lists) with every non-finite float replaced by None (strict JSON)."""
  if isinstance(x, dict):
    return {k: finite_or_none(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite_or_none(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown"


class Setting:
  """The correct sets and the Adam trajectory of one (seed, T, tolerance label, reward structure)."""

  def __init__(self, seed: int, horizon: int, tol: str, structure: str = fs.DEFAULT_STRUCTURE):
    self.tolerance, self.structure = tolerance_of(tol, horizon), structure
    key = jax.random.PRNGKey(seed)
    k, dependent = fs.parse_structure(structure, VOCAB)
    self.correct = ft.correct_sets(jax.random.fold_in(key, horizon), horizon, VOCAB, k, dependent)
    init_key = jax.random.fold_in(key, 10_000 + horizon)
    start = START_RETURN
    for _ in range(4):
      bias = ft.calibrate_bias(init_key, self.correct, self.tolerance, start)
      theta0 = ft.init_logits(init_key, self.correct, bias)
      self.thetas, self.k, returns = ft.adam_trajectory(
          theta0, self.correct, self.tolerance, lr=LR, keep=128, min_steps=MIN_STEPS, stop_return=STOP_RETURN
      )
      if returns[-1] <= 0.7 or start < 1e-7:
        break
      start /= 100
    self.start_return, self.returns = start, returns
    self.pi = self.thetas[-1]
    self.g_star = jax.grad(ft.exact_return)(self.pi, self.correct, self.tolerance)

  def behaviour(self, drift: str, seed: int) -> tuple[jax.Array, dict]:
    """(mu, how it was chosen: {"lag": k} or {"sigma": s}, empty for s<k>)."""
    matched = fs.matched_target(drift)
    if matched and matched[0] == "lag":
      k, _ = fs.matched_lag(self.pi, self.thetas, matched[1])
      return self.thetas[-1 - k], {"lag": k}
    if matched:
      sigma, _ = fs.matched_noise(self.pi, fs.noise_of(seed, self.pi.shape), matched[1])
      return self.pi + sigma * fs.noise_of(seed, self.pi.shape), {"sigma": sigma}
    if drift.startswith("s"):
      return self.thetas[-1 - int(drift[1:])], {}
    return self.pi + float(drift[len("noise") :]) * fs.noise_of(seed, self.pi.shape), {}


def run_cell(setting: Setting, drift: str, seed: int, batches: int, stats_fn) -> dict:
  """One cell's summary (JSON-ready)."""
  t0 = time.time()
  batches = -(-batches // CALL_BATCHES) * CALL_BATCHES
  mu, chosen = setting.behaviour(drift, seed)
  horizon = setting.pi.shape[0]
  pos = positions_of(horizon)
  key = jax.random.PRNGKey(2**20 + seed)
  proj, sq, ess_, w, rew, lrs, abs_lr = [], [], [], [], [], [], []
  grad_sum, split, split_tokens = None, 0.0, 0.0
  for start in range(0, batches, CALL_BATCHES):
    keys = jnp.stack([jax.random.fold_in(key, r) for r in range(start, start + CALL_BATCHES)])
    out = jax.device_get(stats_fn(keys, setting.pi, mu, setting.g_star, setting.correct))
    grad_sum = out.grad_sum if grad_sum is None else grad_sum + out.grad_sum
    proj.append(out.proj), sq.append(out.sq), ess_.append(out.ess), w.append(out.weights)
    rew.append(out.reward_mean), lrs.append(out.log_ratio_seq), abs_lr.append(out.abs_log_ratio)
    split, split_tokens = split + out.weight_split.sum(0), split_tokens + out.split_tokens.sum(0)
  proj, sq, ess_, w, lrs = (np.concatenate(x) for x in (proj, sq, ess_, w, lrs))  # w: [R, M, N, P]
  summary = ft.summarize(
      proj, sq, np.asarray(grad_sum) / batches, np.asarray(setting.g_star), reference=REFERENCE, seed=seed
  )
  w = np.moveaxis(w, 1, 0).reshape(len(ft.METHODS), -1, len(pos))  # [M, R * N, P]
  methods = {}
  for i, name in enumerate(ft.METHOD_NAMES):
    methods[name] = {k: v[i] for k, v in summary.items()}
    methods[name].update(
        weight_mean=w[i].mean(0).tolist(),
        weight_q05=np.quantile(w[i], 0.05, axis=0).tolist(),
        weight_q95=np.quantile(w[i], 0.95, axis=0).tolist(),
        ess=ess_[:, i].mean(0).tolist(),
    )
  j_of = lambda th: float(ft.exact_return(th, setting.correct, setting.tolerance))  # noqa: E731
  split_mean, split_share = fs.split_means(np.asarray(split, np.float64), np.asarray(split_tokens, np.float64))
  return {
      "structure": setting.structure,
      "T": horizon,
      "tolerance": setting.tolerance,
      "drift": drift,
      **chosen,
      "seed": seed,
      "J_pi": j_of(setting.pi),
      "J_mu": j_of(mu),
      "adam_steps_to_pi": setting.k,
      "start_return": setting.start_return,
      "g_star_norm": float(jnp.linalg.norm(setting.g_star)),
      "reward_mu": float(np.mean(rew)),
      "log_ratio_seq_mean": float(lrs.mean()),
      "log_ratio_seq_sd": float(lrs.std()),
      "abs_log_ratio_token": float(ft.token_abs_log_ratio(setting.pi, mu)),  # exact, E_mu
      "abs_log_ratio_sampled": float(np.mean(np.concatenate(abs_lr))),
      "weight_split": split_mean,  # method -> mean weight on fidelity_toy.SPLIT's parts
      "split_token_share": split_share,
      "batches": batches,
      "num": NUM,
      "group": GROUP,
      "positions": list(pos),
      "methods": methods,
      "seconds": round(time.time() - t0, 1),
      "date": datetime.date.today().isoformat(),
      "cpu": cpu_model(),
  }


def _stats_fn(setting: Setting):
  """jit of `fidelity_toy.batch_stats` over CALL_BATCHES keys at once (vmapped: the sampler's scan over T runs
  once per call), the estimates summed over those batches."""
  horizon = setting.pi.shape[0]

  def one(key, pi, mu, gs, correct):
    return ft.batch_stats(
        key,
        pi,
        mu,
        gs,
        correct,
        tolerance=setting.tolerance,
        num=NUM,
        group=GROUP,
        methods=ft.METHODS,
        positions=positions_of(horizon),
    )

  def many(keys, pi, mu, gs, correct):
    out = jax.vmap(one, in_axes=(0, None, None, None, None))(keys, pi, mu, gs, correct)
    return out._replace(grad_sum=jnp.sum(out.grad_sum, axis=0))

  return jax.jit(many)


def run(out: str, horizons, tols, drifts, seeds, batches: int, structures=(fs.DEFAULT_STRUCTURE,)) -> int:
  """Runs every (structure, T, tolerance, drift, seed) cell whose JSON is not yet in `out` (`batches` batches each)
  and writes one JSON per finished cell; returns 0."""
  os.makedirs(out, exist_ok=True)
  compiled = {}
  for seed, structure, horizon, tol in itertools.product(seeds, structures, horizons, tols):
    name_of = lambda d: cell_name(horizon, tol, d, seed, structure)  # noqa: E731
    todo = [d for d in drifts if not os.path.exists(os.path.join(out, name_of(d) + ".json"))]
    if not todo:
      continue
    setting = Setting(seed, horizon, tol, structure)
    if (horizon, tol) not in compiled:
      compiled[(horizon, tol)] = _stats_fn(setting)
    fn = compiled[(horizon, tol)]
    for drift in todo:
      name = name_of(drift)
      res = finite_or_none(run_cell(setting, drift, seed, batches, fn))
      path = os.path.join(out, name + ".json")
      with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=None, separators=(",", ":"), allow_nan=False)
      os.replace(path + ".tmp", path)
      etas = {m: v["eta"] for m, v in res["methods"].items() if v["eta"] is not None}
      best = max(etas, key=etas.get) if etas else "none (every estimate 0)"
      print(f"{name}: {res['seconds']} s, J_pi {res['J_pi']:.3f} J_mu {res['J_mu']:.3f}, best eta {best}")
  return 0


# ------------------------------------------------------------------------------------------------- report
def load(out: str) -> list[dict]:
  """Every finished cell's record in `out`, in file-name order."""
  return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")]


def _tol(r) -> str:
  return "E0" if r["tolerance"] == 0 else "Ek"


def on_policy_eta(results) -> dict:
  """(T, tol label, seed) -> eta of the on-policy cell s0 (every method has the same one there)."""
  return {(r["T"], _tol(r), r["seed"]): r["methods"]["cispo"]["eta"] for r in results if r["drift"] == "s0"}


def _by_cell(results, relative: bool = False):
  """(T, tol label, drift) -> {method: [eta per seed]} (``relative``: divided by the seed's on-policy eta, cells
  without a finished positive s0 left out), and the cells' J and drift numbers."""
  eta, info = defaultdict(lambda: defaultdict(list)), defaultdict(list)
  base = on_policy_eta(results)
  for r in results:
    tol = _tol(r)
    key = (r["T"], tol, r["drift"])
    scale = base.get((r["T"], tol, r["seed"])) if relative else 1.0
    if not scale or scale <= 0:
      continue
    for m, v in r["methods"].items():
      if v["eta"] is not None:  # None: no batch had a nonzero estimate
        eta[key][m].append(v["eta"] / scale)
    info[key].append((r["J_pi"], r["J_mu"], r["log_ratio_seq_sd"], r.get("abs_log_ratio_token")))
  return eta, info


def _fmt(vals):
  if not vals:
    return "—"
  return f"{np.mean(vals):.3g}" + (f" ±{np.std(vals, ddof=1) / math.sqrt(len(vals)):.2g}" if len(vals) > 1 else "")


def table(results, drift: str, tol: str, relative: bool = False, methods=ft.METHOD_NAMES) -> str:
  """Markdown: eta (mean ± SE over seeds; ``relative``: eta / the on-policy eta of the same T and seed) per method
  of ``methods`` (rows) and T (columns) at one drift and tolerance; the cells' seeds, drift and J below."""
  eta, info = _by_cell(results, relative)
  horizons = sorted({k[0] for k in eta if k[1:] == (tol, drift)})
  if not horizons:
    return f"(no finished cells for drift {drift}, {tol})\n"
  lines = ["| method | " + " | ".join(f"T={t}" for t in horizons) + " |", "|---" * (len(horizons) + 1) + "|"]
  for m in methods:
    lines.append(f"| {m} | " + " | ".join(_fmt(eta[(t, tol, drift)][m]) for t in horizons) + " |")
  seeds = [str(len(info[(t, tol, drift)])) for t in horizons]
  sd = [f"{np.mean([x[2] for x in info[(t, tol, drift)]]):.2f}" for t in horizons]
  jm = [
      f"{np.mean([x[1] for x in info[(t, tol, drift)]]):.2f}/{np.mean([x[0] for x in info[(t, tol, drift)]]):.2f}"
      for t in horizons
  ]
  lines += ["| *seeds* | " + " | ".join(seeds) + " |", "| *sd of sum log-ratio* | " + " | ".join(sd) + " |"]
  lines += ["| *J(mu)/J(pi)* | " + " | ".join(jm) + " |"]
  if all(x[3] is not None for t in horizons for x in info[(t, tol, drift)]):  # recorded since issue 55
    lr = [f"{np.mean([x[3] for x in info[(t, tol, drift)]]):.3f}" for t in horizons]
    lines += ["| *per-token abs log ratio* | " + " | ".join(lr) + " |"]
  return "\n".join(lines) + "\n"


def contrast_table(results, a: str, b: str) -> str:
  """Markdown: (eta(a) - eta(b)) / the on-policy eta of the same T and seed, per (drift, tolerance) and T: the mean
  over seeds and how many seeds' paired 95 % bootstrap intervals lie above / below 0 (only for b = cispo, the
  reference of the stored intervals)."""
  cells = defaultdict(list)
  base = on_policy_eta(results)
  for r in results:
    tol = _tol(r)
    ma, mb = r["methods"][a], r["methods"][b]
    scale = base.get((r["T"], tol, r["seed"]))
    if ma["eta"] is None or mb["eta"] is None or not scale or scale <= 0:
      continue
    up = ma["eta_diff_low"] > 0 and b == "cispo"
    down = ma["eta_diff_high"] < 0 and b == "cispo"
    cells[(r["drift"], tol, r["T"])].append(((ma["eta"] - mb["eta"]) / scale, up, down))
  horizons = sorted({k[2] for k in cells})
  rows = sorted({k[:2] for k in cells}, key=lambda k: (ALL_DRIFTS.index(k[0]) if k[0] in ALL_DRIFTS else 99, k[1]))
  lines = ["| drift, tol | " + " | ".join(f"T={t}" for t in horizons) + " |", "|---" * (len(horizons) + 1) + "|"]
  for d, tol in rows:
    out = []
    for t in horizons:
      v = cells.get((d, tol, t))
      if not v:
        out.append("—")
        continue
      tag = f" ({sum(x[1] for x in v)}↑ {sum(x[2] for x in v)}↓ /{len(v)})" if b == "cispo" else f" (/{len(v)})"
      out.append(f"{np.mean([x[0] for x in v]):+.2g}{tag}")
    lines.append(f"| {d}, {tol} | " + " | ".join(out) + " |")
  return "\n".join(lines) + "\n"


def weight_table(results, drift: str) -> str:
  """Markdown: per method and reported position, the weight's mean [5 %, 95 %] and ESS, of the largest T's cell."""
  cells = [r for r in results if r["drift"] == drift and r["tolerance"] == 0 and r["seed"] == 0]
  if not cells:
    return f"(no finished E0 cell of seed 0 for drift {drift})\n"
  r = max(cells, key=lambda c: c["T"])
  lines = [
      f"T = {r['T']}; each entry: mean [q05, q95] ESS\n",
      "| method | " + " | ".join(f"t={p}" for p in r["positions"]) + " |",
  ]
  lines.append("|---" * (len(r["positions"]) + 1) + "|")
  for m, v in r["methods"].items():
    cols = zip(v["weight_mean"], v["weight_q05"], v["weight_q95"], v["ess"])
    lines.append(f"| {m} | " + " | ".join(f"{a:.2g} [{b:.2g}, {c:.2g}] {e:.2f}" for a, b, c, e in cols) + " |")
  return "\n".join(lines) + "\n"


def plot(results, path: str) -> str | None:
  """PNG: eta / on-policy eta against T, one panel per drift (columns) and tolerance (rows), a line per method."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  eta, _ = _by_cell(results, relative=True)
  drifts = [d for d in ALL_DRIFTS if d != "s0" and any(k[2] == d for k in eta)]
  if not drifts:
    return None  # nothing to plot without an on-policy cell and a drifted one
  fig, axes = plt.subplots(2, len(drifts), figsize=(3.2 * len(drifts), 6.4), squeeze=False, sharey=True)
  for row, tol in enumerate(TOLERANCES):
    for col, d in enumerate(drifts):
      ax = axes[row][col]
      for i, m in enumerate(ft.METHOD_NAMES):
        ts = sorted(k[0] for k in eta if k[1:] == (tol, d))
        ys = [np.mean(eta[(t, tol, d)][m]) if eta[(t, tol, d)][m] else np.nan for t in ts]
        ax.plot(ts, ys, marker="o", ms=3, label=m, ls="-" if i < 5 else "--")
      ax.set_xscale("log", base=2)
      ax.set_xticks(DEFAULT_T, [str(t) for t in DEFAULT_T])
      ax.set_yscale("symlog", linthresh=1e-2)
      ax.axhline(1.0, color="k", lw=0.5, ls=":")
      ax.axhline(0.0, color="k", lw=0.5)
      ax.set_title(f"{d}, {tol}", fontsize=9)
      ax.set_xlabel("T")
  axes[0][0].set_ylabel("eta / on-policy eta (E0)")
  axes[1][0].set_ylabel("eta / on-policy eta (Ek)")
  axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


STRUCTURE_BLOCK = "tier-a-structure"  # the doc block of a study of several reward structures
DOC_METHODS = ("minpro:min", "minpro:prod", "cispo", "grpo", "m2po", "seq_is")


def structure_report(out: str, results: list[dict], doc: str = DOC) -> int:
  """`report` of a study with reward structures other than the default (issue 55): per structure, tolerance and
  drift, eta / on-policy eta with each cell's per-token drift; the contrasts min - none and min - prod; the token
  weights' split between rewarded responses and failed ones before and after their first error. Into
  `out`/summary.md (every method) and the block `STRUCTURE_BLOCK` of `doc` (`DOC_METHODS`); returns 0."""
  body, full = [], ["# Tier A by reward structure: eta / on-policy eta (mean ± SE over seeds)\n"]
  by = defaultdict(list)
  for r in results:
    by[r.get("structure", fs.DEFAULT_STRUCTURE)].append(r)
  for structure, rs in by.items():
    k, dependent = fs.parse_structure(structure, VOCAB)
    what = f"{structure}: {k} of {VOCAB} tokens correct per position, {'set by' if dependent else 'whatever'} the previous token"
    drifts = sorted({r["drift"] for r in rs if r["drift"] != "s0"})
    for tol in sorted({_tol(r) for r in rs}):
      for d in drifts:
        head = f"\n**{what}; {d}, {tol}**\n\n"
        body += [head, table(rs, d, tol, relative=True, methods=DOC_METHODS)]
        full += [head, table(rs, d, tol, relative=True)]
    for a, b in CONTRASTS[:2]:
      head = f"\n**{structure}: (eta({a}) - eta({b})) / on-policy eta**\n\n"
      body += [head, contrast_table(rs, a, b)]
      full += [head, contrast_table(rs, a, b)]
  for structure, rs in by.items():
    head = (
        f"\n**{structure}: mean token weight on rewarded responses / failed ones up to their first wrong token / "
        "after it** (means over seeds and batches)\n\n"
    )
    body += [head, fs.split_table(rs)]
    full += [head, fs.split_table(rs)]
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("".join(full))
  wrote = replace_block(doc, STRUCTURE_BLOCK, "".join(body))
  print(f"wrote {os.path.join(out, 'summary.md')}" + (f" and the block {STRUCTURE_BLOCK} of {doc}" if wrote else ""))
  return 0


def report(out: str, doc: str = DOC) -> int:
  """Writes `out`/summary.md, the eta plot and the tables between the markers of `doc` from the cells in `out`
  (`structure_report` for a study of other reward structures); returns 0. Raises SystemExit (one line) when `out`
  holds no finished cell."""
  results = load(out)
  if not results:
    raise SystemExit(f"error: no finished cells in {out}; run the study first (without --report)")
  if {r.get("structure", fs.DEFAULT_STRUCTURE) for r in results} != {fs.DEFAULT_STRUCTURE}:
    return structure_report(out, results, doc)
  parts = ["# Tier A gradient fidelity: eta (mean ± SE over seeds)\n", f"{len(results)} cells.\n"]
  for tol in TOLERANCES:
    for d in ALL_DRIFTS:
      if any(r["drift"] == d for r in results):
        parts += [f"\n## eta, drift {d}, {tol}\n\n", table(results, d, tol)]
        parts += [f"\n## eta / on-policy eta, drift {d}, {tol}\n\n", table(results, d, tol, relative=True)]
  for a, b in CONTRASTS:
    parts += [f"\n## eta({a}) - eta({b})\n\n", contrast_table(results, a, b)]
  for d in ("s128", "noise0.3"):
    parts += [f"\n## token weight by position (largest T, {d}, E0; seed 0)\n\n", weight_table(results, d)]
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("".join(parts))
  png = plot(results, os.path.join(out, "eta_by_T.png"))
  if os.path.exists(doc):
    text = open(doc).read()
    if BEGIN in text and END in text:
      body = (
          "\n**On-policy eta (s0; every method has the same)**\n\n"
          + table(results, "s0", "E0").split("| minpro:mean")[0]
      )
      body += "".join(
          f"\n**eta / on-policy eta, {d}, {tol}**\n\n" + table(results, d, tol, relative=True) for d, tol in DOC_TABLES
      )
      body += "".join(
          f"\n**(eta({a}) - eta({b})) / on-policy eta**\n\n" + contrast_table(results, a, b) for a, b in CONTRASTS[:2]
      )
      text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + body + "\n" + text[text.index(END) :]
      with open(doc, "w") as f:
        f.write(text)
  wrote = (
      [os.path.join(out, "summary.md")]
      + ([png] if png else [])
      + ([f"the table of {doc}"] if os.path.exists(doc) else [])
  )
  print("wrote " + ", ".join(wrote))
  return 0


def _ints(s: str, name: str) -> tuple[int, ...]:
  try:
    vals = tuple(int(x) for x in s.split(",") if x)
  except ValueError:
    raise SystemExit(f"error: --{name} must be comma-separated integers, got {s!r}") from None
  if not vals or min(vals) < 0:
    raise SystemExit(f"error: --{name} must list non-negative integers, got {s!r}")
  return vals


def main(argv=None) -> int:
  """The command line (module docstring): runs the cells, or with --report regenerates the report; returns the exit
  status (2 with one line on a bad flag)."""
  p = argparse.ArgumentParser(prog="python -m minpro_jax.lab.fidelity_run", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="", help=f"the study's folder (default {results.committed('fidelity_toy')})")
  p.add_argument("--T", default=",".join(map(str, DEFAULT_T)), help="horizons (powers of two >= 2)")
  p.add_argument("--tolerances", default=",".join(TOLERANCES))
  p.add_argument("--drifts", default=",".join(DEFAULT_DRIFTS), help="s<k> (k <= 128), noise<sigma>, lag<x>, rnd<x>")
  p.add_argument("--structures", default=fs.DEFAULT_STRUCTURE, help="reward structures c<k>i / c<k>d (k <= V/2)")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--batches", type=int, default=400, help="R batches of 64 responses per cell")
  p.add_argument("--report", action="store_true", help="only write the tables and the plot")
  p.add_argument("--doc", default=DOC, help=f"the doc whose marked table --report rewrites (default {DOC})")
  a = p.parse_args(argv)
  a.out = results.resolve(a.out or results.committed("fidelity_toy"), "--out")
  try:
    if a.report:
      return report(a.out, a.doc)
    horizons, seeds = _ints(a.T, "T"), _ints(a.seeds, "seeds")
    if any(t < 2 or t & (t - 1) for t in horizons):
      raise SystemExit(f"error: --T must list powers of two >= 2, got {a.T!r}")
    tols = tuple(x for x in a.tolerances.split(",") if x)
    if not tols or set(tols) - set(TOLERANCES):
      raise SystemExit(f"error: --tolerances must list {' and/or '.join(TOLERANCES)}, got {a.tolerances!r}")
    drifts = tuple(x for x in a.drifts.split(",") if x)
    for d in drifts:
      ok = (d[:1] == "s" and d[1:].isdigit() and int(d[1:]) <= 128) or (d.startswith("noise") and _float(d[5:]))
      ok = ok or fs.matched_target(d) is not None
      if not ok:
        raise SystemExit(
            f"error: --drifts: {d!r} is none of s<k> (0 <= k <= 128), noise<sigma> (sigma >= 0), lag<x>, rnd<x> (x > 0)"
        )
    if a.batches < 2:
      raise SystemExit(f"error: --batches must be >= 2, got {a.batches}")
    structures = tuple(x for x in a.structures.split(",") if x)
    for x in structures or ("",):
      try:
        fs.parse_structure(x, VOCAB)
      except ValueError as e:
        raise SystemExit(f"error: --structures: {e}") from None
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr)
      return 2
    raise
  return run(a.out, horizons, tols, drifts, seeds, a.batches, structures)


def _float(s: str) -> bool:
  try:
    return float(s) >= 0
  except ValueError:
    return False


if __name__ == "__main__":
  raise SystemExit(main())
