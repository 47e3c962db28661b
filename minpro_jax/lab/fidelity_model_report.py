"""Report of the Tier B gradient-fidelity study (`minpro_jax.lab.fidelity_model`; docs/mechanism.md).

    python -m minpro_jax.lab.fidelity_model --out=results/fidelity_model --report
    python -m minpro_jax.lab.fidelity_model --report --compare="T~6=results/fidelity_model,T~70=results/fidelity_model_worked"

Reads the finished cells `<out>/s<s>.json` and `<out>/fp8.json` and writes `<out>/summary.md` (every table), `<out>/eta_by_drift.png`
and the tables between the markers ``<!-- BLOCK:begin ... -->`` and ``<!-- BLOCK:end -->`` of docs/mechanism.md,
BLOCK = `block_of(out)` ("tier-b" for results/fidelity_model, "tier-b-<name>" for results/fidelity_model_<name>).
``--compare`` puts several studies (settings, seeds) side by side in the block "tier-b-compare": the contrasts
min - none and min - prod per drift. Raises SystemExit (one line) when a study folder holds no finished cell.
"""

from __future__ import annotations

import json
import os

import numpy as np

from minpro_jax.lab import fidelity_toy as ft

DOC = os.path.join("docs", "mechanism.md")
BEGIN = "<!-- tier-b:begin (python -m minpro_jax.lab.fidelity_model --report) -->"
END = "<!-- tier-b:end -->"
COMPARE = "tier-b-compare"
TASKS = {"short": "three-term chain_sum (T ~ 6)", "worked": "eight-term chain_sum, worked steps (T ~ 70)"}


def block_of(out: str) -> str:
  """The docs block of the study in `out`: "tier-b" for .../fidelity_model, "tier-b-<x>" for .../fidelity_model_<x>."""
  name = os.path.basename(os.path.normpath(out))
  return "tier-b" + (
      name[len("fidelity_model") :].replace("_", "-") if name.startswith("fidelity_model") else f"-{name}"
  )


def replace_block(doc: str, block: str, body: str) -> bool:
  """Puts `body` between `doc`'s markers ``<!-- block:begin ...-->`` and ``<!-- block:end -->``; False when `doc`
  or its markers are missing (nothing written)."""
  if not os.path.exists(doc):
    return False
  text = open(doc).read()
  begin, end = f"<!-- {block}:begin", f"<!-- {block}:end -->"
  if begin not in text or end not in text:
    return False
  head = text.index("-->", text.index(begin)) + len("-->")
  text = text[:head] + "\n" + body + "\n" + text[text.index(end) :]
  with open(doc, "w") as f:
    f.write(text)
  return True


def load(out: str) -> list[dict]:
  """The finished cells of `out`, by drift s."""
  cells = [json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.endswith(".json")]
  for r in cells:  # records from before the worked-step setting
    r.setdefault("setting", "short")
  return sorted(cells, key=lambda r: (r["drift"] == "fp8", int(r["drift"][1:]) if r["drift"] != "fp8" else 0))


def _pair(lo, hi) -> str:
  """ "[-0.01, +0.02]" of a paired interval; "[undefined]" where the truth's resamples could not give one."""
  return "[undefined]" if lo is None or hi is None else f"[{lo:+.2g}, {hi:+.2g}]"


def _ci(v: dict, prefix: str) -> str:
  eta, lo, hi = v[f"{prefix}eta"], v[f"{prefix}eta_low"], v[f"{prefix}eta_high"]
  if eta is None:
    return "—"
  return f"{eta:.3g}" + ("" if lo is None or hi is None else f" [{lo:.2g}, {hi:.2g}]")


def eta_table(cells, prefix: str = "") -> str:
  """Markdown: eta [95 % bootstrap interval: over batches, and over the truth's chunks too in records since issue 55
  (their "interval")] per method (rows) and drift (columns); ``prefix`` "adam_" for Adam's preconditioner."""
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
        out.append(f"{d:+.2g} {_pair(v[f'{prefix}eta_diff_low'], v[f'{prefix}eta_diff_high'])}")
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


def split_table(cells, methods=("minpro:min", "minpro:prod", "cispo", "grpo")) -> str:
  """Markdown: per method and drift, the mean token weight on rewarded / on unrewarded responses (issue 55: in
  Tier A's c3i toy the prefix minimum weighs both alike, in its c1d toy it falls after a failed response's first
  error), and the rewarded tokens' share."""
  lines = ["| method | " + " | ".join(r["drift"] for r in cells) + " |", "|---" * (len(cells) + 1) + "|"]
  for m in methods:
    cols = [f"{r['methods'][m]['weight_rewarded']:.2f} / {r['methods'][m]['weight_unrewarded']:.2f}" for r in cells]
    lines.append(f"| {m} | " + " | ".join(cols) + " |")
  lines.append("| *rewarded tokens* | " + " | ".join(f"{r['rewarded_token_share']:.2f}" for r in cells) + " |")
  return "\n".join(lines) + "\n"


