"""Memory of truncation-aware log-probs (issue 39 item 4): the chunked log-prob's forward and backward with the
sampler's kept-set thresholds against the same program without them, compiled (nothing allocated, nothing run).

Program: the gradient (w.r.t. hidden states and head) of the summed `logprobs_from_hidden` at Qwen3-8B's head
(D = 4096, V = 151,936, bf16) over one row of `--tokens` tokens (default 20,480, the papers' response length) in
chunks of `--chunk` (256, the learner's default); `compiled.memory_analysis()` gives the temporary bytes. Also the
host bytes of what the sampler records per step at the paper's scale (4,096 rows x 20,480 tokens): the fp32
thresholds against kept-set ids (int32, top-k capped at k).

Baseline: `kept_logp_threshold_bt=None` (full-vocabulary log-probs), same shapes, same run.

Topology: `--topology v5p` compiles for one v5p chip (libtpu, importable or in .venv/libtpu; compile only); `cpu`
uses the CPU backend, whose fusion differs; `auto` (the default) takes v5p when libtpu is there, else cpu.

Usage: .venv/bin/python benchmarks/truncation_memory.py [--topology auto|v5p|cpu] [--tokens 20480] [--chunk 256]
Prints one JSON object and writes benchmarks/results/truncation_memory.json (or --name).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from model_step import machine_info, write_result  # noqa: E402

MIB = 2**20
ROWS, TOKENS = 4096, 20480  # the papers' step: rows x response tokens


def _device(topology: str):
  import jax

  if topology == "cpu":
    return jax.devices("cpu")[0]
  from minpro_jax.aot.abstract import tpu_topology_devices

  return tpu_topology_devices(f"{topology}:1x1x1", (1, 1, 1))[0]


def measure(topology: str, tokens: int, chunk: int, kept: bool) -> dict:
  """Temporary MiB of the forward and of the gradient, with or without thresholds."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from minpro_jax.models.logprobs import logprobs_from_hidden

  dev = SingleDeviceSharding(_device(topology))
  d, v = 4096, 151_936
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=dev)  # noqa: E731
  args = (spec((1, tokens, d), jnp.bfloat16), spec((d, v), jnp.bfloat16), spec((1, tokens), jnp.int32))
  args += (spec((1, tokens), jnp.float32),)

  def loss(h, w, y, thr):
    lp, _ = logprobs_from_hidden(h, w, y, chunk_size=chunk, kept_logp_threshold_bt=thr if kept else None)
    return jnp.sum(lp)

  out = {}
  for name, fn in (("forward", loss), ("gradient", jax.grad(loss, argnums=(0, 1)))):
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    out[f"{name}_temp_mib"] = round(mem.temp_size_in_bytes / MIB, 1)
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="auto", choices=("auto", "v5p", "cpu"))
  p.add_argument("--tokens", type=int, default=20480)
  p.add_argument("--chunk", type=int, default=256)
  p.add_argument("--name", default="truncation_memory")
  args = p.parse_args(argv)
  libtpu_dir = pathlib.Path(__file__).resolve().parent.parent / ".venv" / "libtpu"
  if args.topology == "auto":
    has_libtpu = (libtpu_dir / "libtpu").is_dir() or importlib.util.find_spec("libtpu") is not None
    args.topology = "v5p" if has_libtpu else "cpu"
  if args.topology != "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip is claimed
    sys.path.insert(0, str(libtpu_dir))
  n = ROWS * TOKENS
  result = {
      "program": "grad of sum(logprobs_from_hidden), Qwen3-8B head, one row",
      "topology": args.topology,
      "tokens": args.tokens,
      "chunk": args.chunk,
      "baseline_full_vocabulary": measure(args.topology, args.tokens, args.chunk, kept=False),
      "kept_thresholds": measure(args.topology, args.tokens, args.chunk, kept=True),
      "recorded_per_step_mib": {
          "tokens": n,
          "thresholds_fp32": round(n * 4 / MIB, 1),
          **{f"kept_ids_int32_top{k}": round(n * k * 4 / MIB, 1) for k in (20, 64, 512)},
      },
      "machine": machine_info(),
  }
  write_result(args.name, result)
  return result


if __name__ == "__main__":
  main()
