"""The train step's fp32 matmuls one by one: XLA:CPU (`jax.lax.dot_general`) vs torch (MKL), each in its own process.

`model_step.py` times whole steps and `step_floor.py` a matmul-only network with autograd; this one isolates
the kernels. For the `smollm2-135m` shapes at B=8, T=256 (N = 2048 tokens; 2040 for the LM head, which
skips the last position) it times every distinct projection and LM-head matmul of one training step (not
attention's q·kᵀ and p·v, about 6 % of the step's FLOPs):

  * JAX, as `minpro_jax.models.dense` and autodiff issue them, per projection weight W [K, M] (q, k, v, o,
    gate, up, down): forward x[N, K] @ W ("nn"), input gradient dy[N, M] @ Wᵀ ("nt"), weight gradient
    xᵀ @ dy ("tn");
  * torch, as autograd issues them for `nn.Linear`, whose weight is stored [M, K]: forward x @ Wᵀ, input
    gradient dy @ W, weight gradient dyᵀ @ x (transposed views, no copies); same FLOPs, reported in the row of
    the JAX product they correspond to;
  * the tied LM head E [V, D], the same on both sides: logits h @ Eᵀ ("nt"), dh = dz @ E ("nn"),
    dE = dzᵀ @ h ("tn").

Each side runs in a fresh subprocess (the frameworks' thread pools slow each other inside one process), the
sides alternate for `--rounds` rounds so both see the machine in the same minutes, and each time is the
median over the rounds of each round's median of `--reps` calls. `step_s` weights every matmul by how often
one step issues it (the preset's 30 layers), which is the step's matmul time if the kernels ran back to back.

Usage:
  .venv/bin/python benchmarks/gemm.py                 # 3 rounds per side, ~2 min
  .venv/bin/python benchmarks/gemm.py --rounds 1      # quick look

Prints one JSON object and writes benchmarks/results/gemm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

B, T = 8, 256  # the train-step benchmark's batch


def step_dims(preset: str = "smollm2-135m") -> dict:
  """The sizes `gemms` needs, from the model preset (imports JAX, so the parent calls it and passes the result
  to the sides as JSON)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from minpro_jax.models import get_preset  # pylint: disable=import-outside-toplevel

  c = get_preset(preset)
  return {
      "D": c.hidden_size,
      "F": c.intermediate_size,
      "HD": c.head_dim,
      "H": c.num_heads,
      "KV": c.num_kv_heads,
      "V": c.vocab_size,
      "L": c.num_layers,
  }


def gemms(dims: dict) -> list[dict]:
  """Every distinct matmul of one step: name, kind, (m, k, n) of the product, operand shapes, count per step.

  kind "nn": a[m, k] @ b[k, n]; "nt": a[m, k] @ b[n, k]ᵀ; "tn": a[k, m]ᵀ @ b[k, n]. `dims` from `step_dims`.
  """
  D, F, HD, H, KV, V, L = (dims[k] for k in ("D", "F", "HD", "H", "KV", "V", "L"))
  N = B * T
  weights = {
      "q": (D, H * HD, 1),
      "k": (D, KV * HD, 1),
      "v": (D, KV * HD, 1),
      "o": (H * HD, D, 1),
      "gate": (D, F, 1),
      "up": (D, F, 1),
      "down": (F, D, 1),
  }  # (K, M, count per layer)
  out = []
  seen = {}
  for name, (k, m, count) in weights.items():
    for kind, mkn, a, b in (
        ("nn", (N, k, m), (N, k), (k, m)),  # y = x @ W
        ("nt", (N, m, k), (N, m), (k, m)),  # dx = dy @ Wᵀ (W stored [K, M])
        ("tn", (k, N, m), (N, k), (N, m)),
    ):  # dW = xᵀ @ dy
      key = (kind, a, b)
      if key in seen:
        seen[key]["count"] += count * L
        seen[key]["name"] += "," + name
        continue
      seen[key] = {"name": name, "kind": kind, "mkn": mkn, "a": a, "b": b, "count": count * L}
      out.append(seen[key])
  n_head = N - B  # one position per row has no next token
  out += [
      {"name": "head", "kind": "nt", "mkn": (n_head, D, V), "a": (n_head, D), "b": (V, D), "count": 1},
      {"name": "head", "kind": "nn", "mkn": (n_head, V, D), "a": (n_head, V), "b": (V, D), "count": 1},
      {"name": "head", "kind": "tn", "mkn": (V, n_head, D), "a": (n_head, V), "b": (n_head, D), "count": 1},
  ]
  return out


