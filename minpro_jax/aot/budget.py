"""How long one global RL step takes on a slice, from the programs the trainer runs: roofline, bound and forecast.

The command line is `python -m minpro_jax.aot --budget` (`minpro_jax.aot.budget_cli`). Each part of a step is
compiled with abstract values for the slice (nothing runs on an accelerator) and costed per loop iteration from its
optimized HLO (`minpro_jax.aot.hlo_cost`): FLOPs, HBM bytes and the collectives each iteration reaches, times the
nested trip counts. Data-dependent trip counts come from a seeded response-length draw replayed through the
sampler's own refill rule (`minpro_jax.aot.schedule`). Each part gets three times: its **roofline** (those bytes and
FLOPs at peak, communication overlapped), the **bound** for the same work (the physics of it, `schedule`), and a
**forecast** band (`minpro_jax.aot.forecast`: per-op efficiencies and floors, collectives on the slice's links,
each constant sourced in `minpro_jax.aot.efficiency`). Parts:

  sampling    the sampler call the trainer makes for one step's N = prompts_per_step x group_size rollouts: the
              continuous sampler's single `while_loop` (decode steps and refills), or the static prefill + decode;
              in the in-flight mode (`staleness.mode`), one step's share of the streaming pool's loop, its
              iterations from the pool's replay in the steady state (`minpro_jax.aot.stream_schedule`)
  transfer    `Sampler.prepare_params`: the learner's parameters into the sampler's layout and dtype, once a step
  score       `Learner.score` over the step's rollouts, on the steps the trainer runs it: every step when the loss
              reads the learner's log-probs (TIS/MIS), else every log.mismatch_every steps (amortised); plus decoupled
              PPO's proximal score pass (`loss.proximal=score`) over the released batch, every step
  update      `Learner.update` for one mini-batch, x num_updates_per_step x num_epochs
  eval        the evaluation's sampling as the trainer runs it: calls of max(1, 256 // eval.n) prompts x eval.n
              samples with eval's temperature and top-p, ceil(eval.num_problems / prompts per call) calls, amortised
              over eval.every steps
  host        (forecast only) detokenising and grading each process's rows, from measured per-response costs

None of the three is a measurement on an accelerator (docs/aot.md: what each covers and what none does).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import numpy as np

from minpro_jax.aot.analysis import add_resident, analyze, does_not_fit, model_flops
from minpro_jax.aot.efficiency import constants_for, host_seconds_per_response
from minpro_jax.aot.forecast import Forecaster, forecast_extra, record
from minpro_jax.aot.hlo_cost import HloCost, Rates
from minpro_jax.aot.lengths import draw_lengths
from minpro_jax.aot.links import Links
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
from minpro_jax.aot.step_rows import (
    add_forecast,
    eval_calls,
    eval_sampling,
    mean_schedule,
    score_every,
    step_row,
    sum_forecasts,
)
from minpro_jax.aot.stream_schedule import steady_schedule, streaming_schedule
from minpro_jax.aot.sweep import canonical_mesh, fingerprint, parse_mesh
from minpro_jax.aot.topologies import GIB, Slice
from minpro_jax.errors import ConfigError
from minpro_jax.models.attention_core import live_length_buckets
from minpro_jax.run import run_config
from minpro_jax.run.inflight_runner import inflight_mode
from minpro_jax.runtime.inference_mesh import layout_name
from minpro_jax.runtime.sharding import make_mesh
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

PARTS = ("sampling", "transfer", "score", "update", "eval")
STREAM_STEPS = 8  # global steps of length draws the in-flight mode's schedule is replayed over


def param_bytes(tree) -> float:
  """Bytes of a tree of (abstract) arrays, whole (every shard counted once)."""
  return float(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def shard_bytes(tree) -> float:
  """Bytes one device holds of a tree of sharded abstract arrays."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += float(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total


