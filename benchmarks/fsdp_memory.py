"""Per-device parameter + AdamW optimizer-state bytes on an fsdp=8 mesh vs one device.

Runs itself in two subprocesses so XLA_FLAGS can be set before jax is imported:
  * single: one CPU device, `init_model(cfg)` + `nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)`;
  * fsdp8:  8 virtual CPU devices (--xla_force_host_platform_device_count=8), mesh {"fsdp": 8} from
    `minpro_jax.runtime.sharding.make_mesh`, model created sharded by `init_model(cfg, mesh=mesh)` and the optimizer
    created inside `nnx.jit` under the mesh so the AdamW moments take the parameters' shardings.
Bytes are summed from each array's `addressable_shards` per device (what device d actually holds), for
parameters and for optimizer state separately; the fsdp figure is the maximum over devices.

Baseline: the single-device figure. Target: per-device fsdp bytes <= 1.1 * (single / 8). Default model:
smollm2-135m (hidden 576, vocab 49152 and mlp 1536 all divide 8; the "embed" axis is the fsdp axis).

Usage: .venv/bin/python benchmarks/fsdp_memory.py [--preset smollm2-135m]
Prints one JSON object and writes benchmarks/results/fsdp_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def _measure(preset: str, fsdp: int) -> dict:
  """Runs in the child process: builds model + optimizer and returns per-device byte counts."""
  import collections

  import jax
  import optax
  from flax import nnx

  from minpro_jax.models import get_preset
  from minpro_jax.models.transformer import init_model
  from minpro_jax.runtime.sharding import make_mesh, use_mesh

  cfg = get_preset(preset)
  if fsdp == 1:
    model = init_model(cfg, seed=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  else:
    mesh = make_mesh({"fsdp": fsdp})
    model = init_model(cfg, seed=0, mesh=mesh)
    with use_mesh(mesh):
      opt = nnx.jit(lambda m: nnx.Optimizer(m, optax.adamw(1e-4), wrt=nnx.Param))(model)

  def per_device(tree):
    out = collections.Counter()
    for leaf in jax.tree.leaves(tree):
      if isinstance(leaf, jax.Array):
        for shard in leaf.addressable_shards:
          out[str(shard.device)] += shard.data.nbytes
    return out

  params = per_device(nnx.state(model, nnx.Param))
  opt_state = per_device(nnx.state(opt.opt_state))
  devices = sorted(set(params) | set(opt_state))
  total = {d: params[d] + opt_state[d] for d in devices}
  replicated = [
      jax.tree_util.keystr(k)
      for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
      if isinstance(v, jax.Array) and v.sharding.is_fully_replicated
  ]
  return {
      "devices": len(jax.devices()),
      "param_bytes_per_device": dict(params),
      "opt_state_bytes_per_device": dict(opt_state),
      "total_bytes_per_device": total,
      "max_total_bytes_per_device": max(total.values()),
      "replicated_params": replicated,
      "num_params": cfg.num_params(),
  }


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="smollm2-135m")
  p.add_argument("--fsdp", type=int, default=8)
  p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(_measure(args.preset, args.child)))
    return {}

  from model_step import machine_info, write_result

  runs = {}
  for n in (1, args.fsdp):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, __file__, "--preset", args.preset, "--child", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    runs[n] = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][len("RESULT ") :])
  single = runs[1]["max_total_bytes_per_device"]
  sharded = runs[args.fsdp]["max_total_bytes_per_device"]
  res = {
      "benchmark": "fsdp_memory",
      "baseline": "same model + AdamW state on one device",
      "machine": machine_info(),
      "preset": args.preset,
      "fsdp": args.fsdp,
      "single_device": runs[1],
      "fsdp_mesh": runs[args.fsdp],
      "single_total_bytes": single,
      "fsdp_max_per_device_bytes": sharded,
      "per_device_over_single": sharded / single,
      "ideal": 1 / args.fsdp,
      "per_device_over_ideal": sharded / (single / args.fsdp),
  }
  res["targets"] = {"per_device_le_1.1_over_n": sharded <= 1.1 * single / args.fsdp}
  write_result("fsdp_memory", res)
  return res


if __name__ == "__main__":
  main()
