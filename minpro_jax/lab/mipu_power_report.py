"""The analysis of the MIPU power study (`minpro_jax.lab.mipu_power`; docs/mechanism.md, part 2).

    python -m minpro_jax.lab.mipu_power --out=results/mipu_power --report
    python -m minpro_jax.lab.mipu_power --report --compare="T~6=results/mipu_power,T~70=results/mipu_power_worked"

Reads every finished pair `<out>/k<k>_u<j>.json` and writes `<out>/summary.md`, `<out>/power.png` (ROC per n, SE
against n) and the tables between the markers ``<!-- BLOCK:begin ... -->`` / ``<!-- BLOCK:end -->`` of
docs/mechanism.md, BLOCK = `block_of(out)` ("mipu-power" for results/mipu_power, "mipu-power-<x>" for
results/mipu_power_<x>). ``--compare`` puts several studies side by side in the block "mipu-power-compare"
(`compare_table`). Per statistic (`mipu.STATISTICS`) and validation size n:

  * AUC: the ROC area of -statistic for "the update lowered J(mu)" (truth < 0), over every (pair, sub-draw); its 95 %
    bootstrap interval resamples pairs (a pair's sub-draws share its truth);
  * SE(n): the mean of the sub-draws' standard errors;
  * the typical true change, in the statistic's units: for T (t_post, delta_t) the root mean square over updates of
    E[T(theta') - T(theta_k)], for J (delta_j) of J(mu') - J(mu_k) (`typical_change`);
  * n_half: the n at which SE(n) = typical change / 2, from the largest n's SE at the 1/sqrt(n) rate; for delta_j
    also against the median |J(mu') - J(mu_k)|;
  * within checkpoints (issue 55; `within_checkpoint_table`): the AUC per checkpoint (its candidates share theta_k,
    so a statistic that drifts with the run's reward cannot score by telling checkpoints apart), the pooled AUC and
    the stratified AUC (only pairs of updates of one checkpoint compared), both with a bootstrap over checkpoints;
    and T normalised by the share of validation groups with a nonzero advantage (the groups that carry T: a group
    whose responses all fail has A = 0), from the records that hold that share (`t_post_norm`).
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

import numpy as np

from minpro_jax.lab.fidelity_model_report import TASKS, load_studies, replace_block
from minpro_jax.rl import mipu

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "mechanism.md")
BEGIN, END = "<!-- mipu-power:begin (python -m minpro_jax.lab.mipu_power --report) -->", "<!-- mipu-power:end -->"
COMPARE = "mipu-power-compare"
BOOT = 1000
Z_CALIBRATED, C_FIXED = 2.0, 1e-4  # the tolerances whose rollback rates the report shows


def block_of(out: str) -> str:
  """The docs block of the study in `out`: "mipu-power" for .../mipu_power, "mipu-power-<x>" for .../mipu_power_<x>."""
  name = os.path.basename(os.path.normpath(out))
  return "mipu-power" + (name[len("mipu_power") :].replace("_", "-") if name.startswith("mipu_power") else f"-{name}")


def load(out: str) -> list[dict]:
  """The finished pairs, ordered by (checkpoint, candidate)."""
  rows = [json.load(open(p)) for p in glob.glob(os.path.join(out, "k*_u*.json"))]
  return sorted(rows, key=lambda r: (r["checkpoint"], r["candidate"]))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """The ROC area (Mann-Whitney, ties counted half) of `scores` for the True `labels`; nan without both classes."""
  pos, neg = scores[labels], scores[~labels]
  if not pos.size or not neg.size:
    return math.nan
  greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
  return float(greater / (pos.size * neg.size))


def _values(pairs, stat: str, n: str) -> tuple[list[np.ndarray], np.ndarray]:
  return [np.array([d[stat] for d in p["by_n"][n]]) for p in pairs], np.array([p["truth"] < 0 for p in pairs])


def auc_with_interval(pairs, stat: str, n: str, rng) -> tuple[float, float, float]:
  """AUC of -stat for truth < 0 over every (pair, sub-draw), and its bootstrap 95 % interval over pairs."""
  vals, lowered = _values(pairs, stat, n)

  def one(idx):
    s = np.concatenate([vals[i] for i in idx])
    lab = np.concatenate([np.full(vals[i].size, lowered[i]) for i in idx])
    return auc(-s, lab)

  point = one(range(len(pairs)))
  boots = [one(rng.integers(0, len(pairs), len(pairs))) for _ in range(BOOT)]
  boots = np.array([b for b in boots if math.isfinite(b)])
  if not boots.size:
    return point, math.nan, math.nan
  return point, float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def _concordance(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """(concordant pairs, ties counted half; positive x negative pairs) of `scores` for the True `labels`."""
  pos, neg = scores[labels], scores[~labels]
  greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
  return float(greater), float(pos.size * neg.size)


def _by_checkpoint(pairs, stat: str, n: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """checkpoint -> (-stat over its pairs' sub-draws, whether each one's update lowered J)."""
  out = {}
  for k in sorted({p["checkpoint"] for p in pairs}):
    ps = [p for p in pairs if p["checkpoint"] == k]
    vals, lowered = _values(ps, stat, n)
    out[k] = (-np.concatenate(vals), np.concatenate([np.full(v.size, lo) for v, lo in zip(vals, lowered)]))
  return out


def checkpoint_aucs(pairs, stat: str, n: str, rng) -> dict[str, Any]:
  """The AUC of -stat for truth < 0 per checkpoint (nan where all its updates fall on one side), pooled over every
  (pair, sub-draw), and stratified: sum_k concordant_k / sum_k (pos_k neg_k), only pairs of one checkpoint
  compared; the last two with 95 % percentile intervals of a bootstrap over checkpoints (`BOOT` resamples).

  Returns {"per_checkpoint": {k: auc}, "pooled": (auc, low, high), "within": (auc, low, high)}."""
  by_k = _by_checkpoint(pairs, stat, n)
  ks = list(by_k)
  conc = {k: _concordance(*by_k[k]) for k in ks}

  def pooled(idx):
    return auc(np.concatenate([by_k[ks[i]][0] for i in idx]), np.concatenate([by_k[ks[i]][1] for i in idx]))

  def within(idx):
    num, den = (sum(conc[ks[i]][j] for i in idx) for j in (0, 1))
    return num / den if den else math.nan

  out = {"per_checkpoint": {k: (conc[k][0] / conc[k][1] if conc[k][1] else math.nan) for k in ks}}
  boots = rng.integers(0, len(ks), size=(BOOT, len(ks)))
  for name, fn in (("pooled", pooled), ("within", within)):
    b = np.array([fn(idx) for idx in boots])
    b = b[np.isfinite(b)]
    low, high = (float(np.quantile(b, q)) for q in (0.025, 0.975)) if b.size else (math.nan, math.nan)
    out[name] = (fn(range(len(ks))), low, high)
  return out


def normalised_t(pairs) -> list[dict] | None:
  """`pairs` with a statistic ``t_post_norm`` = t_post / (the share of the sub-draw's validation groups at theta'
  with a nonzero advantage) on every sub-draw, or None when the records lack that share (pairs from before
  issue 55: a rerun of the study records it)."""
  if not all("group_share" in d for p in pairs for ds in p["by_n"].values() for d in ds):
    return None
  norm = lambda d: d["t_post"] / d["group_share"] if d["group_share"] > 0 else 0.0  # noqa: E731
  return [{**p, "by_n": {n: [{**d, "t_post_norm": norm(d)} for d in ds] for n, ds in p["by_n"].items()}} for p in pairs]


def within_checkpoint_table(pairs: list[dict], rng) -> str:
  """Markdown: per statistic and n, the AUC per checkpoint, pooled and within checkpoints [95 % bootstrap over
  checkpoints] (`checkpoint_aucs`); `t_post_norm` too where the records allow it (`normalised_t`)."""
  sizes = sorted(pairs[0]["by_n"], key=int)
  ks = sorted({p["checkpoint"] for p in pairs})
  norm = normalised_t(pairs)
  stats = [(s, pairs) for s in mipu.STATISTICS] + ([("t_post_norm", norm)] if norm else [])
  lines = [
      '**Within checkpoints** (the candidates of a checkpoint share theta_k; AUC of -statistic for "the update '
      f"lowered J(mu)\" per checkpoint k = {', '.join(map(str, ks))}, pooled over all, and within checkpoints: only "
      "updates of one checkpoint compared; [95 % bootstrap over checkpoints]; – where a checkpoint's updates all "
      "fall on one side):",
      "",
      "| statistic | n | " + " | ".join(f"k = {k}" for k in ks) + " | pooled | within |",
      "|---|---:|" + "---:|" * (len(ks) + 2),
  ]
  for stat, ps in stats:
    for n in sizes:
      a = checkpoint_aucs(ps, stat, n, rng)
      per = " | ".join("–" if math.isnan(a["per_checkpoint"][k]) else f"{a['per_checkpoint'][k]:.2f}" for k in ks)
      ci = lambda t: f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"  # noqa: E731
      lines.append(f"| `{stat}` | {n} | {per} | {ci(a['pooled'])} | {ci(a['within'])} |")
  if norm is None:
    lines += [
        "",
        "T normalised by the share of validation groups with a nonzero advantage: these records lack that share "
        "(recorded since issue 55 as `group_share`); a rerun of the study adds the row `t_post_norm`.",
    ]
  return "\n".join(lines)


def typical_change(pairs, stat: str, n: str) -> tuple[float, float]:
  """The root mean square over updates of the statistic's expectation, debiased by its noise, and its one-sided 95 %
  upper bound: q_p = mean_p^2 - SE_p^2 / m_p (mean_p the mean of pair p's m_p sub-draws at size n) estimates
  E[stat_p]^2 without bias; returns (sqrt(max(mean q, 0)), sqrt(max(mean q + 1.645 SE(mean q), 0))). For `delta_j`
  the truth is used instead (q_p = truth^2 - truth_se^2): the same quantity measured more precisely."""
  if stat == "delta_j":
    q = np.array([p["truth"] ** 2 - p["truth_se"] ** 2 for p in pairs])
  else:
    q = np.array(
        [
            np.mean([x[stat] for x in p["by_n"][n]]) ** 2
            - np.mean([x[f"{stat}_se"] ** 2 for x in p["by_n"][n]]) / len(p["by_n"][n])
            for p in pairs
        ]
    )
  upper = q.mean() + 1.645 * (q.std(ddof=1) / math.sqrt(q.size) if q.size > 1 else math.inf)
  return float(math.sqrt(max(q.mean(), 0.0))), float(math.sqrt(max(upper, 0.0)))


def rollback_rates(pairs, n: str, c_calibrated: float) -> list[tuple[str, float, float]]:
  """(rule, rollback rate, fraction of rollbacks whose update truly lowered J) over every (pair, sub-draw)."""
  rules = (
      (f"t_post, fixed c = {C_FIXED:g}", "t_post", C_FIXED),
      (f"t_post, calibrated c = {c_calibrated:.2g} (z = {Z_CALIBRATED:g})", "t_post", c_calibrated),
      ("delta_t, c = 0", "delta_t", 0.0),
      ("delta_j, c = 0", "delta_j", 0.0),
  )
  out = []
  for name, stat, c in rules:
    vals, lowered = _values(pairs, stat, n)
    back = np.concatenate([~np.array([mipu.accept_update(x, c) for x in v]) for v in vals])
    lab = np.concatenate([np.full(v.size, lo) for v, lo in zip(vals, lowered)])
    out.append((name, float(back.mean()), float(lab[back].mean()) if back.any() else math.nan))
  return out


def tables(pairs: list[dict]) -> str:
  """The report's markdown (also written into docs/mechanism.md)."""
  rng = np.random.default_rng(0)
  sizes = sorted(pairs[0]["by_n"], key=int)
  n_max = sizes[-1]
  truth = np.array([p["truth"] for p in pairs])
  truth_se = np.array([p["truth_se"] for p in pairs])
  ks = sorted({p["checkpoint"] for p in pairs})
  plan = pairs[0]["plan"]
  lengths = [p["response_len"] for p in pairs if "response_len" in p]
  lines = [
      f"Task: {TASKS[plan.get('setting', 'short')]}"
      + (f"; validation responses of {np.mean(lengths):.1f} tokens on average at theta_k" if lengths else "")
      + (f"; draws in chunks of {plan['chunk_prompts']} prompts" if plan.get("chunk_prompts") else "")
      + ".",
      "",
      f"{len(pairs)} updates theta_k -> theta' at checkpoints k = {', '.join(map(str, ks))} of the GRPO run; truth "
      f"from {plan['truth']} coupled fp8 samples per policy (paired SE median {np.median(truth_se):.4f}); "
      f"{plan['val_prompts']} x {plan['val_group']} validation samples per pair, cut into sub-draws. "
      f"{pairs[0]['date']} to {pairs[-1]['date']}, {pairs[0]['cpu']}.",
      "",
      f"Truth J(mu') - J(mu_k): mean {truth.mean():+.4f}, sd {truth.std(ddof=1) if truth.size > 1 else math.nan:.4f}, "
      f"median |.| {np.median(np.abs(truth)):.4f}; lowered J in {int((truth < 0).sum())} of {truth.size} updates "
      f"({int((truth < -2 * truth_se).sum())} by more than 2 SE; {int((truth > 2 * truth_se).sum())} raised it by "
      "more than 2 SE).",
      "",
      "| checkpoint k | J(mu_k) | truth per candidate (x 1e-3) |",
      "|---:|---:|---|",
  ]
  for k in ks:
    ps = [p for p in pairs if p["checkpoint"] == k]
    per = ", ".join(f"{1e3 * p['truth']:+.1f}" for p in ps)
    lines.append(f"| {k} | {ps[0]['j_before']:.3f} | {per} |")
  lines += [
      "",
      '**AUC for "the update lowered J(mu)"** (ROC area of -statistic; [95 % bootstrap over updates]):',
      "",
      "| statistic | " + " | ".join(f"n = {n}" for n in sizes) + " |",
      "|---|" + "---:|" * len(sizes),
  ]
  for stat in mipu.STATISTICS:
    cells = []
    for n in sizes:
      a, lo, hi = auc_with_interval(pairs, stat, n, rng)
      cells.append(f"{a:.2f} [{lo:.2f}, {hi:.2f}]")
    lines.append(f"| `{stat}` | " + " | ".join(cells) + " |")
  (change_t, upper_t), (change_j, upper_j) = (typical_change(pairs, s, n_max) for s in ("delta_t", "delta_j"))
  lines += [
      "",
      "**Standard error against the typical true change** (SE: mean over sub-draws; the change an update makes to "
      "the statistic's expectation, root mean square over the updates [one-sided 95 % upper bound]: for T, "
      f"E[T(theta') - T(theta_k)] = {change_t:.1e} [{upper_t:.1e}] (from `delta_t` at n = {n_max}, debiased); for J, "
      f"J(mu') - J(mu_k) = {change_j:.1e} [{upper_j:.1e}] (from the truth, debiased); n_half: the n where SE = change "
      "/ 2 at 1/sqrt(n) from the largest n (at least the value from the upper bound); r: Pearson correlation with "
      f"the truth at n = {n_max}):",
      "",
      "| statistic | " + " | ".join(f"SE, n = {n}" for n in sizes) + " | typical change | n_half | r |",
      "|---|" + "---:|" * (len(sizes) + 3),
  ]
  for stat in mipu.STATISTICS:
    se = [np.mean([d[f"{stat}_se"] for p in pairs for d in p["by_n"][n]]) for n in sizes]
    change, upper = (change_j, upper_j) if stat == "delta_j" else (change_t, upper_t)
    half = lambda c: int(n_max) * (se[-1] / (0.5 * c)) ** 2 if c > 0 else math.inf  # noqa: E731
    n_half = f"{half(change):,.0f} (>= {half(upper):,.0f})" if change > 0 else f">= {half(upper):,.0f}"
    full = np.array([np.mean([d[stat] for d in p["by_n"][n_max]]) for p in pairs])
    r = float(np.corrcoef(full, truth)[0, 1]) if truth.size > 2 and full.std() > 0 else math.nan
    lines.append(
        f"| `{stat}` | " + " | ".join(f"{x:.2e}" for x in se) + f" | {change:.1e} [{upper:.1e}] | {n_half} | {r:+.2f} |"
    )
  same = [p["same_response_frac"] for p in pairs if "same_response_frac" in p]
  pairs_t = np.array([(d["t_post"], d["t_before"]) for p in pairs for d in p["by_n"][sizes[0]]])
  pairs_j = np.array([(d["delta_j"], d["delta_j_se"]) for p in pairs for d in p["by_n"][sizes[0]]])
  lines += [
      "",
      f"Coupling at n = {sizes[0]}: the correlation of T(theta') with T(theta_k) on the same sub-draw is "
      f"{np.corrcoef(pairs_t.T)[0, 1]:+.2f}; `delta_j` is exactly 0 on {np.mean(pairs_j[:, 0] == 0):.0%} of the "
      "sub-draws."
      + (
          f" Of the validation responses, {np.mean(same):.0%} are the same tokens at theta' and theta_k (mean of the "
          f"{len(same)} pairs that record it)."
          if same
          else ""
      ),
  ]
  se_j = np.mean([d["delta_j_se"] for p in pairs for d in p["by_n"][n_max]])
  typical = float(np.median(np.abs(truth)))
  lines += [
      "",
      f"`delta_j` against the literal criterion: SE = median |truth| / 2 = {typical / 2:.4f} at n = "
      f"{int(n_max) * (se_j / (typical / 2)) ** 2:,.0f} (SE {se_j:.4f} at n = {n_max}).",
  ]
  lines += ["", within_checkpoint_table(pairs, np.random.default_rng(1))]
  t0 = [d["t_before"] for p in pairs if p["checkpoint"] == ks[0] and p["candidate"] == 0 for d in p["by_n"][sizes[0]]]
  if len(t0) >= 2:
    c_cal = mipu.calibrated_tolerance(t0, Z_CALIBRATED)
    lines += [
        "",
        f"**Rollback rules at n = {sizes[0]}** (calibrated c from the {len(t0)} sub-draws of T(theta_0) at n = "
        f"{sizes[0]}: mean {np.mean(t0):+.2e}, sd {np.std(t0, ddof=1):.2e}):",
        "",
        "| rule | rollback rate | rollbacks that lowered J | base rate of lowering |",
        "|---|---:|---:|---:|",
    ]
    base = float((truth < 0).mean())
    for name, rate, prec in rollback_rates(pairs, sizes[0], c_cal):
      lines.append(f"| {name} | {rate:.0%} | {prec:.0%} | {base:.0%} |")
  return "\n".join(lines)


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(false-positive rates, true-positive rates) of the rule "score >= threshold" over every threshold."""
  order = np.argsort(-scores, kind="stable")
  lab = labels[order]
  tpr = np.concatenate([[0.0], np.cumsum(lab) / max(lab.sum(), 1)])
  fpr = np.concatenate([[0.0], np.cumsum(~lab) / max((~lab).sum(), 1)])
  return fpr, tpr


def plot(pairs: list[dict], path: str) -> None:
  """ROC per validation size (one panel each, one curve per statistic) and SE vs n, into one PNG at `path`."""
  import matplotlib
  import matplotlib.ticker

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sizes = sorted(pairs[0]["by_n"], key=int)
  fig, axes = plt.subplots(1, len(sizes) + 1, figsize=(4 * (len(sizes) + 1), 3.6))
  for ax, n in zip(axes, sizes):
    for stat in mipu.STATISTICS:
      vals, lowered = _values(pairs, stat, n)
      lab = np.concatenate([np.full(v.size, lo) for v, lo in zip(vals, lowered)])
      fpr, tpr = roc_curve(-np.concatenate(vals), lab)
      ax.plot(fpr, tpr, label=f"{stat} ({auc(-np.concatenate(vals), lab):.2f})")
    ax.plot([0, 1], [0, 1], color="gray", lw=0.5)
    ax.set(title=f"n = {n}: roll back iff stat < -c", xlabel="false rollbacks (J rose)", ylabel="lowered J caught")
    ax.legend(fontsize=7)
  ns = [int(n) for n in sizes]
  for stat in mipu.STATISTICS:
    se = [np.mean([d[f"{stat}_se"] for p in pairs for d in p["by_n"][n]]) for n in sizes]
    change = typical_change(pairs, "delta_j" if stat == "delta_j" else "delta_t", sizes[-1])[1]
    axes[-1].loglog(ns, np.array(se) / change, marker="o", label=stat)
  axes[-1].axhline(0.5, color="gray", lw=0.5)
  axes[-1].set_xticks(ns, [str(n) for n in ns], minor=False)
  axes[-1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  axes[-1].set_ylim(bottom=0.3)
  axes[-1].set(title="SE / typical true change (its upper bound)", xlabel="validation samples n")
  axes[-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def report(out: str, doc: str = DOC, block: str = "mipu-power") -> str:
  """Writes `<out>/summary.md` and the section of `doc` between `block`'s markers; returns the markdown."""
  pairs = load(out)
  if not pairs:
    raise SystemExit(f"error: no finished pair under {out}; run the study first")
  png = os.path.join(out, "power.png")
  plot(pairs, png)
  md = tables(pairs)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("# MIPU power study (minpro_jax.lab.mipu_power)\n\n" + md + "\n\n![ROC and SE vs n](power.png)\n")
  link = os.path.relpath(os.path.abspath(png), os.path.dirname(os.path.abspath(doc)))  # the plot, seen from the doc
  md += f"\n\n![ROC and SE vs n]({link})"
  replace_block(doc, block, f"\n{md}\n")
  print(md)
  return md


def compare_table(studies: dict[str, list[dict]]) -> str:
  """Markdown: per study (a row group), its task and size, the truth's spread, and per statistic the AUC at every
  validation size n of any study (a dash where the study has no such n) and n_half (`tables`' definitions)."""
  sizes = sorted({n for pairs in studies.values() for n in pairs[0]["by_n"]}, key=int)
  lines = [
      "| study | task, pairs, truth | statistic | " + " | ".join(f"AUC, n = {n}" for n in sizes) + " | n_half |",
      "|---|---|---|" + "---:|" * (len(sizes) + 1),
  ]
  rng = np.random.default_rng(0)
  for label, pairs in studies.items():
    plan, truth = pairs[0]["plan"], np.array([p["truth"] for p in pairs])
    lengths = [p["response_len"] for p in pairs if "response_len" in p]
    about = (
        f"{plan.get('setting', 'short')}{f', T = {np.mean(lengths):.0f}' if lengths else ''}; {len(pairs)} pairs; "
        f"truth of {plan['truth']} (SE {np.median([p['truth_se'] for p in pairs]):.4f}), median abs "
        f"{np.median(np.abs(truth)):.4f}, lowered J in {int((truth < 0).sum())}"
    )
    n_max = sorted(pairs[0]["by_n"], key=int)[-1]
    change = {s: typical_change(pairs, s, n_max)[0] for s in ("delta_t", "delta_j")}
    for i, stat in enumerate(mipu.STATISTICS):
      cells = []
      for n in sizes:
        if n not in pairs[0]["by_n"]:
          cells.append("–")
          continue
        a, lo, hi = auc_with_interval(pairs, stat, n, rng)
        cells.append(f"{a:.2f} [{lo:.2f}, {hi:.2f}]")
      se = np.mean([d[f"{stat}_se"] for p in pairs for d in p["by_n"][n_max]])
      c = change["delta_j" if stat == "delta_j" else "delta_t"]
      n_half = f"{int(n_max) * (se / (0.5 * c)) ** 2:,.0f}" if c > 0 else "∞"
      head = f"| {label} | {about} |" if i == 0 else "| | |"
      lines.append(f"{head} `{stat}` | " + " | ".join(cells) + f" | {n_half} |")
  return "\n".join(lines)


def compare_report(studies: dict[str, str], doc: str = DOC) -> str:
  """Writes the side-by-side table of `studies` (label -> study folder) into the block `COMPARE` of `doc`, prints
  and returns it. Raises SystemExit naming a folder with no finished pair."""
  table = compare_table(load_studies(studies, load, "pairs"))
  replace_block(doc, COMPARE, f"\n{table}\n")
  print(table)
  return table