class _Part:
  """One compiled program of the step, costed: its HLO text, `HloCost` tree, runs per step, its memory, and its
  `Forecaster` (None without chip figures)."""

  def __init__(self, name: str, text: str, memory: dict, tree: HloCost, calls: float, shapes: str,
               forecaster: Forecaster | None = None):  # fmt: skip
    self.name, self.text, self.memory, self.tree, self.calls, self.shapes = name, text, memory, tree, calls, shapes
    self.forecaster = forecaster


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
    keep_compiled: keep each compiled program and its arguments' shapes in `compiled` ({part: (jax.stages.Compiled,
      lowered.args_info)}), to run it (`benchmarks/device_step.py` times the very programs it costs).

  Raises:
    ConfigError: a bad field, mesh or lengths spec, naming it.
  """

  def __init__(self, c, sl: Slice, mesh_spec: str, *, lengths: str, prompt_len: int | None = None, seed: int = 0,
               parts=PARTS, dump_hlo: str | None = None, hlo_from: str | None = None,
               log=lambda s: None, sampler_only: bool = False, keep_compiled: bool = False):  # fmt: skip

    run_config.validate_shapes_config(c)
    self.parts = tuple(parts)
    if not self.parts or set(self.parts) - set(PARTS):
      raise ConfigError(f"--parts={','.join(self.parts)}: choose from {','.join(PARTS)}")
    self.c, self.sl, self.log, self.dump_hlo, self.hlo_from = c, sl, log, dump_hlo, hlo_from
    self.compiled: dict[str, tuple] | None = {} if keep_compiled else None
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
    self.eval_requests, self.eval_calls = eval_calls(c)
    n_eval = self.eval_requests * self.eval_calls if "eval" in self.parts else 0
    self.eval_lengths = draw_lengths(lengths, n_eval, r, seed + 1)[0] if n_eval else None
    self.lengths_spec, self.seed = lengths, seed
    chip = sl.chip
    self.rates = Rates(chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.ici_bytes_per_s)
    self.k = constants_for(chip.platform) if chip.hbm_bytes_per_s else None  # forecast constants (None: no figures)
    self.buckets = live_length_buckets(self.shapes.prompt_len + r)
    self.packed = learner_packing(c, self.shapes, self.lengths, self.prompt_len)  # None: unpacked rows

  # ------------------------------------------------------------------------------------------ compile
  def _forecaster(self, tree: HloCost, mesh) -> Forecaster | None:
    if self.k is None:
      return None
    return Forecaster(tree, self.sl.chip, Links.of(self.sl, list(mesh.devices.flat)), self.k)

  def _compile(self, name: str, lower, resolvers=(None, None), calls: float = 1.0, shapes: str = "", mesh=None):
    """Compiles (or reads `hlo_from`'s dump of) program `name` and costs it; a `_Part`, or the memory row of a
    program that does not fit. `mesh`: the one it runs on (default the learner's), whose device order its
    partition ids follow."""
    mesh = mesh if mesh is not None else self.mesh
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
        lowered = lower()
        compiled = lowered.compile()
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
      if self.compiled is not None:
        self.compiled[name] = (compiled, lowered.args_info)
      text = compiled.as_text()
      self.log(f"{name}: compiled in {memory['compile_seconds']} s")
    if self.dump_hlo:
      os.makedirs(self.dump_hlo, exist_ok=True)
      with open(os.path.join(self.dump_hlo, f"{name}.hlo.txt"), "w") as f:
        f.write(text)
      with open(os.path.join(self.dump_hlo, f"{name}.memory.json"), "w") as f:
        json.dump(memory, f)
    tree = HloCost(text, self.sl.num_chips, dict(mesh.shape), self.rates, *resolvers)
    return _Part(name, text, memory, tree, calls, shapes, self._forecaster(tree, mesh))

  def _sampler_part(self, lengths, name: str, calls: float, num_requests: int, sampling=None):
    """The sampler's program for calls of `num_requests` requests, costed on `lengths` (one call, or consecutive
    calls of `num_requests` each: their mean schedule, `calls` runs a step), with `sampling` (default the
    training's `SamplingParams`); returns (part, schedule, decode rows)."""
    s = self.progs.trainer_sampler
    p, mesh = self.shapes.prompt_len, s.mesh if s.mesh is not None else self.mesh
    chunks = [lengths[i : i + num_requests] for i in range(0, len(lengths), num_requests)]
    # the caches hold the prompt bucket; the simulation sees the rows' real prompt in it (left padded)
    if s.engine.name != "static":
      rows, refill = s.engine.rows_and_refill(num_requests)
      if s.engine.name == "paged":  # the pool's own admission, and the pages its ragged attention reads
        scheds = [sampler_paged_schedule(s, x, num_requests, self.prompt_len, p, self.shapes.response_len,
                                         self._group(name)) for x in chunks]  # fmt: skip
      elif name == "sampling" and inflight_mode(self.c):  # the streaming pool's steady state (docs/inflight.md)
        scheds = [self._streaming_schedule(lengths, num_requests, rows, refill, p)]
      else:
        scheds = [continuous_schedule(x, rows, refill, p, self.buckets) for x in chunks]
      sched = mean_schedule(scheds)
      reuse = getattr(self, "_sampling", None)
      key = (rows, refill, sampling or self.progs.sampling)
      resolvers = _sampler_resolvers(sched, continuous=True)
      if reuse is not None and reuse[0] == key:
        # the same decode step and refill: cost the training call's program on this schedule (the request
        # arrays' size does not change an iteration's work)
        text, memory = reuse[1], reuse[2]
        tree = HloCost(text, self.sl.num_chips, dict(mesh.shape), self.rates, *resolvers)
        shapes = f"{num_requests} requests on {rows} decode rows, refills of {refill} (the sampling program)"
        return _Part(name, None, memory, tree, calls, shapes, self._forecaster(tree, mesh)), sched, rows
      part = self._compile(
          name,
          lambda: self.progs.lower_continuous(num_requests, sampling=sampling, unit=getattr(scheds[0], "unit", 1)),
          resolvers,
          calls,
          f"{num_requests} requests on {rows} decode rows, refills of {refill}",
          mesh=mesh,
      )
      if isinstance(part, _Part):
        self._sampling = (key, part.text, part.memory)
      return part, sched, rows
    sched = mean_schedule([static_schedule(x, p, self.buckets) for x in chunks])
    shapes = run_shapes(self.c, sampler_rows=_static_rows(num_requests))
    progs = RunPrograms(self.c, self.cfg, self.mesh, shapes, hbm_bytes=self.sl.chip.hbm_bytes)
    if sampling is not None:
      progs.sampling = sampling
    smesh = progs.sampler.mesh if progs.sampler.mesh is not None else self.mesh
    pre = self._compile(f"{name}.prefill", progs._lower_prefill, calls=calls, mesh=smesh)
    dec = self._compile(f"{name}.decode", progs._lower_decode, _sampler_resolvers(sched, continuous=False), calls,
                        mesh=smesh)  # fmt: skip
    return (pre, dec), sched, progs.shapes.sampler_rows

  def _streaming_schedule(self, lengths, n: int, rows: int, refill: int, p: int) -> Schedule:
    """The in-flight mode's sampler iterations per global step (`config.staleness.mode="inflight"`): the streaming
    pool replayed (`stream_schedule.streaming_schedule`) over `lengths` then `STREAM_STEPS` - 1 more draws of n
    (seeds seed + 1000 + i), its mean over the steps after the pool fills (delay + 1)."""
    c = self.c
    draws = [lengths[:n]] + [
        draw_lengths(self.lengths_spec, n, self.shapes.response_len, self.seed + 1000 + i)[0]
        for i in range(STREAM_STEPS - 1)
    ]
    steps = streaming_schedule(draws, rows, refill, c.staleness.inflight_every, c.delay, p, self.buckets)
    skip = min(c.delay + 1, STREAM_STEPS - 1)
    # the live rows' drawn tokens at the steady steps' swaps, and how many steps they span (the recompute's row)
    self._swap_lengths = (np.asarray([x for s in steps[skip:] for x in s.live_lengths_at_swap]), len(steps) - skip)
    return steady_schedule(steps, skip, self.buckets)

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
    sampler_weight_bytes = param_bytes(prepared)
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
      moved = shard_bytes(self.progs.params) + sampler_weight_bytes / chips
      t_bound = moved / self.sl.chip.hbm_bytes_per_s if has_rates else None
      rows.append(self._row("transfer", part, 1, t_bound))

    # learner
    mm = dict(matmul_params=_matmul_params(self.cfg), attn_flops_per_ctx=_attn_per_ctx(self.cfg))
    fwd = learning_flops(self.lengths, self.prompt_len, **mm)
    peak_total = chips * self.sl.chip.peak_bf16_flops or float("nan")
    mb, pk = sh.micro_batch, self.packed or {}
    if "score" in self.parts:
      what = pk["score"].describe() if pk else f"{sh.rollouts}x{sh.seq_len}, micro-batch {mb}"
      every = score_every(c)  # the trainer scores only on some steps (`Trainer.scoring`)
      proximal = int(run_config.loss_config(c).reads_proximal_logp)  # decoupled PPO scores its released batch too
      part = self._compile("score", self.progs._lower_score, calls=1.0 / every + proximal, shapes=what)
      micro = -(-sh.rollouts // mb) if not pk else round(pk["score"].active_per_run)
      name = "score" if every == 1 else f"score (1/{every})"
      rows.append(
          self._row(name, part, micro, fwd / peak_total * (1.0 / every + proximal) if has_rates else None, "score")
      )
      if getattr(self, "_swap_lengths", None) is not None and c.staleness.inflight_kv == "recompute":
        rows.append(self._recompute_row(rows[-1], part.calls, fwd, mm))
    if "update" in self.parts:
      what = pk["update"].describe() if pk else f"{sh.mini_batch}x{sh.seq_len}"
      calls = c.num_updates_per_step * run_config.num_epochs(c)  # every pass over the batch
      part = self._compile("update", self.progs._lower_update, calls=calls, shapes=what)
      micro = -(-sh.mini_batch // mb) if not pk else pk["update"].active_per_run
      rows.append(self._row("update", part, micro, 3 * fwd / peak_total if has_rates else None, "update"))

    # evaluation, amortised: its own calls, rows and sampling settings (`Trainer.evaluate`)
    if self.eval_lengths is not None:
      every = c.eval.every or max(c.total_steps, 1)
      calls = self.eval_calls / every
      part, sched, srows = self._sampler_part(self.eval_lengths, "eval", calls, self.eval_requests, eval_sampling(c))
      bound = sampling_bound(self.eval_lengths, self.prompt_len, **bound_kw)
      name = f"eval (1/{every}: {self.eval_calls} calls of {self.eval_requests})"
      rows += self._sampling_rows(name, part, sched, srows, bound, calls, bound_share=1.0 / every)
    if "sampling" in self.parts and self.k is not None:
      rows.append(self._host_row())
    rows.append(step_row(rows, has_rates))
    common = self._common()
    return [{**common, **r} for r in rows]

  def _recompute_row(self, score: dict, score_calls: float, score_flops: float, mm: dict) -> dict[str, Any]:
    """The in-flight swap's recompute (`inflight_kv="recompute"`), a step's share: one forward over each live row's
    prompt and drawn tokens (`_swap_lengths`, the replay's steady steps), costed as the score pass's forward (the same
    model, the learner's layout) scaled by their forward FLOPs (`learning_flops`): an estimate from a compiled
    program, not a program of its own. `score`: the score row; `score_calls`, `score_flops`: its runs a step and one
    run's forward FLOPs."""
    drawn, steps = self._swap_lengths
    flops = learning_flops(drawn, self.prompt_len, **mm) / max(steps, 1)
    scale = flops / score_flops / score_calls  # one run of the score program, times the recompute's share of it
    peak_total = self.sl.num_chips * self.sl.chip.peak_bf16_flops
    row = {
        "part": "recompute (in flight)",
        "iterations": None,
        "detail": {
            "live_rows_at_swap": drawn.size / max(steps, 1),
            "mean_drawn_tokens": float(drawn.mean()) if drawn.size else 0.0,
            "forward_flops": flops,
            "scaled_from": score["part"],
        },
        "bound_seconds": flops / peak_total if peak_total else None,
    }
    for k in ("seconds_overlapped", "seconds_serial"):
      row[k] = score[k] * scale if score.get(k) is not None else None
    f = score.get("forecast")
    if f is not None:
      levels = ("low", "central", "high")
      sec = np.array([f["seconds"][lvl] for lvl in levels]) * scale
      terms = {t: np.array([v[lvl] for lvl in levels]) * scale for t, v in f["terms"].items()}
      row["forecast"] = record(sec, terms, f["ops"] * scale, f["collectives"] * scale, None)
    return row

  def _host_row(self) -> dict[str, Any]:
    """Host time per step (forecast only): each of the slice's processes (one a host) detokenises and grades its
    share of the step's responses, and of the evaluation's amortised, in its main thread, from measured costs
    (`efficiency.HOST_COST`) at the draw's mean lengths."""
    c, hosts = self.c, self.sl.num_hosts
    train, mode = host_seconds_per_response(c.reward.mode, float(self.lengths.mean()))
    seconds = math.ceil(self.shapes.rollouts / hosts) * train
    detail = {"train_mode": mode, "seconds_per_response": train, "responses_per_process": self.shapes.rollouts / hosts}
    if self.eval_lengths is not None:
      every = c.eval.every or max(c.total_steps, 1)
      per, emode = host_seconds_per_response(c.eval.reward_mode or c.reward.mode, float(self.eval_lengths.mean()))
      seconds += math.ceil(self.eval_lengths.size / hosts) * per / every
      detail.update(eval_mode=emode, eval_seconds_per_response=per)
    f = seconds * self.k.host_scale.values()
    return {"part": "host (detokenise, grade)", "host": True, "iterations": None, "detail": detail,
            "forecast": record(f, {"host": f}, 0, 0, None)}  # fmt: skip

  def _common(self) -> dict[str, Any]:
    s = self.progs.trainer_sampler
    return {
        "fingerprint": fingerprint(self.c),
        "model": self.model_from,
        "slice": self.sl.name,
        "chips": self.sl.num_chips,
        "mesh": self.mesh_name,
        "sampler_layout": layout_name(s.mesh, s.rules)
        if s.mesh is not self.mesh
        else f"{self.mesh_name} (learner rules)",
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
    forecast = None
    if part.forecaster is not None:
      f = part.forecaster.program()
      sec = f["seconds"] * calls
      terms = {k: v * calls for k, v in f["terms"].items()}
      if extra:  # the attention kernels' FLOPs at the attention efficiency
        sec = forecast_extra(sec, terms, "opaque_flops", extra / self.k.attention.values())
      forecast = record(sec, terms, f["ops"] * calls, f["collectives"] * calls, per_call * calls)
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
        "forecast": forecast,
        **({"packed": packed.as_dict()} if packed is not None else {}),
    }

  def _sampling_rows(self, name: str, part, sched: Schedule, srows: int, bound: dict, calls: float,
                     bound_share: float | None = None) -> list[dict]:  # fmt: skip
    """The rows of a sampler part run `calls` times a step on `sched` (one call's schedule); `bound` is the bound
    of all its work at once, a step's share `bound_share` (default `calls`). Iterations are a step's."""
    base = {"schedule": {**sched.__dict__, "rows": srows}, "bound_terms": bound}
    bound_total = None if bound is None else bound["total"] * (calls if bound_share is None else bound_share)
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
      total["forecast"] = sum_forecasts([pre_row, dec_row], sched.iterations * calls)
      return [pre_row, dec_row, total]
    if not isinstance(part, _Part):
      return [{"part": name, "fits": False, "memory": part, "bound_seconds": bound_total, **base}]
    row = self._row(name, part, sched.iterations, bound_total)
    row.update(base)
    kv, kv_f = None, None
    if isinstance(sched, PagedSchedule):  # the ragged attention's KV reads: analytic, added to the HLO's cost
      s = self.progs.trainer_sampler
      page = page_bytes_per_device(s.config, sched.page_size, s.mesh, s.rules)
      kv = analytic_kv(sched, page, self.sl.chip.hbm_bytes_per_s)
      add_analytic_kv(row, kv, calls, sched.iterations)
      if row["forecast"] is not None:  # at the paged kernel's efficiency
        kv_f = kv["bytes_per_device"] / (self.sl.chip.hbm_bytes_per_s * self.k.paged_attention.values())
        add_forecast(row, "kv_reads", kv_f * calls, sched.iterations * calls)
    fc = part.forecaster
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
                "iterations": count * calls if calls >= 1 else count,
                "seconds_per_iteration": br.seconds_per_run(True),
                "seconds_per_iteration_serial": br.seconds_per_run(False),
                "limiter": t["limiter"],
                "seconds_overlapped": br.seconds_per_run(True) * count * calls,
                "seconds_serial": br.seconds_per_run(False) * count * calls,
                "per_iteration": per.as_dict(),
            }
        )
        if fc is not None:
          f = fc.node(br)
          n = count * calls
          subs[-1]["forecast"] = record(f["seconds"] * n, {k: v * n for k, v in f["terms"].items()}, f["ops"] * n,
                                        f["collectives"] * n, n)  # fmt: skip
        if is_decode and kv is not None:
          add_analytic_kv(subs[-1], kv, calls, sched.decode_steps)
          if kv_f is not None:
            add_forecast(subs[-1], "kv_reads", kv_f * calls, sched.decode_steps * calls)
      if loop.own_overlapped > 0:  # what every iteration does outside both branches (e.g. copies of the carry)
        t = self.rates.times(loop.own)
        subs.append(
            {
                "part": f"{name}: every iteration, outside the branches",
                "sub": True,
                "iterations": sched.iterations * calls if calls >= 1 else sched.iterations,
                "seconds_per_iteration": loop.own_overlapped,
                "seconds_per_iteration_serial": loop.own_serial,
                "limiter": t["limiter"],
                "seconds_overlapped": loop.own_overlapped * loop.trips * calls,
                "seconds_serial": loop.own_serial * loop.trips * calls,
                "per_iteration": loop.own.as_dict(),
            }
        )
        if fc is not None:  # the loop's iteration less its branches
          own = fc.node(loop)["seconds"] - sum(br.trips * fc.node(br)["seconds"] for br in loop.children)
          n = loop.trips * calls
          subs[-1]["forecast"] = record(own * n, {"other_ops": own * n}, 0, 0, n)
    return [*subs, row]


def _static_rows(n: int) -> int:
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
