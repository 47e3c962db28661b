"""How long one global RL step takes on a slice, from the programs the trainer runs, next to its bound.

  python -m minpro_jax.aot --budget --config=<file[:arg]> --topology=v5p-64 [--mesh=fsdp=-1]
      [--lengths=gamma:mean=8192 | const:N | FILE] [--prompt-len=256] [--seed=0] [--parts=sampling,...]
      [--config.<field>=<value> ...] [--out=reports/NAME.json] [--dump-hlo=DIR] [--hlo-from=DIR]

Each part of a step is compiled with abstract values for the slice (nothing runs on an accelerator) and costed
per loop iteration from its optimized HLO (`minpro_jax.aot.hlo_cost`): FLOPs, HBM bytes and the collectives each
iteration reaches, times the nested trip counts. Data-dependent trip counts come from a seeded response-length
draw replayed through the sampler's own refill rule (`minpro_jax.aot.schedule`). Parts:

  sampling    the sampler call the trainer makes for one step's N = prompts_per_step x group_size rollouts: the
              continuous sampler's single `while_loop` (decode steps and refills), or the static prefill + decode
  transfer    `Sampler.prepare_params`: the learner's parameters into the sampler's layout and dtype, once a step
  score       `Learner.score` over the step's rollouts (the trainer scores every step today), x 2 with decoupled PPO's
              proximal score pass (`loss.proximal=score`) over the released batch
  update      `Learner.update` for one mini-batch, x num_updates_per_step x num_epochs
  eval        the evaluation's sampling (eval.num_problems x eval.n responses on the training sampler's program),
              amortised over eval.every steps

The result is an estimate from compiled programs (docs/aot.md: what it leaves out), never a TPU measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from minpro_jax import run_config
from minpro_jax.aot.analysis import add_resident, analyze, does_not_fit, model_flops
from minpro_jax.aot.hlo_cost import HloCost, Rates
from minpro_jax.aot.lengths import draw_lengths
from minpro_jax.aot.packed import analytic_flops, learner_packing, weight_active
from minpro_jax.aot.paged_schedule import (
    PagedSchedule,
    add_analytic_kv,
    analytic_kv,
    page_bytes_per_device,
    sampler_paged_schedule,
)
from minpro_jax.aot.programs import RunPrograms, check_mesh_fits_model, model_config, run_shapes
from minpro_jax.aot.schedule import (
    Schedule,
    continuous_schedule,
    learning_flops,
    sampling_bound,
    static_schedule,
)
from minpro_jax.aot.split_step import split_step
from minpro_jax.aot.topologies import GIB, Slice
from minpro_jax.errors import ConfigError
from minpro_jax.models.attention_core import live_length_buckets
from minpro_jax.runtime.inference_mesh import layout_name
from minpro_jax.runtime.sharding import make_mesh

PARTS = ("sampling", "transfer", "score", "update", "eval")


def _param_bytes(tree) -> float:
  return float(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _shard_bytes(tree) -> float:
  """Bytes one device holds of a tree of sharded abstract arrays."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += float(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total


class _Part:
  """One compiled program of the step, costed: its HLO text, `HloCost` tree, runs per step, and its memory."""

  def __init__(self, name: str, text: str, memory: dict, tree: HloCost, calls: float, shapes: str):
    self.name, self.text, self.memory, self.tree, self.calls, self.shapes = name, text, memory, tree, calls, shapes


def _sampler_resolvers(schedule: Schedule, continuous: bool):
  """Trip counts and branch weights of a sampler program from a simulated schedule: its outermost unannotated while
  runs `schedule.iterations` times (continuous: decode steps + refills) or `decode_steps` (static decode); the
  conditional directly in the continuous loop's body is (decode step, refill), weighted by their shares; a
  conditional with one branch per live-length bucket, inside another branch, is weighted by the decode steps spent
  in each bucket."""
  k = len(schedule.buckets)

  def while_trips(ins, path):
    if path:
      return None
    return schedule.iterations if continuous else schedule.decode_steps

  def branch_weights(ins, n, path):
    in_cond = any(p.startswith("?") for p in path)
    if continuous and n == 2 and len(path) == 1 and not in_cond:
      it = max(schedule.iterations, 1)
      return (schedule.decode_steps / it, schedule.refills / it)
    if n == k and k > 1 and in_cond:
      steps = max(schedule.decode_steps, 1)
      return tuple(b / steps for b in schedule.bucket_steps)
    return None

  return while_trips, branch_weights


