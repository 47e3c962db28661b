"""One script for the first accelerator: a paged decode loop and one learner update, timed on the device JAX finds,
beside the step budget's forecast and bound for the very same compiled programs.

  python benchmarks/device_step.py [--tiny] [--model=qwen3-0.6b] [--rows=128] [--prompt=2048] [--new=6144]
      [--update-rows=16] [--micro-batch=4] [--repeats=3] [--out=benchmarks/results/device_step_<device>.json]

The programs are the trainer's own, compiled once by the budget (`minpro_jax.aot.budget.Budget(keep_compiled=True)`
on `topologies.local_slice()`: a TPU generation, an H100 / H200 / A100, or the CPU) and then run here with random
weights and inputs:

  sampling   the paged continuous sampler's whole call (`Sampler._c_paged`): `--rows` requests of a `--prompt`-token
             prompt, each generating `--new` tokens (contexts from prompt to prompt + new: 2k-8k by default), on
             `--rows` decode rows; the budget costs it on the lengths the call actually produced (a row stops early
             only if it draws the placeholder stop id)
  update     one `Learner.update` on `--update-rows` rows of prompt + new tokens in micro-batches of `--micro-batch`

For each it writes the measured seconds (the best of `--repeats` runs after one warm-up), the budget's roofline, its
forecast band (low / central / high) and the bound, and measured / forecast. On the CPU there are no chip figures:
the forecast and the bound are null and only the measured times are written (`--tiny`: a tiny model, for the tests).
The JSON's `device` names the device; run it on the accelerator, commit the JSON, and the calibration table takes the
row (docs/aot.md, "Calibration").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from minpro_jax.aot.budget import Budget  # noqa: E402
from minpro_jax.aot.topologies import local_slice  # noqa: E402
from minpro_jax.config_lib.defaults import base_config  # noqa: E402
from minpro_jax.config_lib.paper import paper_config  # noqa: E402


def device_config(args):
  """The run config of the timed programs: `--model`'s architecture (random weights) or the tiny test model."""
  if args.tiny:
    c = base_config()
  else:
    c = paper_config(args.model, f"checkpoints/{args.model}-absent", None, mesh="fsdp=-1")
  c.prompts_per_step, c.group_size = args.rows, 1
  c.num_updates_per_step = max(1, args.rows // args.update_rows)
  c.micro_batch_size = args.micro_batch
  c.data.max_prompt_tokens = args.prompt
  c.sampling.max_new_tokens = args.new
  c.sampling.kv_cache, c.sampling.page_size = "paged", args.page_size
  c.sampling.continuous, c.sampling.decode_rows, c.sampling.mesh = True, args.rows, ""
  c.learner.row_tokens = 0  # one sample a row: the update's rows are --update-rows samples
  c.mesh.shape = "fsdp=-1"
  return c


def fill(info, shardings, *, vocab: int, prompt: int, rng: np.random.Generator):
  """Concrete arguments for a compiled program from its `args_info` and input shardings: random weights, zero
  optimizer moments, random tokens, segment ids 1, positions 0.., the response after `prompt`, advantages N(0, 1)."""

  def leaf(path, a, sharding):
    name = jax.tree_util.keystr(path)
    shape, dtype = a.shape, np.dtype(a.dtype)
    if "opt_state" in name:
      x = np.zeros(shape, dtype)
    elif "tokens" in name:
      x = rng.integers(3, vocab, shape)
    elif "segment_ids" in name:
      x = np.ones(shape)
    elif "positions" in name:
      x = np.broadcast_to(np.arange(shape[-1]), shape)
    elif "response_mask" in name:
      x = np.broadcast_to(np.arange(shape[-1]) >= prompt, shape)
    elif "logp" in name:
      x = np.full(shape, -1.0)
    elif np.issubdtype(dtype, np.floating) or dtype == jnp.bfloat16:
      x = rng.normal(0.0, 0.02 if "params" in name or len(shape) > 1 else 1.0, shape)
    elif dtype == np.uint32:
      x = rng.integers(0, 2**32, shape, dtype=np.uint64)
    else:
      x = np.zeros(shape)
    return jax.device_put(jnp.asarray(np.asarray(x), dtype=a.dtype), sharding)

  return jax.tree_util.tree_map_with_path(leaf, info, shardings)


def sampler_args(info, shardings, *, vocab: int, prompt: int, rng):
  """The sampler call's (prepared params, requests): requests are (prompt tokens [N, P], segment ids, the prompt of
  each request, row keys [N, 2] uint32)."""
  params = fill(info[0], shardings[0], vocab=vocab, prompt=prompt, rng=rng)
  tokens, segs, group, keys = info[1]
  n, p = tokens.shape
  arrays = (rng.integers(3, vocab, (n, p)), np.ones((n, p)), np.arange(n), rng.integers(0, 2**32, (n, 2), np.uint64))
  requests = tuple(jax.device_put(jnp.asarray(x, dtype=a.dtype), s) for x, a, s in zip(arrays, info[1], shardings[1]))
  return params, requests


def timed(fn, repeats: int) -> tuple[float, object]:
  """(the best of `repeats` runs' seconds after one warm-up, the last output)."""
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best, out


def _part(rows: dict, name: str, measured: float, calls: float) -> dict:
  """One output row: measured seconds of one call beside the budget row's roofline, forecast and bound (per call)."""
  r = rows[name]
  f = (r.get("forecast") or {}).get("seconds")
  per = {k: v / calls for k, v in f.items()} if f else None
  bound = r.get("bound_seconds")
  return {
      "part": name,
      "measured_seconds": measured,
      "roofline_seconds": r["seconds_overlapped"] / calls if r.get("seconds_overlapped") is not None else None,
      "forecast_seconds": per,
      "bound_seconds": bound / calls if bound else None,
      "measured_over_forecast": measured / per["central"] if per else None,
      "measured_over_bound": measured / (bound / calls) if bound else None,
      "iterations": r.get("iterations"),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true", help="the tiny model at tiny shapes (CPU tests)")
  p.add_argument("--model", default="qwen3-0.6b", help="a Qwen3 preset (random weights)")
  p.add_argument("--rows", type=int, default=128)
  p.add_argument("--prompt", type=int, default=2048)
  p.add_argument("--new", type=int, default=6144)
  p.add_argument("--update-rows", type=int, default=16)
  p.add_argument("--micro-batch", type=int, default=4)
  p.add_argument("--page-size", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  sl = local_slice()
  if not args.tiny and sl.chip.platform == "cpu":
    print("# no accelerator here: the tiny mode (the real shapes would take hours on a CPU)", flush=True)
    args.tiny = True
  if args.tiny:
    args.rows, args.prompt, args.new, args.update_rows, args.micro_batch, args.page_size = 8, 16, 8, 4, 2, 4
    args.repeats = 1
  c = device_config(args)
  dump = tempfile.mkdtemp(prefix="device_step_hlo_")
  kw = dict(prompt_len=args.prompt, parts=("sampling", "update"), log=lambda s: print(f"# {s}", flush=True))
  budget = Budget(c, sl, "fsdp=-1", lengths=f"const:{args.new}", dump_hlo=dump, keep_compiled=True, **kw)
  rows = {r["part"]: r for r in budget.run()}
  vocab, rng = budget.cfg.vocab_size, np.random.default_rng(0)

  compiled, info = budget.compiled["sampling"]
  s_args = sampler_args(info[0], compiled.input_shardings[0], vocab=vocab, prompt=args.prompt, rng=rng)
  t_sample, out = timed(lambda: compiled(*s_args), 1)  # one call is a whole decode loop
  lengths = np.asarray(jax.device_get(out[3])).sum(axis=1).astype(int)  # the response mask [N, R]
  if not (lengths == args.new).all():  # a row drew the stop id: cost the lengths the call produced
    path = os.path.join(dump, "lengths.json")
    with open(path, "w") as f:
      json.dump(lengths.tolist(), f)
    again = Budget(c, sl, "fsdp=-1", lengths=path, hlo_from=dump, **kw)
    rows.update({r["part"]: r for r in again.run() if r["part"].startswith("sampling")})

  compiled, info = budget.compiled["update"]
  u_args = list(fill(info[0], compiled.input_shardings[0], vocab=vocab, prompt=args.prompt, rng=rng))

  def update():  # the state and the previous gradient are donated: feed each update the ones the last returned
    out = compiled(*u_args)
    u_args[0], u_args[-1] = out[0], out[-1]  # (state, inputs, lr_scale, previous_grads) -> (state, metrics, grads)
    return out

  t_update, _ = timed(update, args.repeats)
  dev = jax.devices()[0]
  report = {
      "what": __doc__.split("\n")[0],
      "date": datetime.date.today().isoformat(),
      "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(), "slice": sl.name},
      "jax": jax.__version__,
      "model": rows["sampling"]["model"],
      "shapes": {"rows": args.rows, "prompt": args.prompt, "new": args.new, "update_rows": args.update_rows,
                 "micro_batch": args.micro_batch, "page_size": args.page_size},  # fmt: skip
      "response_lengths": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())},
      "parts": [
          _part(rows, "sampling", t_sample, 1.0),
          {**_part(rows, "sampling: decode step", t_sample, 1.0), "measured_seconds": None},
          _part(rows, "update", t_update, float(c.num_updates_per_step)),
      ],
  }
  report["parts"][1]["note"] = "the decode steps' share of the sampling row (not timed on their own)"
  out_path = args.out or os.path.join(REPO, "benchmarks", "results", f"device_step_{sl.name.replace(':', '_')}.json")
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1, default=float)
  for r in report["parts"]:
    print(json.dumps(r, default=float))
  print(f"# wrote {out_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
