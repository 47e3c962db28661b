"""Useful tokens/s with long-tailed response lengths: continuous (dense or paged KV) vs static `Sampler` vs
`transformers` `generate`.

Run:  .venv/bin/python benchmarks/sampler_lengths.py [--full]     (default: about 3 minutes on 2 CPU cores)
Writes benchmarks/results/sampler_lengths.json (--full: sampler_lengths_full.json).

Lengths, identical on every side: request r of a call gets a scheduled length L_r; a logits processor sets the
stop id's logit to +1e9 at response index L_r - 1 and to -1e9 at every other index (so it is never drawn
early and always drawn then), on our samplers via `Sampler(logits_processor=...)` keyed by the request's
group id, on `transformers` via a `LogitsProcessor` keyed by the row's place in the call. Every side's
returned lengths are checked to equal L. L_r = ceil(R * q_r^(7/3)), q_r the N midpoint quantiles (i + 0.5) / N
in a fixed shuffled order: a power law with mean ~0.3 R and a tail to R (`mean_over_max` reports it).
Sampling at temperature 1 over the full vocabulary (`generate(do_sample=True, top_k=0)`), prompts of 16 random
tokens, random weights (`init_model`) in the preset's shapes, the same weights on both frameworks
(`save_hf_checkpoint`).

At batch b: N = `requests_per_row` * b requests. Continuous = one `generate` call on b decode rows
(`engines.Continuous(decode_rows=b)`); static = N / b calls of b rows (the static engine: every row of a call
runs until the call's longest row stops); `transformers` = N / b `generate` calls of b rows (it stops a call
when all its rows have stopped). useful tokens/s = sum(L) / wall seconds (prefill included, compile
excluded: one warm-up call per side, then the sides in turn, best of `reps`). `continuous` is the default
(refills inside the one jitted loop, refill_rows max(1, b // 8)); ablations: `continuous_chunks`
(the host-refill engine: host-driven chunks, the host refills between them) and `continuous_chunks_refill1`
(the same, refilled as soon as one row stops). `paged` = the continuous sampler on a paged KV pool
(`sampling.kv_cache="paged"`: `PagedKV(page_size)`, pool of the dense cache's memory, the plain-JAX paged
attention), the same decode rows and refills; `paged_over_continuous` is its speed over `continuous` (best wall
time), `paged_over_continuous_cpu` the same from the median process CPU seconds of each side (the work done, less
sensitive than wall time to a loaded machine).

Decode step vs position (tiny shapes, max_new_tokens 4096, 16 rows): the wall time per decode step of a
jitted scan of 32 steps starting at position p, with live-length attention (what the continuous sampler runs)
and with attention over the whole cache (the static sampler), best of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minpro_jax.models import get_preset, init_model  # noqa: E402
from minpro_jax.models.hf_io import save_hf_checkpoint  # noqa: E402
from minpro_jax.models.transformer import KVCache  # noqa: E402
from minpro_jax.sampling import PagedKV, Sampler, SamplingParams, engines  # noqa: E402

STOP = 1
PROMPT_LEN = 16


def schedule(n: int, max_len: int, seed: int = 0) -> np.ndarray:
  """[n] int lengths in [1, max_len]: ceil(max_len * q^(7/3)) over midpoint quantiles q, shuffled."""
  q = (np.arange(n) + 0.5) / n
  lens = np.clip(np.ceil(max_len * q ** (7 / 3)).astype(np.int64), 1, max_len)
  return np.random.RandomState(seed).permutation(lens)


def jax_stop_processor(sched: np.ndarray):
  table = jnp.asarray(sched, jnp.int32)

  def proc(logits, step, group):
    fire = step == table[jnp.clip(group, 0, table.shape[0] - 1)] - 1
    return logits.at[:, STOP].set(jnp.where(fire, 1e9, -1e9))

  return proc


def _interleaved(fns: dict, reps: int, cpu: dict | None = None) -> dict:
  """{name: best wall seconds}: one warm-up call each, then `reps` rounds calling each fn in turn, so a drift of
  the machine's speed hits every side alike. `cpu`, if given, receives {name: median process CPU seconds} (all
  the process's threads: the work done, less sensitive than wall time to a loaded machine)."""
  for fn in fns.values():
    fn()
  wall, used = {k: [] for k in fns}, {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t0, c0 = time.perf_counter(), time.process_time()
      fn()
      wall[k].append(time.perf_counter() - t0)
      used[k].append(time.process_time() - c0)
  if cpu is not None:
    cpu.update({k: float(np.median(v)) for k, v in used.items()})
  return {k: min(v) for k, v in wall.items()}


def bench_lengths(
    preset: str,
    batches,
    max_len: int,
    requests_per_row: int,
    reps: int,
    hf_on: bool = True,
    page_size: int = 16,
    ablations: bool = True,
):
  import torch
  import transformers

  cfg = get_preset(preset)
  model = init_model(cfg, seed=0)
  state = nnx.split(model)[1]
  hf = None
  dev = "cuda" if torch.cuda.is_available() else "cpu"  # transformers on the accelerator JAX has, if any
  if hf_on:
    with tempfile.TemporaryDirectory() as d:
      save_hf_checkpoint(model, d)
      hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval().to(dev)
  sp = SamplingParams(temperature=1.0, max_new_tokens=max_len, stop_token_ids=(STOP,))
  rows = []
  for b in batches:
    n = requests_per_row * b
    sched = schedule(n, max_len)
    proc = jax_stop_processor(sched)
    rng = np.random.RandomState(1)
    prompts = rng.randint(2, cfg.vocab_size, (n, PROMPT_LEN)).tolist()
    kw = dict(prompt_buckets=(PROMPT_LEN,), logits_processor=proc)
    cont = Sampler(cfg, **kw, engine=engines.Continuous(decode_rows=b))
    cont1 = Sampler(cfg, **kw, engine=engines.HostRefill(decode_rows=b, refill_rows=1))
    cont_chunks = Sampler(cfg, **kw, engine=engines.HostRefill(decode_rows=b))
    paged = Sampler(cfg, **kw, engine=engines.Paged(decode_rows=b, kv=PagedKV(page_size)))
    static = Sampler(cfg, **kw, engine="static")
    prepared = cont.prepare_params(state)
    prep_static, prep1, prep_chunks, prep_paged = (
        static.prepare_params(state),
        cont1.prepare_params(state),
        cont_chunks.prepare_params(state),
        paged.prepare_params(state),
    )
    got = {}

    def run_cont(s=cont, p=prepared, name="continuous"):
      got[name] = s.generate(p, prompts, sp, seed=0).lengths

    def run_static():
      got["static"] = np.concatenate(
          [
              static.generate(prep_static, prompts[i : i + b], sp, seed=0, group_ids=range(i, i + b)).lengths
              for i in range(0, n, b)
          ]
      )

    class SchedStop(transformers.LogitsProcessor):

      def __init__(self, offset):
        self.offset = offset

      def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - PROMPT_LEN
        due = torch.as_tensor(sched[self.offset : self.offset + scores.shape[0]] - 1 == step, device=scores.device)
        scores[:, STOP] = torch.where(due, 1e9, -1e9).to(scores.dtype)
        return scores

    def run_hf():
      lens = []
      for i in range(0, n, b):
        ids = torch.tensor(prompts[i : i + b], device=dev)
        with torch.no_grad():
          out = hf.generate(
              ids,
              attention_mask=torch.ones_like(ids),
              max_new_tokens=max_len,
              do_sample=True,
              temperature=1.0,
              top_k=0,
              top_p=1.0,
              use_cache=True,
              eos_token_id=STOP,
              pad_token_id=0,
              logits_processor=transformers.LogitsProcessorList([SchedStop(i)]),
          )
        resp = out[:, PROMPT_LEN:].cpu().numpy()
        is_stop = resp == STOP
        lens.append(np.where(is_stop.any(1), is_stop.argmax(1) + 1, resp.shape[1]))
      got["hf"] = np.concatenate(lens)

    fns = {"continuous": run_cont, "paged": lambda: run_cont(paged, prep_paged, "paged")}
    if ablations:
      fns["continuous_chunks"] = lambda: run_cont(cont_chunks, prep_chunks, "continuous_chunks")
      fns["continuous_chunks_refill1"] = lambda: run_cont(cont1, prep1, "continuous_chunks_refill1")
    fns["static"] = run_static
    if hf is not None:
      fns["hf"] = run_hf
    cpu = {}
    t = _interleaved(fns, reps, cpu)
    for k, lens in got.items():
      np.testing.assert_array_equal(lens, sched, err_msg=f"{preset} b={b}: {k} lengths differ from the schedule")
    useful = int(sched.sum())
    out = dict(
        batch=b,
        requests=n,
        max_new_tokens=max_len,
        mean_len=float(sched.mean()),
        mean_over_max=float(sched.mean() / max_len),
        useful_tokens=useful,
        tok_s={k: useful / v for k, v in t.items()},
        seconds=t,
        continuous_over_static=t["static"] / t["continuous"],
        paged_over_continuous=t["continuous"] / t["paged"],
        median_cpu_seconds=cpu,
        paged_over_continuous_cpu=cpu["continuous"] / cpu["paged"],
        page_size=page_size,
    )
    if "hf" in t:
      out["continuous_over_hf"] = t["hf"] / t["continuous"]
    print(json.dumps({preset: out}), flush=True)
    rows.append(out)
  return dict(preset=preset, weights="random init_model (same weights on every side)", runs=rows)


def trainer_like(n: int = 512, max_len: int = 16, reps: int = 3, page_sizes=(16, 64), group_size: int = 1):
  """The default config's sampling call (tiny shapes, 512 samples in one `generate`, max_new_tokens 16) with the
  benchmark's stop schedule: the static sampler (all 512 rows at once, what the trainer ran before) against the
  continuous one at decode_rows 64 (the default) and 512, and the paged one at 64 rows per page size. With
  `group_size` G > 1, n / G prompts of G samples each, as the trainer calls it (the schedule per group: a
  group's samples stop together; the paged sampler shares each prompt's full pages). Times: best and median wall
  seconds, median process CPU seconds."""
  cfg = get_preset("tiny")
  state = nnx.split(init_model(cfg, seed=0))[1]
  sched = schedule(n // group_size, max_len)
  proc = jax_stop_processor(sched)
  prompts = np.random.RandomState(1).randint(2, cfg.vocab_size, (n // group_size, PROMPT_LEN)).tolist()
  sp = SamplingParams(temperature=1.0, max_new_tokens=max_len, stop_token_ids=(STOP,))
  kw = dict(prompt_buckets=(PROMPT_LEN,), logits_processor=proc)
  samplers = {
      "static_512_rows": Sampler(cfg, **kw, engine="static"),
      "continuous_64_rows": Sampler(cfg, **kw, engine=engines.Continuous(decode_rows=64)),
      "continuous_512_rows": Sampler(cfg, **kw, engine=engines.Continuous(decode_rows=512)),
      **{
          f"paged{ps}_64_rows": Sampler(cfg, **kw, engine=engines.Paged(decode_rows=64, kv=PagedKV(ps)))
          for ps in page_sizes
      },
  }
  prepared = {k: v.prepare_params(state) for k, v in samplers.items()}
  want = np.repeat(sched, group_size)

  def call(k):
    lens = samplers[k].generate(prepared[k], prompts, sp, seed=0, group_size=group_size).lengths
    np.testing.assert_array_equal(lens, want, err_msg=f"trainer_like {k}: lengths differ from the schedule")

  for k in samplers:  # warm-up (compile)
    call(k)
  wall, cpu = {k: [] for k in samplers}, {k: [] for k in samplers}
  for _ in range(reps):  # in turn, so a drift of the machine's speed hits every side alike
    for k in samplers:
      t0, c0 = time.perf_counter(), time.process_time()
      call(k)
      wall[k].append(time.perf_counter() - t0)
      cpu[k].append(time.process_time() - c0)
  useful = int(want.sum())
  out = dict(requests=n, group_size=group_size, max_new_tokens=max_len, useful_tokens=useful, reps=reps)
  out["seconds"] = {k: min(v) for k, v in wall.items()}
  out["median_seconds"] = {k: float(np.median(v)) for k, v in wall.items()}
  # the process's CPU seconds (all its threads): the work done, less sensitive than wall time to a loaded machine
  out["median_cpu_seconds"] = {k: float(np.median(v)) for k, v in cpu.items()}
  out["tok_s"] = {k: useful / v for k, v in out["seconds"].items()}
  out["paged_over_continuous"] = {
      f"paged{ps}": {
          q: out[q]["continuous_64_rows"] / out[q][f"paged{ps}_64_rows"]
          for q in ("seconds", "median_seconds", "median_cpu_seconds")
      }
      for ps in page_sizes
  }
  print(json.dumps({f"trainer_like_tiny_g{group_size}": out}), flush=True)
  return out


def step_vs_position(max_len: int = 4096, rows: int = 16, positions=(256, 1000, 2000, 4000), steps: int = 32):
  cfg = get_preset("tiny")
  sampler = Sampler(cfg, prompt_buckets=(PROMPT_LEN,))
  model = sampler.engine.core.model(sampler.prepare_params(nnx.split(init_model(cfg, seed=0))[1]).state)
  s = PROMPT_LEN + max_len
  cache = KVCache.zeros(sampler.config, rows, s)
  cache = cache.replace(segment_ids=jnp.ones_like(cache.segment_ids))

  def make(live: bool):
    @jax.jit
    def run(cache, start):
      def body(c, i):
        slot = PROMPT_LEN + start + i
        pos = jnp.full((rows, 1), slot, jnp.int32)
        tok = jnp.full((rows, 1), 7, jnp.int32)
        if live:
          o = model(tok, pos, jnp.ones_like(pos), cache=c, cache_index=jnp.full((rows,), slot), live_len=slot + 1)
        else:
          o = model(tok, pos, jnp.ones_like(pos), cache=c, cache_index=slot)
        return o.cache, o.out[:, 0, 0]

      return jax.lax.scan(body, cache, jnp.arange(steps))[1]

    return run

  out = {}
  for name, live in (("live_length", True), ("full_cache", False)):
    fn = make(live)
    per = {}
    for p in positions:
      jax.block_until_ready(fn(cache, p))
      best = float("inf")
      for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(fn(cache, p))
        best = min(best, time.perf_counter() - t)
      per[p] = best / steps * 1e3
    out[name] = {"step_ms_by_position": per}
  lv = out["live_length"]["step_ms_by_position"]
  out["live_256_over_live_4000"] = lv[positions[0]] / lv[positions[-1]]
  out.update(rows=rows, max_new_tokens=max_len, steps_per_timing=steps)
  print(json.dumps({"step_vs_position": out}), flush=True)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--full", action="store_true", help="longer lengths, more requests and rounds")
  ap.add_argument("--no-hf", action="store_true", help="skip transformers (our samplers only)")
  ap.add_argument("--per-row", type=int, default=None, help="requests per decode row (both shapes)")
  ap.add_argument("--name", default=None, help="result file name under benchmarks/results/ (sampler_lengths*)")
  ap.add_argument(
      "--parts", default="lengths,trainer_like,step_vs_position", help="which measurements (comma list; default all)"
  )
  ap.add_argument("--presets", default="tiny,smollm2-135m", help="model shapes of the lengths part (comma list)")
  ap.add_argument("--batches", default="16,64", help="decode batches of the lengths part (comma list)")
  ap.add_argument("--page-size", type=int, default=16, help="the paged sampler's page size (lengths part)")
  ap.add_argument("--max-len", type=int, default=None, help="maximum response length R of the lengths part")
  ap.add_argument("--no-ablations", action="store_true", help="lengths part: skip the host-chunked continuous sides")
  ap.add_argument("--reps", type=int, default=None, help="timing rounds of every part (default: by part and --full)")
  args = ap.parse_args()
  parts = set(args.parts.split(","))
  presets, batches = args.presets.split(","), tuple(int(b) for b in args.batches.split(","))
  unknown = parts - {"lengths", "trainer_like", "step_vs_position"}
  if unknown:
    ap.error(f"--parts: unknown {sorted(unknown)}; choose from lengths, trainer_like, step_vs_position")
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  result = dict(
      device=str(jax.devices()[0]),
      cpu_count=os.cpu_count(),
      load_average_start=os.getloadavg(),
      stop_schedule="ceil(R * q^(7/3)), q midpoint quantiles, shuffled; stop logit +1e9 at L-1, -1e9 elsewhere",
      models=[],
  )
  if args.full:
    plan = (("tiny", 256, 8, 3), ("smollm2-135m", 64, 4, 2))
  else:
    plan = (("tiny", 128, 4, 2), ("smollm2-135m", 32, 2, 1))
  for preset, max_len, per_row, reps in plan if "lengths" in parts else ():
    if preset not in presets:
      continue
    per_row, max_len, reps = args.per_row or per_row, args.max_len or max_len, args.reps or reps
    result["models"].append(
        bench_lengths(
            preset,
            batches,
            max_len,
            per_row,
            reps,
            hf_on=not args.no_hf,
            page_size=args.page_size,
            ablations=not args.no_ablations,
        )
    )
  if "trainer_like" in parts:
    reps = args.reps or (10 if args.full else 5)
    result["trainer_like_tiny"] = trainer_like(reps=reps)
    result["trainer_like_tiny_grouped"] = trainer_like(reps=reps, group_size=8)  # as the trainer calls it
  if "step_vs_position" in parts:
    result["step_vs_position_tiny"] = step_vs_position()
  result["load_average_end"] = os.getloadavg()
  text = json.dumps(result, indent=1)
  print(text)
  name = args.name or ("sampler_lengths_full.json" if args.full else "sampler_lengths.json")
  os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
  with open(os.path.join(os.path.dirname(__file__), "results", name), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
