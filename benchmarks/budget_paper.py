"""One global step of each paper setting, estimated from compiled programs (`python -m minpro_jax.aot --budget`).

Each entry is one budget call whose JSON goes to benchmarks/results/aot/budget_<name>.json and whose optimized HLO
goes to a dump folder (default $TMPDIR/minpro_budget_hlo/<name>, not committed: tens of MB). An entry with a JSON
is skipped (`--force` redoes it); `--recost` rebuilds the JSONs from the dumps without compiling (after a change to
the cost model or with another `--lengths`); `--only` picks entries by substring; `--summary` prints the step rows.

Lengths: gamma(shape 2, mean 8,192) clipped at the config's max_new_tokens (mean ~8.1k at 20,480, 3.9 % truncated)
for the MinPRO configs, mean 3,000 at MIPU's 8,192; prompts of 256 real tokens. The configs are used as they stand
(prompt bucket data.max_prompt_tokens), so the figures move when the sampler and learner issues change the code.
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
PAPER = "minpro_jax/configs/paper"
MINPRO_LENGTHS = ["--lengths=gamma:mean=8192", "--prompt-len=256"]
MIPU_LENGTHS = ["--lengths=gamma:mean=3000", "--prompt-len=256"]

ENTRIES = [
    ("qwen3_8b_v5p-64", "v5p-64", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v5p-32", "v5p-32", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_8b_v6e-16", "v6e-16", [f"--config={PAPER}/qwen3_8b.py", *MINPRO_LENGTHS]),
    ("qwen3_4b_mipu_v5p-8", "v5p-8", [f"--config={PAPER}/mipu_qwen3_4b.py", *MIPU_LENGTHS]),
    ("qwen3_30b_a3b_v5p-32", "v5p-32", [f"--config={PAPER}/qwen3_30b_a3b.py", *MINPRO_LENGTHS]),
]


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="substring of the entry names to run")
  p.add_argument("--force", action="store_true", help="redo entries that have a JSON")
  p.add_argument("--recost", action="store_true", help="rebuild the JSONs from the HLO dumps, no compile")
  p.add_argument("--hlo", default=os.path.join(tempfile.gettempdir(), "minpro_budget_hlo"), help="dump folder")
  p.add_argument("--summary", action="store_true", help="print each entry's step row")
  args = p.parse_args()
  for name, topology, extra in ENTRIES:
    if args.only and args.only not in name:
      continue
    out = OUT / f"budget_{name}.json"
    if args.summary:
      if out.exists():
        rows = json.loads(out.read_text())["rows"]
        step = next(r for r in rows if r["part"] == "step")
        samp = next((r for r in rows if r["part"] == "sampling"), {})
        print(f"{name}: step {step.get('seconds_overlapped', 0) / 3600:.2f} h, bound {step['bound_seconds']:.0f} s, "
              f"ratio {step.get('ratio', float('nan')):.1f}x; sampling ratio {samp.get('ratio') or float('nan'):.1f}x")  # fmt: skip
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
  return 0


if __name__ == "__main__":
  sys.exit(main())
