"""Report of the Tier B gradient-fidelity study (`minpro_jax.study.fidelity_model`; docs/mechanism.md).

    python -m minpro_jax.study.fidelity_model --out=results/fidelity_model --report

Reads the finished cells `<out>/s<s>.json` and `<out>/fp8.json` and writes `<out>/summary.md` (every table), `<out>/eta_by_drift.png`
and the tables between the Tier B markers of docs/mechanism.md. Raises SystemExit (one line) when `<out>` holds no
finished cell.
"""

from __future__ import annotations

import json
import os

import numpy as np

from minpro_jax.study import fidelity_toy as ft

DOC = os.path.join("docs", "mechanism.md")
BEGIN = "<!-- tier-b:begin (python -m minpro_jax.study.fidelity_model --report) -->"
END = "<!-- tier-b:end -->"


def load(out: str) -> list[dict]:
  """The finished cells of `out`, by drift s."""
  cells = [json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.endswith(".json")]
  return sorted(cells, key=lambda r: (r["drift"] == "fp8", int(r["drift"][1:]) if r["drift"] != "fp8" else 0))


def _ci(v: dict, prefix: str) -> str:
  eta, lo, hi = v[f"{prefix}eta"], v[f"{prefix}eta_low"], v[f"{prefix}eta_high"]
  if eta is None:
    return "—"
  return f"{eta:.3g} [{lo:.2g}, {hi:.2g}]"


def eta_table(cells, prefix: str = "") -> str:
  """Markdown: eta [95 % bootstrap interval over batches] per method (rows) and drift (columns); ``prefix`` "adam_"
  for the metric of Adam's preconditioner."""
  lines = ["| method | " + " | ".join(r["drift"] for r in cells) + " |", "|---" * (len(cells) + 1) + "|"]
  for m in ft.METHOD_NAMES:
    lines.append(f"| {m} | " + " | ".join(_ci(r["methods"][m], prefix) for r in cells) + " |")
  rows = (
      ("*J(mu) (reward of the stale batches)*", lambda r: f"{r['reward_mu']:.3f}"),
      ("*sd of sum log-ratio*", lambda r: f"{r['log_ratio_seq_sd']:.3f}"),
      ("*batches x samples*", lambda r: f"{r['batches']} x {r['num']}"),
  )
  lines += [f"| {name} | " + " | ".join(f(r) for r in cells) + " |" for name, f in rows]
  return "\n".join(lines) + "\n"


def contrast_table(cells, methods=("minpro:min", "minpro:prod", "grpo", "seq_is")) -> str:
  """Markdown: eta(method) - eta(cispo) with its paired 95 % bootstrap interval, Euclidean and Adam's metric."""
  lines = ["| eta(method) - eta(cispo) | " + " | ".join(r["drift"] for r in cells) + " |"]
  lines.append("|---" * (len(cells) + 1) + "|")
  for prefix, label in (("", ""), ("adam_", " (Adam)")):
    for m in methods:
      out = []
      for r in cells:
        v, ref = r["methods"][m], r["methods"]["cispo"]
        if v[f"{prefix}eta"] is None or ref[f"{prefix}eta"] is None:
          out.append("—")
          continue
        d = v[f"{prefix}eta"] - ref[f"{prefix}eta"]
        out.append(f"{d:+.2g} [{v[f'{prefix}eta_diff_low']:+.2g}, {v[f'{prefix}eta_diff_high']:+.2g}]")
      lines.append(f"| {m}{label} | " + " | ".join(out) + " |")
  return "\n".join(lines) + "\n"


def other_table(cells) -> str:
  """Markdown: projection E<g, g*>/|g*|^2 (± SE), bias cos(E g, g*) and tr Cov/|g*|^2 per method and drift."""
  lines = ["| method | " + " | ".join(f"{r['drift']}: proj / cos / trCov" for r in cells) + " |"]
  lines.append("|---" * (len(cells) + 1) + "|")
  for m in ft.METHOD_NAMES:
    out = []
    for r in cells:
      v = r["methods"][m]
      cos = "—" if v["bias_cos"] is None else f"{v['bias_cos']:.2f}"
      out.append(f"{v['projection']:.3g}±{v['projection_se']:.2g} / {cos} / {v['trace_cov']:.3g}")
    lines.append(f"| {m} | " + " | ".join(out) + " |")
  return "\n".join(lines) + "\n"


