"""Peak memory of the chunked log-prob function vs a dense log-softmax, from XLA's compiled memory analysis.

Shapes: hidden [B, T, D] = [1, 8192, 1024], head [D, V] = [1024, 151936] (Qwen3 vocabulary), fp32. Nothing of
that size is allocated: each function is lowered on `jax.ShapeDtypeStruct`s, compiled for the CPU, and
`compiled.memory_analysis()` reports XLA's buffer assignment:

  * temp_bytes: scratch the function needs besides its arguments and outputs (the logits live here);
  * argument_bytes / output_bytes: inputs (hidden, head, targets) and results (log-probs; for the backward
    also d hidden and d head, which any implementation must produce);
  * peak_bytes = temp + argument + output (an upper bound: XLA may alias outputs with temps).

Paths:
  * ours: `minpro_jax.models.logprobs_from_hidden(..., chunk_size=C)` (sequence chunks under jax.checkpoint);
  * baseline "dense log_softmax": logits = hidden @ head in fp32, `jax.nn.log_softmax`, gather the target.

Each in forward only and forward + backward (`jax.value_and_grad` of the summed log-probs w.r.t. hidden and
head). The full fp32 logits tensor, B * T * V * 4 bytes = 4.98 GB, is the reference size; the target is
temp_bytes of our path <= 10% of it.

Usage: .venv/bin/python benchmarks/logprob_memory.py [--chunk-size 256]
Prints one JSON object and writes benchmarks/results/logprob_memory.json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from model_step import machine_info, write_result  # noqa: E402


def _analyse(fn, *specs) -> dict:
  import jax

  compiled = jax.jit(fn).lower(*specs).compile()
  m = compiled.memory_analysis()
  temp, arg, out = int(m.temp_size_in_bytes), int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  return {
      "temp_bytes": temp,
      "argument_bytes": arg,
      "output_bytes": out,
      "alias_bytes": int(m.alias_size_in_bytes),
      "peak_bytes": temp + arg + out,
  }


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seq", type=int, default=8192)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--chunk-size", type=int, default=256)
  args = p.parse_args(argv)

  import jax
  import jax.numpy as jnp

  from minpro_jax.models import logprobs_from_hidden

  b, t, d, v = args.batch, args.seq, args.hidden, args.vocab
  specs = (
      jax.ShapeDtypeStruct((b, t, d), jnp.float32),
      jax.ShapeDtypeStruct((d, v), jnp.float32),
      jax.ShapeDtypeStruct((b, t), jnp.int32),
  )

  def chunked(h, w, y):
    return logprobs_from_hidden(h, w, y, chunk_size=args.chunk_size)[0]

  def dense(h, w, y):
    logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), y[..., None], axis=-1)[..., 0]

  def with_grad(f):
    return lambda h, w, y: jax.value_and_grad(lambda h, w: jnp.sum(f(h, w, y)), argnums=(0, 1))(h, w)

  logits_bytes = b * t * v * 4
  res = {
      "benchmark": "logprob_memory",
      "baseline": "dense log_softmax of full fp32 logits (same jit, same shapes)",
      "machine": machine_info(),
      "shape": {"batch": b, "seq": t, "hidden": d, "vocab": v},
      "chunk_size": args.chunk_size,
      "full_fp32_logits_bytes": logits_bytes,
      "method": "jax.jit(f).lower(ShapeDtypeStructs).compile().memory_analysis() on CPU; nothing allocated",
  }
  for mode, wrap in (("forward", lambda f: f), ("forward_backward", with_grad)):
    ours = _analyse(wrap(chunked), *specs)
    base = _analyse(wrap(dense), *specs)
    res[mode] = {
        "ours_chunked": ours,
        "dense_log_softmax": base,
        "ours_temp_over_logits": ours["temp_bytes"] / logits_bytes,
        "ours_peak_over_logits": ours["peak_bytes"] / logits_bytes,
        "dense_temp_over_logits": base["temp_bytes"] / logits_bytes,
        "ours_temp_over_dense_temp": ours["temp_bytes"] / max(base["temp_bytes"], 1),
    }
  res["targets"] = {
      "temp_le_0.10_logits_forward": res["forward"]["ours_temp_over_logits"] <= 0.10,
      "temp_le_0.10_logits_forward_backward": res["forward_backward"]["ours_temp_over_logits"] <= 0.10,
  }
  write_result("logprob_memory", res)
  return res


if __name__ == "__main__":
  main()
