"""Which TPU slice each paper model's learner fits, at the papers' lengths: compiled per-chip memory (nothing run).

Program: the gradient of the summed `token_logprobs` of the whole model (the learner update's forward + backward)
with the paper configs' model settings: fp32 parameters, bf16 compute, remat="block", scanned layers,
`attention_impl="auto"` (splash on TPU), the ragged MoE; one sequence per chip (batch = chips), everything
fsdp-sharded over all chips, gradients sharded like the parameters. `compiled.memory_analysis()` gives arguments
(the parameters), outputs (the gradients) and temporaries per chip; AdamW's two fp32 moments (8 bytes per
parameter, sharded like the parameters) are added by arithmetic, since this program does not hold them. A row
fits when that total is at most the chip's HBM.

Lengths: MinPRO (Qwen3-8B/14B/30B-A3B) up to 20,480 response tokens after a prompt of up to 2,048 (22,528); MIPU
(Qwen3-1.7B/4B) does not state its maximum length, so 8,192 + 1,024 is assumed.

Needs libtpu (`make setup` unpacks it to .venv/libtpu): PYTHONPATH=.venv/libtpu .venv/bin/python
benchmarks/scale_fit.py [--only qwen3-8b]. Rows already in the result file are kept (the run resumes); each
compile takes minutes on 2 cores. Writes benchmarks/results/scale_fit.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from model_step import RESULTS_DIR, machine_info, write_result  # noqa: E402

GIB = 2**30
# (preset, tokens per sequence, slices to compile for[, the mesh axis all chips go on: fsdp by default])
ROWS = [  # the MinPRO models first: the longest compiles, and the ones the paper's claims are about
    ("qwen3-8b", 22528, ("v5p-8", "v6e-16")),
    ("qwen3-30b-a3b", 22528, ("v5p-16", "v6e-16")),
    ("qwen3-14b", 22528, ("v5p-16", "v6e-16")),
    ("qwen3-4b", 9216, ("v5p-8", "v6e-8")),
    ("qwen3-1.7b", 9216, ("v5p-8", "v6e-8")),
    ("qwen3-30b-a3b", 22528, ("v5p-16", "v6e-16"), "expert"),  # experts split over the chips, not their width
]


def measure(preset: str, seq: int, slice_name: str, axis: str = "fsdp") -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.aot.abstract import abstract_params
  from minpro_jax.aot.topologies import parse_slice
  from minpro_jax.models import get_preset
  from minpro_jax.models.attention_dispatch import resolve_attention_impl
  from minpro_jax.models.logprobs import token_logprobs
  from minpro_jax.runtime.sharding import make_mesh, use_mesh

  sl = parse_slice(slice_name)
  hbm = sl.chip.hbm_bytes / GIB
  devices = sl.devices()
  n = len(devices)
  mesh = make_mesh({axis: n}, devices=devices)
  cfg = get_preset(preset, param_dtype="float32", dtype="bfloat16", remat="block", scan_layers=True)
  graphdef, params = abstract_params(cfg, mesh)
  with use_mesh(mesh):
    tokens = jax.ShapeDtypeStruct((n, seq), jnp.int32, sharding=NamedSharding(mesh, P(axis, None)))

    def loss(p, tok):
      return jnp.sum(token_logprobs(nnx.merge(graphdef, p), tok, chunk_size=1024).logp)

    t0 = time.time()
    shardings = jax.tree.map(lambda x: x.sharding, params)
    compiled = jax.jit(jax.grad(loss), out_shardings=shardings).lower(params, tokens).compile()
    seconds = time.time() - t0
    impl = resolve_attention_impl(cfg, seq)
  m = compiled.memory_analysis()
  adam = 8 * cfg.num_params() / n
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes + adam
  return {
      "model": preset,
      "slice": slice_name,
      "topology": sl.topology,
      "chips": n,
      "hosts": sl.num_hosts,
      "tokens_per_sequence": seq,
      "attention_impl": impl,
      "remat": cfg.remat,
      "mesh": f"{axis}={n}",
      "params_b": round(cfg.num_params() / 1e9, 2),
      "argument_gib": round(m.argument_size_in_bytes / GIB, 2),
      "output_gib": round(m.output_size_in_bytes / GIB, 2),
      "temp_gib": round(m.temp_size_in_bytes / GIB, 2),
      "adam_moments_gib": round(adam / GIB, 2),
      "total_gib": round(total / GIB, 2),
      "hbm_gib": hbm,
      "fits": total <= hbm * GIB,
      "compile_seconds": round(seconds, 1),
  }


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default="", help="comma-separated presets (default: every paper model)")
  p.add_argument("--name", default="scale_fit")
  args = p.parse_args(argv)
  path = RESULTS_DIR / f"{args.name}.json"
  done = json.loads(path.read_text())["rows"] if path.exists() else []
  have = {(r["model"], r["slice"], r["mesh"].split("=")[0]) for r in done}
  rows = list(done)
  only = set(filter(None, args.only.split(",")))
  for preset, seq, slices, *axis in ROWS:
    axis = axis[0] if axis else "fsdp"
    if only and preset not in only:
      continue
    for slice_name in slices:
      if (preset, slice_name, axis) in have:
        continue
      row = measure(preset, seq, slice_name, axis)
      print(row, file=sys.stderr, flush=True)
      rows.append(row)
      write_result(args.name, _result(rows))  # after every row: an interrupted run keeps what it compiled
  return write_result(args.name, _result(rows))


def _result(rows: list[dict]) -> dict:
  return {
      "benchmark": "scale_fit",
      "program": "grad of token_logprobs of the whole model (paper settings), 1 sequence per chip, fsdp over all",
      "baseline": "the chip's HBM (fits: arguments + outputs + temporaries + AdamW moments <= HBM)",
      "rows": rows,
      "machine": machine_info(),
  }


if __name__ == "__main__":
  main()
