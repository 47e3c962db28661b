"""Per-chip memory of the learner's gradient at the papers' sequence lengths, compiled for a TPU topology (nothing
allocated, nothing run): XLA attention against blockwise attention.

Program: the gradient of the summed `token_logprobs` of a Qwen3-8B-shaped model cut to `--layers` layers
(`get_preset("qwen3-8b", num_layers=L, dtype="bfloat16", param_dtype="bfloat16", remat="block")`), one sequence
per chip (batch = chips, sharded over fsdp), parameters fsdp-sharded by the model's logical-axis rules, lowered on
`jax.ShapeDtypeStruct`s and compiled; `compiled.memory_analysis()` gives the per-chip bytes. The papers' setting is
up to 20,480 response tokens plus the prompt; a v5p chip has 95 GiB of HBM.

Baseline: `attention_impl="xla"` (the [T, T] scores, in causal query blocks) at the same shapes, same run.

Topology: `--topology v5p:2x2x1` needs libtpu (`pip install "jax[tpu]==0.10.2"`, or `pip install --target DIR
libtpu==0.0.42.1` and PYTHONPATH=DIR); without it use `--topology cpu:4` (the CPU backend's buffer assignment,
which differs from the TPU's). The default, auto, picks v5p:2x2x1 when libtpu is importable, else cpu:4.

Usage: PYTHONPATH=/tmp/libtpu .venv/bin/python benchmarks/learner_memory.py [--layers 2] [--seqs 4096,8192]
Prints one JSON object and writes benchmarks/results/learner_memory.json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from model_step import machine_info, write_result  # noqa: E402

GIB = 2**30


def _devices(topology: str):
  import jax

  if topology.startswith("cpu:"):
    return jax.devices("cpu")[: int(topology.split(":")[1])]
  from minpro_jax.aot.abstract import tpu_topology_devices

  return tpu_topology_devices(topology, tuple(int(x) for x in topology.split(":")[1].split("x")))


def measure(topology: str, layers: int, seq: int, impl: str, scan: bool = False) -> dict:
  """One compiled row: per-chip memory (GiB) and compile seconds of the gradient program at `seq` tokens."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.aot.abstract import abstract_params
  from minpro_jax.models import get_preset
  from minpro_jax.models.logprobs import token_logprobs
  from minpro_jax.runtime.sharding import MESH_AXES, use_mesh

  devices = _devices(topology)
  n = len(devices)
  mesh = Mesh(np.asarray(devices).reshape(1, n, 1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
  cfg = get_preset(
      "qwen3-8b",
      num_layers=layers,
      dtype="bfloat16",
      param_dtype="bfloat16",
      remat="block",
      attention_impl=impl,
      scan_layers=scan,
  )
  graphdef, params = abstract_params(cfg, mesh)
  with use_mesh(mesh):
    tokens = jax.ShapeDtypeStruct((n, seq), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None)))

    def loss(p, tok):
      return jnp.sum(token_logprobs(nnx.merge(graphdef, p), tok, chunk_size=512).logp)

    t0 = time.time()
    shardings = jax.tree.map(lambda x: x.sharding, params)  # gradients sharded like the parameters, as in the update
    compiled = jax.jit(jax.grad(loss), out_shardings=shardings).lower(params, tokens).compile()
    seconds = time.time() - t0
  m = compiled.memory_analysis()
  return {
      "attention_impl": impl,
      "seq": seq,
      "temp_gib": m.temp_size_in_bytes / GIB,
      "argument_gib": m.argument_size_in_bytes / GIB,
      "output_gib": m.output_size_in_bytes / GIB,
      "compile_seconds": round(seconds, 1),
  }


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
      "--topology", default="auto", help="v5p:2x2x1, v5e:2x2, cpu:N; auto: v5p:2x2x1 with libtpu, else cpu:4"
  )
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--scan", action="store_true", help="scan the layers (what the paper configs do; fast to compile)")
  p.add_argument("--seqs", default="4096,8192,16384,20992")
  p.add_argument("--impls", default="blockwise,xla")
  p.add_argument("--xla-max-seq", type=int, default=8192, help="skip xla rows above this length (slow to compile)")
  p.add_argument("--name", default="learner_memory")
  args = p.parse_args(argv)
  if args.topology == "auto":
    import importlib.util

    args.topology = "v5p:2x2x1" if importlib.util.find_spec("libtpu") else "cpu:4"
    print(f"learner_memory: topology {args.topology}", file=sys.stderr)
  if args.topology.startswith("cpu:"):
    import jax

    jax.config.update("jax_num_cpu_devices", int(args.topology.split(":")[1]))
  rows = []
  for impl in args.impls.split(","):
    for seq in (int(s) for s in args.seqs.split(",")):
      if impl == "xla" and seq > args.xla_max_seq:
        continue
      row = measure(args.topology, args.layers, seq, impl, args.scan)
      print(row, file=sys.stderr, flush=True)
      rows.append(row)
  by = {(r["attention_impl"], r["seq"]): r["temp_gib"] for r in rows}
  seqs = sorted({r["seq"] for r in rows if r["attention_impl"] == "blockwise"})
  result = {
      "benchmark": "learner_memory",
      "program": (
          f"grad of token_logprobs (no optimizer state), qwen3-8b with {args.layers} layers"
          f"{' (scanned)' if args.scan else ''}, bf16 parameters and compute, remat=block, 1 sequence per chip"
      ),
      "topology": args.topology,
      "baseline": "attention_impl=xla at the same shapes",
      "rows": rows,
      "blockwise_temp_growth": {
          f"{seqs[i]}->{seqs[i + 1]}": by[("blockwise", seqs[i + 1])] / by[("blockwise", seqs[i])]
          for i in range(len(seqs) - 1)
      },
      "machine": machine_info(),
  }
  write_result(args.name, result)
  return result


if __name__ == "__main__":
  main()
