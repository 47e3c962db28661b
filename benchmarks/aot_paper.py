"""The papers' settings compiled for TPU slices with `python -m minpro_jax.aot` (compile-only; nothing runs).

Each entry below is one `python -m minpro_jax.aot` call whose JSON goes to benchmarks/results/aot/<name>.json;
a call resumes from its file (rows already compiled are kept), so this script can be stopped and rerun any
number of times, and `--only` picks entries by substring. `--summary` writes benchmarks/results/aot/README.md
(every row of every file, one table per file) without compiling anything.

Settings: MinPRO (arXiv 2601.22718) through its paper configs (configs/paper/qwen3_*.py: 256 prompts x
16 responses per step, 16 updates per step, 2,048 + 20,480 tokens, micro-batches of 16, fp32 parameters, bf16
compute, remat block, scanned layers; delay 2). MIPU (arXiv 2606.29526) trains Qwen3-1.7B/4B; its rows were
compiled before its paper configs (configs/paper/mipu_qwen3_*.py) existed, so they reuse the Qwen3-8B config with
the model preset swapped and 1,024 + 8,192 tokens (its maximum length is not stated: an assumption), which keeps
them comparable with each other. The sampler rows use 64 decode rows (the continuous
sampler's default), because a whole step's 4,096 rows of 22,528-token KV cache cannot fit any slice (the
`*_batch` entry shows it).

Needs libtpu (`make setup`). Each compile takes 1-25 minutes on this project's 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "aot"
PAPER = "configs/paper"
# the Qwen3-8B config at the micro-batch these rows were compiled with (it is sized for v5p-64 now: 32)
QWEN3_8B = [f"--config={PAPER}/qwen3_8b.py", "--config.micro_batch_size=16"]
MIPU_1P7B = [*QWEN3_8B, "--config.model.preset=qwen3-1.7b"]
MIPU_4B = [*QWEN3_8B, "--config.model.preset=qwen3-4b"]
MIPU_LEN = ["--config.data.max_prompt_tokens=1024", "--config.sampling.max_new_tokens=8192"]
LEARNER = ["--programs=update,score"]
SAMPLER = ["--programs=prefill,decode", "--sampler-rows=64"]

# (name, topology, arguments): the MinPRO models first (the paper's claims), the smallest slice that fits first
ENTRIES = [
    ("qwen3_8b_v5p-8_learner", "v5p-8", [*QWEN3_8B, "--mesh=fsdp=-1", *LEARNER]),
    ("qwen3_8b_v5p-8_sampler", "v5p-8", [*QWEN3_8B, "--mesh=fsdp=-1", *SAMPLER]),
    (
        "qwen3_30b_a3b_v5p-16_learner",
        "v5p-16",
        [f"--config={PAPER}/qwen3_30b_a3b.py", "--mesh=fsdp=-1", "--mesh=expert=8", "--programs=update"],
    ),
    ("qwen3_14b_v5p-16_learner", "v5p-16", [f"--config={PAPER}/qwen3_14b.py", "--mesh=fsdp=-1", "--programs=update"]),
    ("qwen3_8b_v5p-16_learner", "v5p-16", [*QWEN3_8B, "--mesh=fsdp=-1", "--programs=update"]),
    (
        "qwen3_30b_a3b_v5p-32_learner",
        "v5p-32",
        [f"--config={PAPER}/qwen3_30b_a3b.py", "--mesh=fsdp=-1", "--mesh=expert=2,fsdp=-1", "--programs=update"],
    ),
    ("qwen3_4b_v5p-8", "v5p-8", [*MIPU_4B, *MIPU_LEN, "--mesh=fsdp=-1", *LEARNER]),
    ("qwen3_1p7b_v5p-8", "v5p-8", [*MIPU_1P7B, *MIPU_LEN, "--mesh=fsdp=-1", "--mesh=data=2,fsdp=-1", *LEARNER]),
    ("qwen3_1p7b_v5p-8_sampler", "v5p-8", [*MIPU_1P7B, *MIPU_LEN, "--mesh=fsdp=-1", *SAMPLER]),
    # the paper configs' micro_batch_size=16 puts 4 (v5p-8) or 2 (v5p-16) sequences on a chip at once: one per chip
    (
        "qwen3_8b_v5p-8_learner_mb4",
        "v5p-8",
        [f"--config={PAPER}/qwen3_8b.py", "--mesh=fsdp=-1", "--programs=update", "--config.micro_batch_size=4"],
    ),
    (
        "qwen3_30b_a3b_v5p-16_learner_mb8",
        "v5p-16",
        [f"--config={PAPER}/qwen3_30b_a3b.py", "--mesh=fsdp=-1", "--programs=update", "--config.micro_batch_size=8"],
    ),
    ("qwen3_8b_v6e-16_learner", "v6e-16", [*QWEN3_8B, "--mesh=fsdp=-1", "--programs=update"]),
    (
        "qwen3_1p7b_v6e-8",
        "v6e-8",
        [*MIPU_1P7B, *MIPU_LEN, "--mesh=fsdp=-1", "--mesh=data=2,fsdp=-1", "--programs=update"],
    ),
    ("qwen3_4b_v6e-8", "v6e-8", [*MIPU_4B, *MIPU_LEN, "--mesh=fsdp=-1", "--mesh=data=2,fsdp=-1", "--programs=update"]),
    (
        "qwen3_8b_v5p-16_learner_meshes",
        "v5p-16",
        [*QWEN3_8B, "--mesh=data=2,fsdp=-1", "--mesh=fsdp=-1,tensor=2", "--programs=update"],
    ),
    (
        "qwen3_30b_a3b_v6e-32_learner",
        "v6e-32",
        [f"--config={PAPER}/qwen3_30b_a3b.py", "--mesh=fsdp=-1", "--mesh=expert=8,fsdp=-1", "--programs=update"],
    ),
    ("qwen3_8b_v5p-8_sampler_batch", "v5p-8", [*QWEN3_8B, "--mesh=fsdp=-1", "--programs=decode"]),
]


def run(entries) -> int:
  OUT.mkdir(parents=True, exist_ok=True)
  status = 0
  for name, topology, args in entries:
    cmd = [sys.executable, "-m", "minpro_jax.aot", f"--topology={topology}", *args, f"--out={OUT / name}.json"]
    print("+", " ".join(cmd), flush=True)
    status |= subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
  return status


def summary() -> str:
  sys.path.insert(0, str(REPO))
  from minpro_jax.aot.sweep import markdown

  parts = [
      "# Compile-only reports of the papers' settings",
      "",
      "Written by `benchmarks/aot_paper.py --summary` from the JSON files beside it; per device. See docs/aot.md",
      "for what each column means (FLOPs are analytic, the roofline an estimate, collectives static counts).",
  ]
  for name, topology, args in ENTRIES:
    path = OUT / f"{name}.json"
    if not path.exists():
      parts += ["", f"## {name}: not compiled yet"]
      continue
    rep = json.loads(path.read_text())
    machine = rep.get("machine", {})
    # a file keeps the rows of earlier configs (the tool resumes by fingerprint): show the newest config's only
    rows = [r for r in rep["rows"] if r.get("fingerprint") == rep["rows"][-1].get("fingerprint")] if rep["rows"] else []
    parts += [
        "",
        f"## {name}",
        "",
        f"`python -m minpro_jax.aot --topology={topology} {' '.join(args)}` ({rep['topology']}, {rep['chips']} chips,"
        f" {rep['hosts']} hosts; {rows[0]['model'] if rows else ''}; compiled {machine.get('date')} on"
        f" {machine.get('cpu')}, jax {machine.get('jax')})",
        "",
        markdown(rows),
    ]
  return "\n".join(parts) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="comma-separated substrings of entry names")
  p.add_argument("--summary", action="store_true", help="only write benchmarks/results/aot/README.md")
  args = p.parse_args(argv)
  status = 0
  if not args.summary:
    keys = [k for k in args.only.split(",") if k]
    status = run([e for e in ENTRIES if not keys or any(k in e[0] for k in keys)])
  OUT.mkdir(parents=True, exist_ok=True)
  (OUT / "README.md").write_text(summary())
  return status


if __name__ == "__main__":
  sys.exit(main())
