"""One global step of each paper setting, estimated from compiled programs (`python -m minpro_jax.aot --budget`).

Each entry is one budget call whose JSON goes to benchmarks/results/aot/budget_<name>.json and whose optimized HLO
goes to a dump folder (default $TMPDIR/minpro_budget_hlo/<name>, not committed: tens of MB). An entry with a JSON
is skipped (`--force` redoes it); `--recost` rebuilds the JSONs from the dumps without compiling (after a change to
the cost model or with another `--lengths`); `--only` picks entries by substring; `--summary` prints a Markdown table of the committed entries.

Lengths: gamma(shape 2, mean 8,192) clipped at the config's max_new_tokens (mean ~8.1k at 20,480, 3.9 % truncated)
for the MinPRO configs, mean 3,000 at MIPU's 8,192; prompts of 256 real tokens. The configs are used as they stand
(prompt bucket data.max_prompt_tokens), so the figures move when the sampler and learner issues change the code.
Qwen3-8B on v5p-64 has its before and after: `_fsdp_dense` (the learner's mesh, 64 rows, the dense cache: the
config of 2026-12-03), `_sampler_layout` (its own mesh and rows, dense), `_paged` (paged on mesh=auto) and the config
as it stands (paged on data x tensor=8); `_forecast` is the config as it stands costed on 2026-12-07 with the
forecast beside the roofline (issue 54: the score pass on every 10th step, the evaluation on its own program and
calls), beside the older rows it does not replace; `_forecast_decode54` the same configs after issue 54's item 3 (the
decode step without K/V or logits all-gathers), beside the `_forecast` rows from before it; `_bisect54` the v5p-64
config after top-p's past-the-candidates branch stopped gathering the logits; `_dense_delay59` / `_inflight59` the
in-flight mode (issue 59) beside delay mode on the dense continuous sampler it runs.
Needs libtpu (`make setup`). Each entry compiles 4 programs, 5-40 minutes on this project's 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "aot"
PAPER = "configs/paper"
MINPRO_LENGTHS = ["--lengths=gamma:mean=8192", "--prompt-len=256"]
MIPU_LENGTHS = ["--lengths=gamma:mean=3000", "--prompt-len=256"]

# the baseline the issues started from: the learner's FSDP mesh and rules, 64 decode rows, the dense cache
FSDP_DENSE = ["--config.sampling.mesh=", "--config.sampling.decode_rows=64", "--config.sampling.kv_cache=dense"]

# the sampler on its own layout (issue 36): data x tensor with tensor groups within a host, weights resident, and
# as many decode rows as each chip's HBM holds beside them and the learner's state; the dense cache
SAMPLER_LAYOUT = ["--config.sampling.mesh=auto", "--config.sampling.decode_rows=auto"]
DENSE_LAYOUT = [*SAMPLER_LAYOUT, "--config.sampling.kv_cache=dense"]

# the paged sampler on that layout (pages of 128 tokens, 1k-token kernel blocks of 8 pages), sampling and transfer
# only: the learner's parts are the first entry's. The Qwen3-8B paper config itself runs paged on data=-1 x tensor=8
PAGED = [*SAMPLER_LAYOUT, "--config.sampling.kv_cache=paged", "--config.sampling.page_size=128"]
SAMPLER_PARTS = ["--parts=sampling,transfer"]
LEARNER = "--parts=score,update"
SPLIT = ["--config.sampling.devices=16", "--config.micro_batch_size=16", "--parts=sampling,score,update"]

INFLIGHT_BASE = [
    "--config.sampling.kv_cache=dense",
    "--config.sampling.decode_rows=256",
    "--parts=sampling,transfer,score",
]
INFLIGHT = ["--config.staleness.mode=inflight", "--config.staleness.inflight_every=16",
            "--config.staleness.inflight_kv=recompute"]  # fmt: skip

ENTRIES = [
    ("qwen3_8b_v5p-64", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v5p-64_forecast", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v5p-64_fsdp_dense", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *FSDP_DENSE]),
    ("qwen3_8b_v5p-64_sampler_layout", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *DENSE_LAYOUT]),
    ("qwen3_8b_v5p-64_paged", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *PAGED, *SAMPLER_PARTS]),
    # issue 37: the learner's packed rows (learner.row_tokens, in the paper configs since 2026-12-05) and its programs
    # without windowed einsums (runtime/xla_options.py); the learner's parts only
    ("qwen3_8b_v5p-64_packed", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *DENSE_LAYOUT, LEARNER]),
    # the overlapped step: the sampler on 16 of the 32 chips (data=8 x tensor=2), the learner on the other 16
    ("qwen3_8b_v5p-64_split16", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *DENSE_LAYOUT, *SPLIT]),
    ("qwen3_8b_v5p-32", "v5p-32", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v6e-16", "v6e-16", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_4b_mipu_v5p-8", "v5p-8", [f"--config={PAPER}/mipu_qwen3_4b.py", *MIPU_LENGTHS]),
    ("qwen3_30b_a3b_v5p-32", "v5p-32", [f"--config={PAPER}/qwen3_30b_a3b.py", *MINPRO_LENGTHS]),
    # the configs as they stand, costed with the forecast (2026-12-07), beside the rows above
    ("qwen3_8b_v5p-32_forecast", "v5p-32", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v6e-16_forecast", "v6e-16", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_4b_mipu_v5p-8_forecast", "v5p-8", [f"--config={PAPER}/mipu_qwen3_4b.py", *MIPU_LENGTHS]),
    # after issue 54 item 3 (2026-12-07): the decode step writes K/V per KV head in a shard_map and draws the token per
    # vocabulary shard (no all-gather of K/V or logits); the `_forecast` rows above are the same configs before it
    ("qwen3_8b_v5p-64_forecast_decode54", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v5p-32_forecast_decode54", "v5p-32", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v6e-16_forecast_decode54", "v6e-16", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_4b_mipu_v5p-8_forecast_decode54", "v5p-8", [f"--config={PAPER}/mipu_qwen3_4b.py", *MIPU_LENGTHS]),
    # after the top-p draw past its candidates bisects for the nucleus instead of gathering the logits (the
    # evaluation's setting): the `_decode54` row above is the same config before it
    ("qwen3_8b_v5p-64_forecast_bisect54", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    # issue 59: the in-flight mode (the dense continuous sampler it runs, d = 2, k = 16, the swap's recompute costed
    # from the score pass) beside delay mode on the same sampler
    ("qwen3_8b_v5p-64_dense_delay59", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *INFLIGHT_BASE]),
    ("qwen3_8b_v5p-64_inflight59", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS, *INFLIGHT_BASE,
                                              *INFLIGHT]),  # fmt: skip
]


def main() -> int:
  """Runs, re-costs or summarises the entries (module docstring); returns 0 (a failed entry is reported and skipped)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="substring of the entry names to run")
  p.add_argument("--force", action="store_true", help="redo entries that have a JSON")
  p.add_argument("--recost", action="store_true", help="rebuild the JSONs from the HLO dumps, no compile")
  p.add_argument("--hlo", default=os.path.join(tempfile.gettempdir(), "minpro_budget_hlo"), help="dump folder")
  p.add_argument("--summary", action="store_true", help="print each entry's step row")
  args = p.parse_args()
  rows = []
  for name, topology, extra in ENTRIES:
    if args.only and args.only not in name:
      continue
    out = OUT / f"budget_{name}.json"
    if args.summary:
      rows.append((name, json.loads(out.read_text())["rows"]) if out.exists() else (name, None))
      continue
    if out.exists() and not (args.force or args.recost):
      print(f"# {name}: done ({out.name})", flush=True)
      continue
    dump = os.path.join(args.hlo, name)
    how = [f"--hlo-from={dump}"] if args.recost else [f"--dump-hlo={dump}"]
    cmd = [sys.executable, "-m", "minpro_jax.aot", "--budget", f"--topology={topology}", *extra, *how, f"--out={out}"]
    print("# " + " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd, cwd=REPO).returncode:
      print(f"# {name}: failed", flush=True)
  if args.summary:
    print(summary(rows))
  return 0


def _h(s) -> str:
  return "" if s is None else (f"{s / 3600:.2f} h" if s >= 3600 else f"{s:,.0f} s")


def summary(entries) -> str:
  """One line per entry: the step's roofline with and without evaluation, its bound and ratio, the forecast band
  (entries costed since the forecast, 2026-12-07), and each part's roofline / bound."""
  head = ("| entry | sampler layout | step | step without eval | bound (without eval) | ours / bound "
          "| forecast low / central / high | sampling | score | update |")  # fmt: skip
  lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, rows in entries:
    if rows is None:
      lines.append(f"| {name} | | not run | | | | | | |")
      continue
    part = {r["part"]: r for r in rows}
    for r in rows:  # "score (1/10)": the score pass on the steps the trainer runs it
      part.setdefault(r["part"].split(" (")[0], r)
    # entries from before the field: the learner's mesh and rules, 64 decode rows
    layout = f"{rows[0].get('sampler_layout') or rows[0]['mesh'] + ' (learner rules)'}, {rows[0].get('decode_rows', 64)} rows"

    def cell(p):
      r = part.get(p, {})
      if r.get("fits") is False:
        size = (r.get("memory") or {}).get("total_bytes") or (r.get("memory") or {}).get("temp_bytes") or 0
        return f"does not fit ({size / 2**30:.0f} GiB)"
      ratio = r.get("ratio")
      return f"{_h(r.get('seconds_overlapped'))} ({ratio:.1f}x)" if ratio else _h(r.get("seconds_overlapped"))

    ev = next((r for r in rows if r["part"].startswith("eval") and not r.get("sub")), {})
    step = part.get("step") or part["step (overlapped)"]  # a split (sampling.devices): its overlapped step
    if step.get("seconds_overlapped") is None:  # a part does not fit: no step time
      bound = (step.get("bound_seconds") or 0) - (ev.get("bound_seconds") or 0)
      lines.append(
          f"| {name} | {layout} | n/a | n/a | {_h(bound)} | | | {cell('sampling')} | {cell('score')} | {cell('update')} |"
      )
      continue
    f = (step.get("forecast") or {}).get("seconds")
    band = " / ".join(_h(f[k]) for k in ("low", "central", "high")) if f else "not costed"
    no_eval = (step.get("seconds_overlapped") or 0) - (ev.get("seconds_overlapped") or 0)
    bound = (step.get("bound_seconds") or 0) - (ev.get("bound_seconds") or 0)
    ratio = f"{no_eval / bound:.1f}x" if bound and step.get("seconds_overlapped") else ""
    lines.append(
        f"| {name} | {layout} | {_h(step.get('seconds_overlapped'))} | {_h(no_eval)} | {_h(bound)} | {ratio} | "
        f"{band} | {cell('sampling')} | {cell('score')} | {cell('update')} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