def setting_line(cells) -> str:
  r = cells[0]
  length = next((c["response_tokens_mean"] for c in cells if c.get("response_tokens_mean")), None)
  task = TASKS.get(r["setting"], r["setting"]) + (f", responses of {length:.0f} tokens on average" if length else "")
  return (
      f"{task}; k = {r['updates']} GRPO updates (seed {r['seed']}); J(pi) = {r['J_pi']:.3f}; truth: 2 halves of "
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


def report(out: str, doc: str = DOC, block: str = "tier-b") -> int:
  """Writes `out`/summary.md, the plot and the tables between the markers of `block` in `doc`; returns 0."""
  cells = load(out) if os.path.isdir(out) else []
  if not cells:
    raise SystemExit(f"error: no finished cells in {out}; run the study first (without --report)")
  over = "batches and the truth's chunks" if all("interval" in r for r in cells) else "batches"
  eta = f"\n**eta [95 % interval over {over}], Euclidean metric**\n\n" + eta_table(cells)
  eta += "\n**eta under Adam's preconditioner (second moments at k)**\n\n" + eta_table(cells, "adam_")
  eta += "\n**Paired differences against cispo (= minpro `none`)**\n\n" + contrast_table(cells)
  parts = ["# Tier B gradient fidelity (tiny transformer)\n\n", setting_line(cells), eta]
  parts += ["\n## projection / bias cos / tr Cov\n\n", other_table(cells)]
  parts += ["\n## token weight by response position\n\n"] + [
      weight_table(r) + "\n" for r in cells if r["drift"] != "s0"
  ]
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("".join(parts))
  png = plot(cells, os.path.join(out, "eta_by_drift.png"))
  wrote = [os.path.join(out, "summary.md")] + ([png] if png else [])
  stale = [r for r in cells if r["drift"] != "fp8"]
  last = (stale or cells)[-1]  # the largest drift s
  body = "\n" + setting_line(cells) + eta + "\n**Token weight by response position**\n\n" + weight_table(last)
  if all("weight_rewarded" in r["methods"]["cispo"] for r in cells):  # recorded since issue 55
    split = "\n**Mean token weight on rewarded / unrewarded responses**\n\n" + split_table(cells)
    body += split
    with open(os.path.join(out, "summary.md"), "a") as f:
      f.write(split)
  if replace_block(doc, block, body):
    wrote.append(f"the {block} tables of {doc}")
  print("wrote " + ", ".join(wrote))
  return 0


def _contrast(r: dict, a: str, b: str) -> str:
  """eta(a) - eta(b) of one cell, with the paired 95 % interval when b is the reference (cispo)."""
  va, vb = r["methods"][a], r["methods"][b]
  if va["eta"] is None or vb["eta"] is None:
    return "—"
  d = va["eta"] - vb["eta"]
  if b == "cispo":
    return f"{d:+.2g} {_pair(va['eta_diff_low'], va['eta_diff_high'])}"
  return f"{d:+.2g}"  # the records hold paired intervals against cispo only


def compare_table(studies: dict[str, list[dict]]) -> str:
  """Markdown: per study (a row group) and drift (columns), eta(cispo), eta(min) - eta(cispo) [paired 95 %],
  eta(min) - eta(prod) and the sd of the summed log-ratio (Euclidean metric)."""
  drifts = []
  for cells in studies.values():
    drifts += [r["drift"] for r in cells if r["drift"] not in drifts]
  drifts = sorted(drifts, key=lambda d: (d == "fp8", int(d[1:]) if d != "fp8" else 0))
  lines = ["| study | quantity | " + " | ".join(drifts) + " |", "|---|---" + "|---" * len(drifts) + "|"]
  rows = (
      ("eta(none = cispo)", lambda r: _ci(r["methods"]["cispo"], "")),
      ("eta(min) - eta(none)", lambda r: _contrast(r, "minpro:min", "cispo")),
      ("eta(min) - eta(prod)", lambda r: _contrast(r, "minpro:min", "minpro:prod")),
      ("sd of sum log-ratio", lambda r: f"{r['log_ratio_seq_sd']:.2f}"),
  )
  for label, cells in studies.items():
    by = {r["drift"]: r for r in cells}
    r0 = cells[0]
    length = r0.get("response_tokens_mean")
    name = f"{label} (seed {r0['seed']}, {r0['batches']} x {r0['num']}" + (f", T {length:.0f})" if length else ")")
    for i, (q, f) in enumerate(rows):
      lines.append(
          f"| {name if i == 0 else ''} | {q} | " + " | ".join(f(by[d]) if d in by else "—" for d in drifts) + " |"
      )
  return "\n".join(lines) + "\n"


def load_studies(studies: dict[str, str], load_fn, what: str) -> dict[str, list]:
  """label -> `load_fn(folder)` for each of `studies` (label -> study folder). Raises SystemExit naming a folder
  with no finished `what` (e.g. "cells")."""
  loaded = {}
  for label, out in studies.items():
    records = load_fn(out) if os.path.isdir(out) else []
    if not records:
      raise SystemExit(f"error: no finished {what} in {out}; run the study first (without --report)")
    loaded[label] = records
  return loaded


def compare_report(studies: dict[str, str], doc: str = DOC) -> int:
  """Writes the side-by-side table of `studies` (label -> study folder) into the block `COMPARE` of `doc` and
  prints it; returns 0. Raises SystemExit naming a folder with no finished cell."""
  table = compare_table(load_studies(studies, load, "cells"))
  print(table)
  if replace_block(doc, COMPARE, "\n" + table):
    print(f"wrote the {COMPARE} table of {doc}")
  return 0
