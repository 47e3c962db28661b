"""Compile a run config's programs for every (mesh, remat) of a sweep on one slice and report each (one row per
program); `python -m minpro_jax.aot` is its command line."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import time
from typing import Any, Callable, Iterable

from minpro_jax.aot.analysis import add_resident, analyze, does_not_fit, model_flops
from minpro_jax.aot.programs import (
    DEFAULT_PROGRAMS,
    PROGRAMS,
    RunPrograms,
    check_mesh_fits_model,
    model_config,
    run_shapes,
)
from minpro_jax.aot.topologies import GIB, Slice
from minpro_jax.config_lib import defaults
from minpro_jax.errors import ConfigError
from minpro_jax.models.attention_dispatch import resolve_attention_impl
from minpro_jax.run import run_config
from minpro_jax.runtime.sharding import MESH_AXES, make_mesh

# Top-level config sections that never shape a compiled program (the run's bookkeeping); of them, only the fields of
# `_SHAPE_FIELDS` count: the prompt length, and MIPU's rollback (its snapshot of the state is counted into the
# update row's memory). `mesh` is each row's own.
_BOOKKEEPING = ("workdir", "seed", "total_steps", "delay", "log", "checkpoint", "eval", "reward", "sft", "mipu", "mesh")
_SHAPE_FIELDS = ("data.max_prompt_tokens", "mipu.rollback")


def fingerprint(c) -> str:
  """12 hex digits naming what a config compiles to; rows of an earlier sweep are reused when it is equal.

  It is the sha256 of the config fields that shape the programs, taken where they differ from
  `config_lib.defaults.base_config()`: a field added to the config later, at a default that keeps what earlier runs
  did, leaves it unchanged, and so do the run's bookkeeping fields (workdir, seed, steps, evaluation, logging,
  checkpoints, data source). A change of code is not in it: `--fresh` compiles again.
  """

  def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
      key = f"{prefix}{k}"
      out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out

  def shapes_programs(key: str) -> bool:
    top = key.split(".", 1)[0]
    return key in _SHAPE_FIELDS or (top != "data" and top not in _BOOKKEEPING)

  now = flat(json.loads(c.to_json_best_effort()))
  default = flat(json.loads(defaults.base_config().to_json_best_effort()))
  kept = {k: v for k, v in now.items() if shapes_programs(k) and (k not in default or default[k] != v)}
  return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:12]


def canonical_mesh(shape: dict[str, int]) -> str:
  return ",".join(f"{k}={v}" for k, v in shape.items())


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
  """ "data=2,fsdp=-1" on 8 devices -> {"data": 2, "fsdp": 4}.

  Raises:
    ConfigError: unknown axes, a bad size, or sizes that do not divide the slice's devices, naming `--mesh`.
  """
  try:
    shape = run_config.parse_mesh_shape(spec)
  except ValueError as e:  # a ConfigError naming config.mesh.shape, or int() refusing a size
    raise ConfigError(f"--mesh={spec}: {e}") from e
  if not shape:
    raise ConfigError(f"--mesh={spec}: write axis=size pairs over {MESH_AXES} (one size may be -1), e.g. fsdp=-1")
  try:
    return run_config.resolve_mesh_shape(shape, num_devices)
  except ValueError as e:
    raise ConfigError(f"--mesh={spec}: {e}") from e


def _sharding_str(s) -> str:
  spec = getattr(s, "spec", None)
  return str(tuple(spec)) if spec is not None else str(s)


def sharding_table(lowered, compiled) -> dict[str, list[list[str]]]:
  """{"inputs": [[path, shape, spec], ...], "outputs": [...]}: the golden-dump view of a program's layout. An input
  the program does not read (XLA prunes it; its sharding is None) has the spec "unused"."""
  import jax

  def rows(info, shardings):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(info)
    flat = treedef.flatten_up_to(shardings)  # pairs by position in the tree, None (pruned) included
    return [
        [jax.tree_util.keystr(path), f"{x.dtype}{list(x.shape)}", "unused" if s is None else _sharding_str(s)]
        for (path, x), s in zip(leaves, flat, strict=True)
    ]

  args_info = lowered.args_info[0]
  return {
      "inputs": rows(args_info, compiled.input_shardings[0]),
      "outputs": rows(lowered.out_info, compiled.output_shardings),
  }


def machine_info() -> dict[str, Any]:
  import jax

  cpu = ""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
  except OSError:
    pass
  try:
    from importlib.metadata import version

    libtpu = version("libtpu")
  except Exception:  # noqa: BLE001 - not installed as a distribution (unpacked by make setup)
    libtpu = None
  return {
      "date": datetime.date.today().isoformat(),
      "cpu": cpu or platform.processor(),
      "cores": os.cpu_count(),
      "jax": jax.__version__,
      "libtpu": libtpu,
  }


def sweep(
    c,
    sl: Slice,
    meshes: Iterable[str],
    remats: Iterable[str] | None = None,
    programs: Iterable[str] = DEFAULT_PROGRAMS,
    *,
    sampler_rows: int | None = None,
    dump_hlo: str | None = None,
    done: Iterable[dict[str, Any]] = (),
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
    config_name: str = "",
) -> list[dict[str, Any]]:
  """Compiles `programs` of config `c` for every mesh x remat on slice `sl`; returns one row per compile.

  Args:
    c: the run config (locked or not; a copy is edited per remat).
    sl: the slice (`minpro_jax.aot.topologies.parse_slice`).
    meshes: `--mesh` specs, e.g. "fsdp=-1", "data=2,fsdp=-1".
    remats: remat policies to compile with (None: the config's `model.remat`).
    programs: a subset of `PROGRAMS`.
    sampler_rows: rows of the sampler's programs (None: the trainer's).
    dump_hlo: a folder for each program's optimized HLO and its input/output shardings (JSON).
    done: rows of an earlier run of the same config and slice: these (mesh, remat, program) are not compiled again.
    on_row: called with every new row as soon as it exists (the caller saves it).

  Raises:
    ConfigError: a bad config field, mesh, remat or program, naming it. A program that does not fit the chip is a
      row with fits=False, not an error; another compile failure is a row with "error".
  """
  programs = list(programs)
  unknown = [p for p in programs if p not in PROGRAMS]
  if unknown or not programs:
    raise ConfigError(f"--programs={','.join(programs)}: choose from {','.join(PROGRAMS)}")
  run_config.validate_shapes_config(c)
  try:
    base, model_from = model_config(c)
  except ValueError as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f"config.model: {e}") from e
  shapes = run_shapes(c, sampler_rows)
  devices = sl.devices()
  fp = fingerprint(c)
  have = {
      (r["mesh"], r["remat"], r["program"])
      for r in done
      if r.get("fingerprint") == fp and r.get("sampler_rows") == shapes.sampler_rows and settled(r)
  }
  rows = []
  for spec in meshes:
    shape = parse_mesh(spec, len(devices))
    check_mesh_fits_model(shape, base)
    mesh = make_mesh(shape, devices=devices)
    for remat in remats or [base.remat]:
      try:
        cfg = base.replace(remat=remat)
      except (TypeError, ValueError) as e:
        raise ConfigError(f"--remat={remat}: {e}") from e
      todo = [p for p in programs if (canonical_mesh(shape), remat, p) not in have]
      if not todo:
        continue
      progs = RunPrograms(c, cfg, mesh, shapes)
      platform_name = "tpu" if sl.is_tpu else "cpu"
      common = {
          "config": config_name,
          "fingerprint": fp,
          "model": model_from,
          "params_b": round(cfg.num_params() / 1e9, 3),
          "slice": sl.name,
          "topology": sl.topology,
          "chips": sl.num_chips,
          "hosts": sl.num_hosts,
          "mesh": canonical_mesh(shape),
          "rules": c.mesh.rules or "default",
          "remat": remat,
          "sampler_rows": shapes.sampler_rows,
          "attention_impl": resolve_attention_impl(cfg, shapes.seq_len, platform=platform_name),
      }
      for prog in progs.programs(todo):
        row = {**common, "program": prog.name, "shapes": prog.shapes}
        row.update(_compile_one(prog, progs, sl, shapes, remat, dump_hlo, common["mesh"]))
        if prog.name == "update" and c.mipu.rollback and "alias_bytes" in row:
          # MIPU keeps a copy of the state (parameters and AdamW moments: the update's donated, aliased buffers)
          # from before the step's updates until its Step-2 test decides
          add_resident(row, "mipu_snapshot_bytes", row["alias_bytes"], sl.chip.hbm_bytes)
        rows.append(row)
        on_row(row)
  return rows


def settled(row) -> bool:
  """A row that need not be compiled again: it compiled, or it does not fit (a failure for another reason is
  retried, since it may be fixed by then)."""
  return "error" not in row or row.get("fits") is False


def _compile_one(prog, progs: RunPrograms, sl: Slice, shapes, remat: str, dump_hlo, mesh_name: str) -> dict:
  rows = {"update": shapes.mini_batch, "score": shapes.rollouts, "sample": shapes.rollouts}.get(
      prog.name, shapes.sampler_rows
  )
  flops = model_flops(
      progs.cfg,
      prog.name,
      rows=rows,
      prompt_len=shapes.prompt_len,
      response_len=shapes.response_len,
      remat=remat,
  )
  t0 = time.time()
  try:
    lowered = prog.lower()
    t1 = time.time()
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 - a program that does not fit is a finding, not a crash
    row = does_not_fit(e)
    if row is None:
      row = {"fits": None, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"}
    return {**row, "compile_seconds": round(time.time() - t0, 1)}
  t2 = time.time()
  progs.remember(prog.name, lowered, compiled)
  out = analyze(
      compiled,
      hbm_bytes=sl.chip.hbm_bytes,
      peak_flops=sl.chip.peak_bf16_flops,
      hbm_bandwidth=sl.chip.hbm_bytes_per_s,
      flops_total=flops,
      devices=sl.num_chips,
  )
  out.update(lower_seconds=round(t1 - t0, 1), compile_seconds=round(t2 - t1, 1))
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    stem = os.path.join(dump_hlo, f"{mesh_name.replace('=', '').replace(',', '_')}_{remat}_{prog.name}")
    with open(stem + ".hlo.txt", "w") as f:
      f.write(compiled.as_text())
    with open(stem + ".shardings.json", "w") as f:
      json.dump(sharding_table(lowered, compiled), f, indent=1)
  return out


_COLUMNS = (
    ("mesh", lambda r: r["mesh"] + (f" [{r['rules']}]" if r.get("rules", "default") != "default" else "")),
    ("remat", "remat"),
    ("program", "program"),
    ("shapes", "shapes"),
    ("args GiB", lambda r: _gib(r.get("argument_bytes"))),
    ("temp GiB", lambda r: _gib(r.get("temp_bytes"))),
    ("total GiB", lambda r: _gib(r.get("total_bytes"))),
    ("HBM", lambda r: "" if r.get("hbm_fraction") is None else f"{100 * r['hbm_fraction']:.0f}%"),
    ("fits", lambda r: _fits(r)),
    ("TFLOP/dev", lambda r: "" if r.get("flops") is None else f"{r['flops'] / 1e12:.3g}"),
    ("roofline s", lambda r: _roofline(r)),
    ("all-gather", lambda r: _coll(r, "all-gather")),
    ("reduce-scatter", lambda r: _coll(r, "reduce-scatter")),
    ("all-reduce", lambda r: _coll(r, "all-reduce")),
    ("all-to-all", lambda r: _coll(r, "all-to-all")),
    ("permute", lambda r: _coll(r, "collective-permute")),
    ("compile s", lambda r: r.get("compile_seconds", "")),
)


def _fits(r) -> str:
  if r.get("fits") is False:
    return "does not fit"
  if "error" in r:
    return "error"
  return "fits" if r.get("fits") else "?"


def _roofline(r) -> str:
  t = r.get("roofline_seconds")
  return "" if t is None else f"{t:.3g} ({r['roofline_bound'][0]})"


def _gib(b) -> str:
  return "" if b is None else f"{b / GIB:.2f}"


def _coll(r, op) -> str:
  c = r.get("collectives", {}).get(op)
  if not c or not c["count"]:
    return "" if c is None else "0"
  return f"{c['count']} / {c['bytes'] / 2**20:.3g} MiB"


def markdown(rows: list[dict[str, Any]]) -> str:
  """The rows as a Markdown table (collectives: static count / result MiB)."""
  head = "| " + " | ".join(name for name, _ in _COLUMNS) + " |"
  sep = "|" + "|".join("---" for _ in _COLUMNS) + "|"
  lines = [head, sep]
  for r in rows:
    cells = [str(f(r) if callable(f) else r.get(f, "")) for _, f in _COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
