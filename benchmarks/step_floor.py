"""Where the learner step's time goes, against transformers in the same run: the matmul floor and attention.

Two measurements per preset, each interleaved round by round with its torch counterpart:

  * `matmul_floor`: forward + backward of a network made only of the step's projection matmuls (per layer
    q, k, v, o, gate, up, down at the preset's shapes, plus the tied LM head), over the same [B * T, D]
    tokens: no attention scores, norms, RoPE, softmax or optimizer. JAX runs it as one `jax.jit` of
    `jax.grad`; torch runs the same graph eagerly with autograd. The JAX figure is about the least time a
    step built on XLA:CPU's matmuls can take, so `jax_over_torch_time` is the part of the step ratio that
    the matmul kernels decide, and step minus floor on each side is everything else.
  * `attention_block`: one attention block forward + backward (input [B, T, D], gradients for the input and
    the block's weights): our `Attention` module as configured, the same with `attn_causal_blocks=1` (full
    T x T scores; `jax_full_scores`), and the transformers model's own `self_attn` of layer 0 with SDPA
    (causal), all fp32 with the same number of threads.

Usage:
  .venv/bin/python benchmarks/step_floor.py                     # smollm2-135m, B=8, T=256
  .venv/bin/python benchmarks/step_floor.py --presets tiny --rounds 3

The full train steps of `model_step.py` (ours and transformers) run first in the same process, so
`step_minus_floor_s` on each side (step best minus matmul floor best) is measured against the same machine
state. `--no-step` skips them. Prints one JSON object and writes benchmarks/results/<--name, default step_floor>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics


def matmul_floor_fns(cfg, batch: int, seq: int):
  """(jax_fn, torch_fn, flops): zero-argument callables that run forward + backward of the preset's
  projection and LM-head matmuls in each framework and block until done, and the matmul FLOPs of one call
  (3 x the forward's 2 * M * K * N per matmul)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch

  n, d, f, v = batch * seq, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = dict(q=(d, q_dim), k=(d, kv_dim), v=(d, kv_dim), o=(q_dim, d), gate=(d, f), up=(d, f), down=(f, d))
  rng = np.random.default_rng(0)
  layers = [
      {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()} for _ in range(cfg.num_layers)
  ]
  head = (0.02 * rng.standard_normal((v, d))).astype(np.float32)
  x0 = rng.standard_normal((n, d)).astype(np.float32)
  rep = q_dim // kv_dim if q_dim % kv_dim == 0 else None

  def forward(x, layers, head, tile):
    for p in layers:  # the k and v products feed the o input, so none is dead code
      kv = x @ p["k"] + x @ p["v"]
      x = x + (x @ p["q"] + (tile(kv, rep) if rep else 0.0)) @ p["o"]
      x = x + ((x @ p["gate"]) * (x @ p["up"])) @ p["down"]
    logits = x @ head.T
    return 0.5 * (logits * logits).sum()  # cotangent = logits: no constant operand XLA could fold a dot into

  grad = jax.jit(jax.grad(lambda ls, h, x: forward(x, ls, h, lambda a, r: jnp.tile(a, (1, r))), argnums=(0, 1)))
  j_args = (jax.tree.map(jnp.asarray, layers), jnp.asarray(head), jnp.asarray(x0))
  t_layers = [{k: torch.from_numpy(a.copy()).requires_grad_() for k, a in p.items()} for p in layers]
  t_head, t_x = torch.from_numpy(head.copy()).requires_grad_(), torch.from_numpy(x0)
  t_params = [t for p in t_layers for t in p.values()] + [t_head]

  def run_torch():
    forward(t_x, t_layers, t_head, lambda a, r: a.repeat(1, r)).backward()
    for t in t_params:
      t.grad = None

  per_layer = sum(a * b for a, b in shapes.values())
  flops = 3 * 2 * n * (cfg.num_layers * per_layer + d * v)
  return (lambda: jax.block_until_ready(grad(*j_args))), run_torch, flops


def attention_block_fns(cfg, batch: int, seq: int) -> dict:
  """Zero-argument callables, each one forward + backward of one attention block: "jax" (our `Attention`
  as configured), "jax_full_scores" (the same with attn_causal_blocks=1, the full T x T scores) and "torch"
  (transformers' layer-0 `self_attn`, SDPA, causal)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  from flax import nnx
  from model_step import hf_model  # pylint: disable=import-outside-toplevel

  from minpro_jax.models.rope import rope_tables
  from minpro_jax.models.transformer import Attention

  x0 = np.random.default_rng(0).standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  segments = jnp.ones((batch, seq), jnp.int32)
  x_j = jnp.asarray(x0)

  def ours(blocks):
    with nnx.use_eager_sharding(False):  # no mesh here: plain single-device arrays
      attn = Attention(cfg.replace(stack_layers=False, attn_causal_blocks=blocks), rngs=nnx.Rngs(0))

    @nnx.jit
    def step(attn, x):
      def loss(attn, x):
        y, _ = attn(x, rope_tables(positions, cfg), segments, segments, None, jnp.int32(0))
        return jnp.sum(y * y)

      return nnx.grad(loss, argnums=(0, 1))(attn, x)

    return lambda: jax.block_until_ready(step(attn, x_j))

  hf = hf_model(cfg.replace(num_layers=1))
  block, rotary = hf.model.layers[0].self_attn, hf.model.rotary_emb
  x_t = torch.from_numpy(x0)
  pos_t = torch.arange(seq)[None].expand(batch, seq)

  def run_torch():
    x = x_t.clone().requires_grad_()
    y = block(hidden_states=x, position_embeddings=rotary(x, pos_t), attention_mask=None)[0]
    (y * y).sum().backward()
    block.zero_grad(set_to_none=True)

  return {"jax": ours(cfg.attn_causal_blocks), "jax_full_scores": ours(1), "torch": run_torch}


def _interleave(fns: dict, rounds: int, repeats: int) -> dict:
  """Best time of each callable per round, round-robin, seconds: {name}_s per round, {name}_s_best, and
  jax_over_torch_time (of the bests) and its per-round median."""
  from decode import timed  # pylint: disable=import-outside-toplevel  (best of reps after a warm-up call)

  out = {f"{name}_s": [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      out[f"{name}_s"].append(timed(fn, repeats))
  for name in fns:
    out[f"{name}_s_best"] = min(out[f"{name}_s"])
  out["jax_over_torch_time"] = out["jax_s_best"] / out["torch_s_best"]
  out["jax_over_torch_time_median"] = statistics.median(j / t for j, t in zip(out["jax_s"], out["torch_s"]))
  return out


def measure(cfg, batch: int, seq: int, rounds: int = 3, threads: int | None = None) -> dict:
  """Both measurements for one preset config (dense only); see the module docstring.

  Args:
    cfg: a dense `ModelConfig` (e.g. `get_preset("smollm2-135m")`).
    batch, seq: the token batch [B, T] of the train step.
    rounds: interleaved rounds; each round takes the best of a few calls per side.
    threads: torch threads (default os.cpu_count(), XLA:CPU's thread count).

  Returns:
    {"matmul_floor": {...}, "attention_block": {...}}: seconds per side per round, bests, the JAX / torch
    time ratio of the bests and its per-round median, and the floor's matmul FLOPs and FLOP/s.

  Raises:
    ValueError: for a MoE config (the floor covers dense projections only).
  """
  import torch

  if cfg.num_experts:
    raise ValueError(f"step_floor covers dense presets; this config has num_experts={cfg.num_experts}")
  torch.set_num_threads(threads or os.cpu_count())
  jax_fn, torch_fn, flops = matmul_floor_fns(cfg, batch, seq)
  floor = _interleave({"jax": jax_fn, "torch": torch_fn}, rounds, repeats=2)
  floor["matmul_flops"] = flops
  floor["jax_flops_per_s"] = flops / floor["jax_s_best"]
  floor["torch_flops_per_s"] = flops / floor["torch_s_best"]
  attn = _interleave(attention_block_fns(cfg, batch, seq), rounds, repeats=5)
  for name in ("jax", "jax_full_scores", "torch"):
    attn[f"times_num_layers_{name}_s"] = attn[f"{name}_s_best"] * cfg.num_layers
  return {"matmul_floor": floor, "attention_block": attn}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="smollm2-135m")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=2, help="timed full steps per side (after one warm-up)")
  p.add_argument("--no-step", action="store_true", help="skip the full train steps")
  p.add_argument(
      "--name", default="step_floor", help="results file name, or a path (absolute, or relative to benchmarks/results/)"
  )
  args = p.parse_args(argv)
  import model_step  # pylint: disable=import-outside-toplevel

  model_step.keep_freed_host_memory()
  from minpro_jax.models import get_preset

  result = {
      "benchmark": "step_floor",
      "baseline": "torch CPU eager (autograd; transformers SDPA attention)",
      "machine": model_step.machine_info(),
      "batch": args.batch,
      "seq": args.seq,
      "dtype": "float32",
      "presets": {},
  }
  for name in args.presets.split(","):
    cfg = get_preset(name)
    r = {}
    if not args.no_step:
      ours = model_step.bench_ours(cfg, args.batch, args.seq, args.steps, chunk_size=args.seq)
      base = model_step.bench_transformers(cfg, args.batch, args.seq, args.steps, os.cpu_count())
      r["step_s_best"] = {"ours": min(ours["step_s"]), "transformers": min(base["step_s"])}
      r["step_s"] = {"ours": ours["step_s"], "transformers": base["step_s"]}
    r.update(measure(cfg, args.batch, args.seq, args.rounds))
    if not args.no_step:
      floor = r["matmul_floor"]
      r["step_minus_floor_s"] = {
          "ours": r["step_s_best"]["ours"] - floor["jax_s_best"],
          "transformers": r["step_s_best"]["transformers"] - floor["torch_s_best"],
      }
    result["presets"][name] = r
  result["machine"]["loadavg_end"] = list(os.getloadavg())
  model_step.write_result(args.name, result)
  return result


if __name__ == "__main__":
  main()