class Budget:
  """Compiles and costs the parts of one global step of config `c` on slice `sl` with one mesh.

  Args:
    c: the run config; sl: the slice; mesh_spec: e.g. "fsdp=-1".
    lengths: a `--lengths` spec (`minpro_jax.aot.lengths`); prompt_len: real prompt tokens per row (the KV and
      tokens of the bound and the simulation's caches; None: 256, at most the bucket; the programs are compiled at the prompt bucket
      data.max_prompt_tokens); seed: the draw's seed; parts: which of `PARTS` to compile (the step row sums
      those); dump_hlo: a folder to write each part's optimized HLO to; hlo_from: a folder of such dumps to cost
      instead of compiling (parts without a dump are compiled).
    log: a callable for progress lines.
    sampler_only: `sl` is the sampler's chips of a device split (`RunPrograms`; `minpro_jax.aot.split_step`).

  Raises:
    ConfigError: a bad field, mesh or lengths spec, naming it.
  """

  def __init__(self, c, sl: Slice, mesh_spec: str, *, lengths: str, prompt_len: int | None = None, seed: int = 0,
               parts=PARTS, dump_hlo: str | None = None, hlo_from: str | None = None,
               log=lambda s: None, sampler_only: bool = False):  # fmt: skip
    from minpro_jax.aot.sweep import canonical_mesh, parse_mesh

    run_config.validate_shapes_config(c)
    self.parts = tuple(parts)
    if not self.parts or set(self.parts) - set(PARTS):
      raise ConfigError(f"--parts={','.join(self.parts)}: choose from {','.join(PARTS)}")
    self.c, self.sl, self.log, self.dump_hlo, self.hlo_from = c, sl, log, dump_hlo, hlo_from
    self.cfg, self.model_from = model_config(c)
    self.shapes = run_shapes(c)
    prompt_len = min(256, self.shapes.prompt_len) if prompt_len is None else prompt_len
    if prompt_len < 1 or prompt_len > self.shapes.prompt_len:
      raise ConfigError(f"--prompt-len={prompt_len}: must be in [1, data.max_prompt_tokens={self.shapes.prompt_len}]")
    self.prompt_len = int(prompt_len)
    devices = sl.devices()
    shape = parse_mesh(mesh_spec, len(devices))
    check_mesh_fits_model(shape, self.cfg)
    self.mesh_shape, self.mesh_name = shape, canonical_mesh(shape)
    self.mesh = make_mesh(shape, devices=devices)
    self.progs = RunPrograms(
        c, self.cfg, self.mesh, self.shapes, hbm_bytes=sl.chip.hbm_bytes, sampler_only=sampler_only
    )
    r = self.shapes.response_len
    self.lengths, self.lengths_from = draw_lengths(lengths, self.shapes.rollouts, r, seed)
    n_eval = c.eval.num_problems * c.eval.n if "eval" in self.parts else 0
    self.eval_lengths = draw_lengths(lengths, n_eval, r, seed + 1)[0] if n_eval else None
    self.lengths_spec, self.seed = lengths, seed
    chip = sl.chip
    self.rates = Rates(chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.ici_bytes_per_s)
    self.buckets = live_length_buckets(self.shapes.prompt_len + r)
    self.packed = learner_packing(c, self.shapes, self.lengths, self.prompt_len)  # None: unpacked rows

  # ------------------------------------------------------------------------------------------ compile
  def _compile(self, name: str, lower, resolvers=(None, None), calls: float = 1.0, shapes: str = ""):
    saved = os.path.join(self.hlo_from, f"{name}.hlo.txt") if self.hlo_from else ""
    if saved and os.path.isfile(saved):  # re-cost a dumped program (another length draw) without compiling
      with open(saved) as f:
        text = f.read()
      side = saved.replace(".hlo.txt", ".memory.json")
      memory = {"hlo_from": saved}
      if os.path.isfile(side):
        with open(side) as f:
          memory = {**json.load(f), **memory}
    else:
      self.log(f"compiling {name} ...")
      t0 = time.time()
      try:
        compiled = lower().compile()
      except Exception as e:  # noqa: BLE001 - a program that does not fit is a finding, not a crash
        row = does_not_fit(e)
        if row is None:
          raise
        self.log(f"{name}: does not fit ({(row.get('total_bytes') or row.get('temp_bytes') or 0) / GIB:.1f} GiB)")
        return {**row, "compile_seconds": round(time.time() - t0, 1)}
      mem = analyze(compiled, hbm_bytes=self.sl.chip.hbm_bytes, peak_flops=0.0, hbm_bandwidth=0.0,
                    flops_total=0.0, devices=self.sl.num_chips)  # fmt: skip
      memory = {k: mem[k] for k in ("total_bytes", "temp_bytes", "argument_bytes", "fits", "hbm_fraction")}
      if name == "update" and self.c.mipu.rollback:  # MIPU's snapshot of the state (docs/aot.md)
        add_resident(memory, "mipu_snapshot_bytes", mem["alias_bytes"], self.sl.chip.hbm_bytes)
      memory["compile_seconds"] = round(time.time() - t0, 1)
      text = compiled.as_text()
      self.log(f"{name}: compiled in {memory['compile_seconds']} s")
    if self.dump_hlo:
      os.makedirs(self.dump_hlo, exist_ok=True)
      with open(os.path.join(self.dump_hlo, f"{name}.hlo.txt"), "w") as f:
        f.write(text)
      with open(os.path.join(self.dump_hlo, f"{name}.memory.json"), "w") as f:
        json.dump(memory, f)
    tree = HloCost(text, self.sl.num_chips, self.mesh_shape, self.rates, *resolvers)
    return _Part(name, text, memory, tree, calls, shapes)

  def _sampler_part(self, lengths, name: str, calls: float, num_requests: int):
    s = self.progs.trainer_sampler
    p = self.shapes.prompt_len
    # the caches hold the prompt bucket; the simulation sees the rows' real prompt in it (left padded)
    if s.continuous:
      rows, refill = s.continuous_rows(num_requests)
      if s.paged_kv is not None:  # the pool's own admission, and the pages its ragged attention reads
        sched = sampler_paged_schedule(
            s, lengths, num_requests, self.prompt_len, p, self.shapes.response_len, self._group(name)
        )
      else:
        sched = continuous_schedule(lengths, rows, refill, p, self.buckets)
      reuse = getattr(self, "_sampling", None)
      if reuse is not None and reuse[0] == (rows, refill):
        # the same decode step and refill: cost the training call's program on this schedule (the request
        # arrays' size does not change an iteration's work)
        text, memory = reuse[1], reuse[2]
        tree = HloCost(text, self.sl.num_chips, self.mesh_shape, self.rates, *_sampler_resolvers(sched, True))
        shapes = f"{num_requests} requests on {rows} decode rows, refills of {refill} (the sampling program)"
        return _Part(name, None, memory, tree, calls, shapes), sched, rows
      part = self._compile(
          name,
          lambda: self.progs.lower_continuous(num_requests, unit=getattr(sched, "unit", 1)),
          _sampler_resolvers(sched, continuous=True),
          calls,
          f"{num_requests} requests on {rows} decode rows, refills of {refill}",
      )
      if isinstance(part, _Part):
        self._sampling = ((rows, refill), part.text, part.memory)
      return part, sched, rows
    sched = static_schedule(lengths, p, self.buckets)
    shapes = run_shapes(self.c, sampler_rows=_static_rows(num_requests))
    progs = RunPrograms(self.c, self.cfg, self.mesh, shapes, hbm_bytes=self.sl.chip.hbm_bytes)
    pre = self._compile(f"{name}.prefill", progs._lower_prefill, calls=calls)
    dec = self._compile(f"{name}.decode", progs._lower_decode, _sampler_resolvers(sched, continuous=False), calls)
    return (pre, dec), sched, progs.shapes.sampler_rows

  def _group(self, name: str) -> int:
    """Samples per prompt of a sampler part: the step's group_size, or the evaluation's n."""
    return int(self.c.eval.n if name == "eval" else self.c.group_size)

  # ------------------------------------------------------------------------------------------- rows
  def run(self) -> list[dict[str, Any]]:
    """Compiles every part and returns the budget rows (one per part, then "step"); see `render`."""
    c, sh, chips = self.c, self.shapes, self.sl.num_chips
    rows: list[dict[str, Any]] = []
    cfg = self.progs.trainer_sampler.config
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
    prepared = self.progs.prepared_params()
    sampler_weight_bytes = _param_bytes(prepared)
    resident = max(1, min(chips, int(np.prod(self.sl.chips_per_host))))
    bound_kw = dict(
        kv_bytes_per_token=kv_per_token,
        weight_bytes=sampler_weight_bytes,
        chips=chips,
        resident_chips=resident,
        hbm_bandwidth=self.sl.chip.hbm_bytes_per_s,
    )

    has_rates = bool(self.sl.chip.hbm_bytes_per_s)
    if "sampling" in self.parts:
      part, sched, srows = self._sampler_part(self.lengths, "sampling", 1.0, sh.rollouts)
      bound = sampling_bound(self.lengths, self.prompt_len, **bound_kw)
      rows += self._sampling_rows("sampling", part, sched, srows, bound, 1.0)
    if "transfer" in self.parts:
      part = self._compile("transfer", self.progs.lower_prepare, shapes="learner params -> sampler params")
      moved = _shard_bytes(self.progs.params) + sampler_weight_bytes / chips
      t_bound = moved / self.sl.chip.hbm_bytes_per_s if has_rates else None
      rows.append(self._row("transfer", part, 1, t_bound))

    # learner
    mm = dict(matmul_params=_matmul_params(self.cfg), attn_flops_per_ctx=_attn_per_ctx(self.cfg))
    fwd = learning_flops(self.lengths, self.prompt_len, **mm)
    peak_total = chips * self.sl.chip.peak_bf16_flops or float("nan")
    mb, pk = sh.micro_batch, self.packed or {}
    if "score" in self.parts:
      what = pk["score"].describe() if pk else f"{sh.rollouts}x{sh.seq_len}, micro-batch {mb}"
      calls = 1 + int(run_config.loss_config(c).reads_proximal_logp)  # decoupled PPO scores its released batch too
      part = self._compile("score", self.progs._lower_score, calls=calls, shapes=what)
      micro = -(-sh.rollouts // mb) if not pk else round(pk["score"].active_per_run)
      rows.append(self._row("score", part, micro, fwd / peak_total if has_rates else None, "score"))
    if "update" in self.parts:
      what = pk["update"].describe() if pk else f"{sh.mini_batch}x{sh.seq_len}"
      calls = c.num_updates_per_step * run_config.num_epochs(c)  # every pass over the batch
      part = self._compile("update", self.progs._lower_update, calls=calls, shapes=what)
      micro = -(-sh.mini_batch // mb) if not pk else pk["update"].active_per_run
      rows.append(self._row("update", part, micro, 3 * fwd / peak_total if has_rates else None, "update"))

    # evaluation, amortised
    if self.eval_lengths is not None:
      every = c.eval.every or max(c.total_steps, 1)
      n_eval = int(self.eval_lengths.size)
      part, sched, srows = self._sampler_part(self.eval_lengths, "eval", 1.0 / every, n_eval)
      bound = sampling_bound(self.eval_lengths, self.prompt_len, **bound_kw)
      rows += self._sampling_rows(f"eval (1/{every})", part, sched, srows, bound, 1.0 / every)

    step = {"part": "step", "bound_seconds": 0.0, "seconds_overlapped": 0.0, "seconds_serial": 0.0}
    for r in rows:
      if r.get("sub"):
        continue
      for k in ("bound_seconds", "seconds_overlapped", "seconds_serial"):
        step[k] = None if step[k] is None or r.get(k) is None else step[k] + r[k]
    if step["seconds_overlapped"] is not None and step["bound_seconds"] and has_rates:
      step["ratio"] = step["seconds_overlapped"] / step["bound_seconds"]
    rows.append(step)
    common = self._common()
    return [{**common, **r} for r in rows]

  def _common(self) -> dict[str, Any]:
    from minpro_jax.aot.sweep import fingerprint

    s = self.progs.trainer_sampler
    return {
        "fingerprint": fingerprint(self.c),
        "model": self.model_from,
        "slice": self.sl.name,
        "chips": self.sl.num_chips,
        "mesh": self.mesh_name,
        "sampler_layout": layout_name(s.mesh, s.rules) if s.rules is not None else f"{self.mesh_name} (learner rules)",
        "decode_rows": self.progs.decode_rows,
        "lengths": self.lengths_spec,
        "lengths_from": self.lengths_from,
        "lengths_mean": float(self.lengths.mean()),
        "prompt_len": self.prompt_len,
        "seed": self.seed,
    }

  def _row(self, name: str, part, per_call: int, bound: float, analytic: str | None = None) -> dict[str, Any]:
    """A part's row; `per_call`: loop iterations of one run of its program (a run of k >= 1 calls a step shows
    k x per_call; a part amortised over several steps shows one run's)."""
    if not isinstance(part, _Part):
      return {"part": name, "fits": False, "memory": part, "bound_seconds": bound}
    packed = (self.packed or {}).get(analytic)
    if packed is not None:  # only the micro-batches holding samples run (`minpro_jax.aot.packed`)
      weight_active(part.tree.root, packed)
    tree, calls = part.tree, part.calls
    serial, overlapped = tree.seconds(False) * calls, tree.seconds(True) * calls
    total = tree.total() * calls
    extra = 0.0
    if (
        analytic and self.sl.chip.peak_bf16_flops
    ):  # FLOPs XLA cannot see (Pallas kernels are custom calls): the analytic count's excess
      rows = self.shapes.mini_batch if analytic == "update" else self.shapes.rollouts
      flops = analytic_flops(self.cfg, analytic, packed) if packed else model_flops(
          self.cfg, analytic, rows=rows, prompt_len=self.shapes.prompt_len,
          response_len=self.shapes.response_len, remat=self.cfg.remat)  # fmt: skip
      missing = flops / self.sl.num_chips * calls - total.flops
      if missing > 0.02 * max(total.flops, 1.0):
        extra = missing / self.sl.chip.peak_bf16_flops
    per = tree.total()
    t = self.rates.times(per)
    return {
        "part": name,
        "shapes": part.shapes,
        "calls": calls,
        "iterations": int(round(per_call * calls)) if calls >= 1 else per_call,
        "seconds_per_iteration": (overlapped + extra) / calls / max(per_call, 1),
        "limiter": t["limiter"],
        "seconds_overlapped": overlapped + extra,
        "seconds_serial": serial + extra,
        "opaque_flop_seconds": extra,
        "bound_seconds": bound,
        "ratio": (overlapped + extra) / bound if bound else None,
        "per_call": per.as_dict(),
        "loops": tree.loops(),
        "memory": part.memory,
        **({"packed": packed.as_dict()} if packed is not None else {}),
    }

  def _sampling_rows(self, name: str, part, sched: Schedule, srows: int, bound: dict, calls: float) -> list[dict]:
    base = {"schedule": {**sched.__dict__, "rows": srows}, "bound_terms": bound}
    bound_total = None if bound is None else bound["total"] * calls
    if isinstance(part, tuple):  # static: prefill + decode programs
      pre, dec = part
      if not isinstance(pre, _Part) or not isinstance(dec, _Part):
        bad = pre if not isinstance(pre, _Part) else dec
        return [{"part": name, "fits": False, "memory": bad, "bound_seconds": bound_total, **base}]
      pre_row = self._row(f"{name}: prefill", pre, 1, 0.0)
      dec_row = self._row(f"{name}: decode", dec, sched.decode_steps, 0.0)
      for r in (pre_row, dec_row):
        r["sub"] = True
      total = {
          "part": name,
          "iterations": sched.iterations,
          "seconds_overlapped": pre_row["seconds_overlapped"] + dec_row["seconds_overlapped"],
          "seconds_serial": pre_row["seconds_serial"] + dec_row["seconds_serial"],
          "limiter": dec_row["limiter"],
          "bound_seconds": bound_total,
          **base,
      }
      total["seconds_per_iteration"] = total["seconds_overlapped"] / calls / max(sched.iterations, 1)
      total["ratio"] = total["seconds_overlapped"] / total["bound_seconds"] if total["bound_seconds"] else None
      return [pre_row, dec_row, total]
    if not isinstance(part, _Part):
      return [{"part": name, "fits": False, "memory": part, "bound_seconds": bound_total, **base}]
    row = self._row(name, part, sched.iterations, bound_total)
    row.update(base)
    kv = None
    if isinstance(sched, PagedSchedule):  # the ragged attention's KV reads: analytic, added to the HLO's cost
      s = self.progs.trainer_sampler
      page = page_bytes_per_device(s.config, sched.page_size, s.mesh, s.rules)
      kv = analytic_kv(sched, page, self.sl.chip.hbm_bytes_per_s)
      add_analytic_kv(row, kv, calls, sched.iterations)
    subs = []
    loop = next((ch for ch in part.tree.root.children if ch.kind == "while" and ch.trip_source == "given"), None)
    if loop is not None:
      for br in loop.children:
        if br.kind != "branch" or br.trip_source != "weight":
          continue
        is_decode = abs(br.trips * loop.trips - sched.decode_steps) < 0.5 and sched.decode_steps > 0
        label, count = ("decode step", sched.decode_steps) if is_decode else ("refill", sched.refills)
        per = br.per_run()
        t = self.rates.times(per)
        subs.append(
            {
                "part": f"{name}: {label}",
                "sub": True,
                "iterations": count,
                "seconds_per_iteration": br.seconds_per_run(True),
                "seconds_per_iteration_serial": br.seconds_per_run(False),
                "limiter": t["limiter"],
                "seconds_overlapped": br.seconds_per_run(True) * count * calls,
                "seconds_serial": br.seconds_per_run(False) * count * calls,
                "per_iteration": per.as_dict(),
            }
        )
        if is_decode and kv is not None:
          add_analytic_kv(subs[-1], kv, calls, sched.decode_steps)
      if loop.own_overlapped > 0:  # what every iteration does outside both branches (e.g. copies of the carry)
        t = self.rates.times(loop.own)
        subs.append(
            {
                "part": f"{name}: every iteration, outside the branches",
                "sub": True,
                "iterations": sched.iterations,
                "seconds_per_iteration": loop.own_overlapped,
                "seconds_per_iteration_serial": loop.own_serial,
                "limiter": t["limiter"],
                "seconds_overlapped": loop.own_overlapped * loop.trips * calls,
                "seconds_serial": loop.own_serial * loop.trips * calls,
                "per_iteration": loop.own.as_dict(),
            }
        )
    return [*subs, row]


def _static_rows(n: int) -> int:
  from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

  top = DEFAULT_BATCH_BUCKETS[-1]
  return next((b for b in DEFAULT_BATCH_BUCKETS if b >= n), -(-n // top) * top)


def _matmul_params(cfg) -> float:
  d, hd = cfg.hidden_size, cfg.head_dim
  attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  if cfg.is_moe:
    mlp = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
  else:
    mlp = 3 * d * cfg.intermediate_size
  return float(cfg.num_layers * (attn + mlp) + d * cfg.vocab_size)


def _attn_per_ctx(cfg) -> float:
  return float(4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)


# ------------------------------------------------------------------------------------------------ output
def _t(s) -> str:
  if s is None:
    return ""
  if s >= 3600:
    return f"{s / 3600:.2f} h"
  if s >= 100:
    return f"{s:,.0f} s"
  if s >= 1:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms"


def render(rows: list[dict[str, Any]]) -> str:
  """The budget rows as a Markdown table: part, iterations, per-iteration time and limiter, total (overlapped and
  serial communication), bound, ours / bound."""
  lines = [
      "| part | iterations | per iteration | limiter | total (overlapped) | total (serial) | bound | ours / bound |",
      "|---|---:|---:|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    if r.get("fits") is False:
      mem = r.get("memory", {})
      size = mem.get("total_bytes") or mem.get("temp_bytes")
      what = f"does not fit ({size / GIB:.1f} GiB)" if size else "does not fit"
      lines.append(f"| {r['part']} | | | {what} | | | {_t(r.get('bound_seconds'))} | |")
      continue
    it = r.get("iterations")
    ratio = r.get("ratio")
    lines.append(
        f"| {r['part']} | {'' if it is None else f'{it:,}'} | {_t(r.get('seconds_per_iteration'))} | "
        f"{r.get('limiter', '')} | {_t(r.get('seconds_overlapped'))} | {_t(r.get('seconds_serial'))} | "
        f"{_t(r.get('bound_seconds')) if not r.get('sub') else ''} | {'' if ratio is None else f'{ratio:.1f}x'} |"
    )
  return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m minpro_jax.aot --budget", description=__doc__.split("\n")[0])
  p.add_argument("--budget", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--topology", required=True, help="v5p-64, v6e-16, v5e-4, ... or cpu:N")
  p.add_argument("--mesh", default="", help="the mesh, e.g. fsdp=-1 (default: the config's mesh.shape or fsdp=-1)")
  p.add_argument("--lengths", default="gamma:mean=8192", help="response lengths: gamma:mean=M[,shape=K], const:N, FILE")
  p.add_argument(
      "--prompt-len", type=int, default=None, help="real prompt tokens per row (default: 256, at most the bucket)"
  )
  p.add_argument("--seed", type=int, default=0, help="seed of the length draw")
  p.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
  p.add_argument("--out", default="", help="JSON report path")
  p.add_argument("--dump-hlo", default="", help="folder for each part's optimized HLO")
  p.add_argument("--hlo-from", default="", help="a --dump-hlo folder: cost its programs instead of compiling")
  return p


def main(argv: list[str] | None = None) -> int:
  """The `--budget` command line (module docstring). Exit status 0, or 2 with one `error: ...` line."""
  from minpro_jax.aot.__main__ import _prepare_environment, run_config_of

  argv = list(sys.argv[1:] if argv is None else argv)
  config_args = [a for a in argv if a.startswith("--config")]
  args = _parser().parse_args([a for a in argv if not a.startswith("--config")])
  _prepare_environment(args.topology)

  from minpro_jax.errors import UserError

  try:
    from minpro_jax.aot.sweep import machine_info
    from minpro_jax.aot.topologies import parse_slice

    sl = parse_slice(args.topology)
    name, config = run_config_of(config_args)
    mesh = args.mesh or config.mesh.shape or "fsdp=-1"
    kw = dict(
        lengths=args.lengths,
        prompt_len=args.prompt_len,
        seed=args.seed,
        parts=[p.strip() for p in args.parts.split(",") if p.strip()],
        dump_hlo=args.dump_hlo or None,
        hlo_from=args.hlo_from or None,
        log=lambda s: print(f"# {s}", file=sys.stderr, flush=True),
    )
    # with sampling.devices: each side on its own chips, and the overlapped step (`minpro_jax.aot.split_step`)
    rows = (
        split_step(config, sl, mesh, **kw)
        if config.sampling.get("devices", 0)
        else Budget(config, sl, mesh, **kw).run()
    )
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  r0 = rows[0]
  print(
      f"# {name} on {sl.name} ({sl.num_chips} chips), mesh {r0['mesh']}; lengths {r0['lengths_from']} "
      f"(mean {r0['lengths_mean']:.0f}); prompts {r0['prompt_len']} tokens"
  )
  print("# an estimate from compiled programs (docs/aot.md), not a TPU measurement")
  print(render(rows))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    report = {"tool": "python -m minpro_jax.aot --budget", "config": name, "machine": machine_info(), "rows": rows}
    with open(args.out + ".tmp", "w") as f:
      json.dump(report, f, indent=1, default=float)
    os.replace(args.out + ".tmp", args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