def _time(fn, reps: int) -> float:
  """Median seconds of `reps` calls of `fn` after one warm-up call (`decode.timed` gives the best instead and
  would import JAX into the torch side)."""
  fn()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def run_side(side: str, reps: int, dims: dict) -> list[float]:
  """Median seconds per matmul of `gemms(dims)` in this process (of `reps` calls; 3 for the LM head's), with
  `side` = "jax" or "torch".

  Calls `keep_freed_host_memory()` first, as the train step does: without it each call's output buffer (up
  to 400 MB) is freshly mapped and page-faulted, which slowed XLA's matmuls here by 10-25 %.
  """
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from minpro_jax.runtime.host_memory import keep_freed_host_memory  # pylint: disable=import-outside-toplevel

  keep_freed_host_memory()
  out = []
  if side == "jax":
    import jax
    import jax.numpy as jnp

    contract = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}
    for g in gemms(dims):
      a = jax.random.normal(jax.random.key(0), g["a"], jnp.float32)
      b = jax.random.normal(jax.random.key(1), g["b"], jnp.float32)
      f = jax.jit(lambda a, b, c=contract[g["kind"]]: jax.lax.dot_general(a, b, (c, ((), ()))))
      out.append(_time(lambda: f(a, b).block_until_ready(), reps if g["name"] != "head" else 3))
  else:
    import torch

    torch.set_num_threads(os.cpu_count())
    for g in gemms(dims):
      a, b = torch.randn(g["a"]), torch.randn(g["b"])
      if g["name"] == "head":  # the embedding is [V, D] on both sides
        op = {"nn": lambda: a @ b, "nt": lambda: a @ b.T, "tn": lambda: a.T @ b}[g["kind"]]
      elif g["kind"] == "tn":  # dW = dyᵀ @ x, [M, K] (a is x [N, K], b is dy [N, M])
        op = lambda: b.T @ a  # noqa: E731
      else:  # nn.Linear's weight is [M, K], the JAX weight b transposed in memory
        w_mk = torch.randn(g["b"][1], g["b"][0])
        op = (lambda: a @ w_mk.T) if g["kind"] == "nn" else (lambda: a @ w_mk)  # y = x @ Wᵀ; dx = dy @ W
      out.append(_time(op, reps if g["name"] != "head" else 3))
  return out


def main(argv=None) -> dict:
  """Runs the benchmark (command-line flags in `argv`), writes results/<name>.json and returns the result
  ({} in the internal --side worker mode, which prints its timings instead).

  Raises:
    RuntimeError: a side's subprocess failed or ran past 30 minutes (its stderr is included).
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3, help="subprocess runs per side, alternating")
  p.add_argument("--reps", type=int, default=20, help="timed calls per matmul per run (3 for the LM head)")
  p.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)  # worker mode
  p.add_argument("--dims", help=argparse.SUPPRESS)  # worker mode: step_dims() as JSON
  p.add_argument(
      "--xla-flags",
      action="append",
      default=None,
      metavar="FLAGS",
      help="run the JAX side once per value with XLA_FLAGS=FLAGS (repeatable, written --xla-flags=VALUE; "
      "'' for the defaults) to "
      "compare XLA:CPU dot backends in the same rounds; default: one JAX side, XLA_FLAGS as inherited",
  )
  p.add_argument(
      "--name", default="gemm", help="results file name, or a path (absolute, or relative to benchmarks/results/)"
  )
  args = p.parse_args(argv)
  if args.rounds < 1 or args.reps < 1:
    p.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}")
  if args.side:
    print(json.dumps(run_side(args.side, args.reps, json.loads(args.dims))))
    return {}
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from model_step import machine_info, write_result  # pylint: disable=import-outside-toplevel

  if args.xla_flags is not None and len(set(args.xla_flags)) != len(args.xla_flags):
    p.error(f"--xla-flags values must differ, got {args.xla_flags}")
  machine = machine_info()
  dims = step_dims()
  # side name -> XLA_FLAGS for its process (None: inherited)
  sides = {"jax": None} if args.xla_flags is None else {f"jax[{f}]": f for f in args.xla_flags}
  sides["torch"] = None
  runs = {side: [] for side in sides}
  for r in range(args.rounds):
    order = list(sides) if r % 2 == 0 else list(reversed(sides))
    for side in order:
      env = dict(os.environ)
      if sides[side] is not None:
        env["XLA_FLAGS"] = sides[side]
      cmd = [
          sys.executable,
          os.path.abspath(__file__),
          "--side",
          side.split("[")[0],
          "--reps",
          str(args.reps),
          "--dims",
          json.dumps(dims),
      ]
      try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
      except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"gemm.py side {side!r} ran past 30 minutes") from e
      if res.returncode != 0:
        raise RuntimeError(f"gemm.py side {side!r} failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
      runs[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
  rows, step = [], {side: 0.0 for side in sides}
  for i, g in enumerate(gemms(dims)):
    m, k, n = g["mkn"]
    t = {side: statistics.median(run[i] for run in runs[side]) for side in runs}
    row = {"name": g["name"], "kind": g["kind"], "m_k_n": [m, k, n], "count_per_step": g["count"]}
    for side in sides:
      step[side] += g["count"] * t[side]
      row[f"{side}_ms"] = t[side] * 1e3
      row[f"{side}_gflops"] = 2 * m * k * n / t[side] / 1e9
      if side != "torch":
        row[f"{side}_over_torch_time"] = t[side] / t["torch"]
    rows.append(row)
  import torch  # pylint: disable=import-outside-toplevel  # only for its version

  machine["loadavg_end"] = list(os.getloadavg())
  result = {
      "benchmark": "gemm",
      "baseline": "torch CPU (MKL) matmuls of the same products as nn.Linear's "
      "autograd issues them, separate process",
      "machine": machine,
      "torch": torch.__version__,
      "host_memory_keep_freed": True,
      "shapes": "smollm2-135m, B=8, T=256, fp32",
      "rounds": args.rounds,
      "reps": args.reps,
      "seconds_per_round": runs,
      "gemms": rows,
      "step_s": {
          **step,
          **{f"{side}_over_torch_time": step[side] / step["torch"] for side in sides if side != "torch"},
      },
  }
  write_result(args.name, result)
  return result


if __name__ == "__main__":
  main()