def weight_table(r: dict) -> str:
  """Markdown: per method and response position, the token weight's mean [5 %, 95 %] and ESS of one cell."""
  pos = r["positions"]
  lines = [f"drift {r['drift']}; each entry: mean [q05, q95] ESS\n", "| method | " + " | ".join(f"t={p}" for p in pos)]
  lines[-1] += " |"
  lines.append("|---" * (len(pos) + 1) + "|")
  for m, v in r["methods"].items():
    cols = []
    for a, b, c, e in zip(v["weight_mean"], v["weight_q05"], v["weight_q95"], v["ess"]):
      cols.append("—" if a is None else f"{a:.2g} [{b:.2g}, {c:.2g}] {e:.2f}")
    lines.append(f"| {m} | " + " | ".join(cols) + " |")
  return "\n".join(lines) + "\n"


def setting_line(cells) -> str:
  r = cells[0]
  return (
      f"k = {r['updates']} GRPO updates (seed {r['seed']}); J(pi) = {r['J_pi']:.3f}; truth: 2 halves of "
      f"{r['truth_samples_per_half']} on-policy samples, cos(g_A, g_B) = {r['truth_cos']:.2f} (Adam's metric "
      f"{r['adam_truth_cos']:.2f}); {r['date']}, {r['cpu']}.\n"
  )


def plot(cells, path: str) -> str | None:
  """PNG: eta against the drift s, a line per method; Euclidean and Adam's metric side by side."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = [r for r in cells if r["drift"] != "fp8"]
  if len(cells) < 2:
    return None
  s = [int(r["drift"][1:]) for r in cells]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
  for ax, (prefix, title) in zip(axes, (("", "Euclidean"), ("adam_", "Adam's preconditioner"))):
    for i, m in enumerate(ft.METHOD_NAMES):
      ys = [np.nan if r["methods"][m][f"{prefix}eta"] is None else r["methods"][m][f"{prefix}eta"] for r in cells]
      ax.plot(s, ys, marker="o", ms=3, label=m, ls="-" if i < 5 else "--")
    ax.set_xscale("symlog", linthresh=8)
    ax.set_xticks(s, [str(x) for x in s])
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_title(f"eta, {title}", fontsize=9)
    ax.set_xlabel("drift s (updates)")
  axes[-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def report(out: str, doc: str = DOC) -> int:
  """Writes `out`/summary.md, the plot and the tables between the markers of `doc`; returns 0."""
  cells = load(out) if os.path.isdir(out) else []
  if not cells:
    raise SystemExit(f"error: no finished cells in {out}; run the study first (without --report)")
  eta = "\n**eta [95 % interval over batches], Euclidean metric**\n\n" + eta_table(cells)
  eta += "\n**eta under Adam's preconditioner (second moments at k)**\n\n" + eta_table(cells, "adam_")
  eta += "\n**Paired differences against cispo (= minpro `none`)**\n\n" + contrast_table(cells)
  parts = ["# Tier B gradient fidelity (tiny transformer, T ~ 6)\n\n", setting_line(cells), eta]
  parts += ["\n## projection / bias cos / tr Cov\n\n", other_table(cells)]
  parts += ["\n## token weight by response position\n\n"] + [
      weight_table(r) + "\n" for r in cells if r["drift"] != "s0"
  ]
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("".join(parts))
  png = plot(cells, os.path.join(out, "eta_by_drift.png"))
  wrote = [os.path.join(out, "summary.md")] + ([png] if png else [])
  if os.path.exists(doc):
    text = open(doc).read()
    if BEGIN in text and END in text:
      last = [r for r in cells if r["drift"] != "fp8"][-1]  # the largest drift s
      body = "\n" + setting_line(cells) + eta + "\n**Token weight by response position**\n\n" + weight_table(last)
      text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + body + "\n" + text[text.index(END) :]
      with open(doc, "w") as f:
        f.write(text)
      wrote.append(f"the Tier B tables of {doc}")
  print("wrote " + ", ".join(wrote))
  return 0
