"""Command line: compile a run config's programs for a TPU slice (or cpu:N) and report memory, FLOPs, collectives.

  python -m minpro_jax.aot --config=<file[:arg]> --topology=v5p-64 --mesh=fsdp=-1 [--mesh=data=2,fsdp=-1 ...]
      [--remat=block ...] [--config.<field>=<value> ...] [--programs=update,score,prefill,decode]
      [--sampler-rows=N] [--out=reports/NAME.json] [--dump-hlo=DIR] [--fresh] [--debug]

Nothing runs on an accelerator: programs are lowered on abstract values and compiled for the slice's devices.
TPU slices need libtpu: `make setup` unpacks it to .venv/libtpu, which this command finds by itself (or pip install
"jax[tpu]"). `cpu:N` compiles for N virtual CPU devices (no libtpu; memory is reported, nothing "fits").
Prints a Markdown table; `--out` also writes JSON, one record per row, and a run with an existing `--out` keeps
the rows it already has for the same config (a long sweep resumes; `--fresh` starts over). Exit status: 0, or 2
with one `error: ...` line for a mistake in the command (a field, a mesh, a topology), or 1 when a program
failed to compile for another reason than memory (its row says why); `--debug` shows a mistake's traceback. A row
whose learner micro-batch does not split over the mesh's batch axes carries a "warning" saying so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from minpro_jax.aot.environment import exit_on_signal, prepare_environment, run_config_of
from minpro_jax.errors import UserError


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m minpro_jax.aot", description=__doc__.split("\n")[0])
  p.add_argument(
      "--config",
      metavar="FILE[:ARG]",
      help="the run config (default: configs/default.py); --config.<field>=<value> overrides a field as for train",
  )
  p.add_argument(
      "--budget",
      action="store_true",
      help="cost one global step instead (roofline, bound, forecast); its own flags: --budget --help (docs/aot.md)",
  )
  p.add_argument("--topology", required=True, help="v4-8.., v5e-1..256, v5p-8.., v6e-1..256, or cpu:N")
  p.add_argument("--mesh", action="append", default=[], help="mesh shape, e.g. fsdp=-1 or data=2,fsdp=-1 (repeat)")
  p.add_argument(
      "--remat", action="append", default=[], help="remat policy to compile with (repeat; default: the config's)"
  )
  p.add_argument(
      "--programs",
      default="update,score,prefill,decode",
      help="comma-separated subset of update,score,prefill,decode,sample (sample: the trainer's sampler call)",
  )
  p.add_argument(
      "--rules",
      action="append",
      default=[],
      help="the learner's logical-axis rules, as config.mesh.rules takes them (repeat to sweep; default: the config's)",
  )
  p.add_argument("--sampler-rows", type=int, default=None, help="rows of prefill/decode (default: the trainer's)")
  p.add_argument("--out", default="", help="JSON report path (rows already there for this config are kept)")
  p.add_argument("--dump-hlo", default="", help="folder for each program's optimized HLO and shardings")
  p.add_argument("--fresh", action="store_true", help="ignore rows already in --out")
  p.add_argument("--debug", action="store_true", help="show the traceback of a mistake instead of one line")
  return p


def _kept_rows(out: str, fresh: bool, slice_name: str) -> list:
  """The rows of an existing `--out` report for this slice ([] without one, or with `fresh`).

  Raises:
    UserError: `out` is a directory, or an existing file that is not a JSON report of this tool (naming it and
      the fix), before anything is compiled.
  """
  if not out:
    return []
  if os.path.isdir(out):
    raise UserError(f"--out={out}: is a directory; pass a file path, e.g. --out={os.path.join(out, 'report.json')}")
  parent = _existing(os.path.dirname(os.path.abspath(out)))  # the folder the report (and its parents) go into
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
    raise UserError(f"--out={out}: cannot create it under {parent}; pass a path in a writable directory")
  if not os.path.exists(out) or fresh:
    return []
  try:
    with open(out, encoding="utf-8") as f:
      old = json.load(f)
    rows = old.get("rows", []) if old.get("slice") == slice_name else []
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
      raise TypeError("'rows' is not a list of objects")
    return rows
  except (OSError, ValueError, TypeError, AttributeError) as e:
    raise UserError(
        f"--out={out}: not a readable report of this tool ({type(e).__name__}: {e}); it was truncated or edited: "
        "pass --fresh to overwrite it, or another --out"
    ) from None


def _existing(path: str) -> str:
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def batch_split_warning(config, row) -> str | None:
  """Why the learner's micro-batch does not split over the batch axes of the row's mesh (data x fsdp x expert, the
  "batch" rule of `minpro_jax.runtime.sharding`), or None; for the update and score programs only. The trainer
  refuses such a config (`run_config.check_micro_batch_split`); a compile still reports what it would cost."""
  # JAX only after prepare_environment has set the platform (cpu:N devices, libtpu) from --topology
  from minpro_jax.run import run_config
  from minpro_jax.runtime.sharding import batch_split

  if row.get("program") not in ("update", "score"):
    return None
  shape = {k: int(v) for k, v in (p.split("=") for p in str(row.get("mesh", "")).split(",") if "=" in p)}
  axes, split = batch_split(shape, run_config.learner_rules(config))
  micro = run_config.learner_micro_batch(config)
  if micro % split == 0:
    return None
  return (
      f"the learner's micro-batch of {micro} samples (micro_batch_size) does not split over the mesh's batch axes "
      f"({' x '.join(axes)} = {split}); a run on this mesh needs a micro-batch that is a multiple of {split}"
  )


def main(argv: list[str] | None = None) -> int:
  command_line = argv is None  # signals are the process's own only then (not in a test calling main)
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--budget" in argv:  # one global step: roofline, bound and forecast (minpro_jax/aot/budget_cli.py)
    # JAX only after prepare_environment has set the platform (cpu:N devices, libtpu) from --topology
    from minpro_jax.aot.budget_cli import main as budget_main

    if command_line:
      exit_on_signal("nothing was written (--budget writes its --out at the end): rerun the command")
    return budget_main(argv)
  config_args = [a for a in argv if a.startswith("--config")]
  args = _parser().parse_args([a for a in argv if not a.startswith("--config")])
  prepare_environment(args.topology, quiet=command_line)
  if command_line:
    exit_on_signal(
        f"the rows compiled so far are in --out={args.out}: rerun the same command to resume from them"
        if args.out
        else "nothing was kept: pass --out=FILE to keep each row as it compiles, so that a rerun resumes"
    )

  try:
    # JAX only after prepare_environment has set the platform (cpu:N devices, libtpu) from --topology
    from minpro_jax.aot.sweep import machine_info, markdown, settled, sweep
    from minpro_jax.aot.topologies import parse_slice
    from minpro_jax.run import run_config

    sl = parse_slice(args.topology)
    name, config = run_config_of(config_args)
    meshes = args.mesh or [config.mesh.shape or "fsdp=-1"]
    done = _kept_rows(args.out, args.fresh, sl.name)
    kept = [r for r in done if settled(r)]  # a row that failed is replaced by its retry

    def save(row):
      warning = batch_split_warning(config, row)
      if warning:
        row["warning"] = warning
      kept.append(row)
      if args.out:
        _write(args.out, sl, kept, machine_info())
      print(f"# {row['mesh']} {row['remat']} {row['program']}: {_brief(row)}", file=sys.stderr, flush=True)

    rows = []
    for rules in args.rules or [config.mesh.rules]:  # a sharding sweep over rule sets: one config copy each
      with config.unlocked():
        one = copy.deepcopy(config)
        one.mesh.rules = rules
      run_config.learner_rules(one)  # a bad spec is named before anything compiles
      rows += sweep(
          one,
          sl,
          meshes,
          args.remat or None,
          [p.strip() for p in args.programs.split(",") if p.strip()],
          sampler_rows=args.sampler_rows,
          dump_hlo=args.dump_hlo or None,
          done=done,
          on_row=save,
          config_name=name,
      )
  except UserError as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return 2
  fps = {r["fingerprint"] for r in rows}
  shown = [r for r in kept if not fps or r.get("fingerprint") in fps]
  print(f"# {name} on {sl.name} ({sl.topology}, {sl.num_chips} chips, {sl.num_hosts} hosts); per device")
  print(markdown(shown))
  return 1 if any("error" in r and r.get("fits") is not False for r in rows) else 0


def _brief(row) -> str:
  if "error" in row:
    return row["error"]
  warning = f"; warning: {row['warning']}" if row.get("warning") else ""
  return f"total {row['total_bytes'] / 2**30:.2f} GiB, fits={row['fits']}, compile {row['compile_seconds']} s{warning}"


def _write(path: str, sl, rows, machine) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  chip = sl.chip
  report = {
      "tool": "python -m minpro_jax.aot",
      "slice": sl.name,
      "topology": sl.topology,
      "chips": sl.num_chips,
      "hosts": sl.num_hosts,
      "chip": {
          "generation": chip.generation,
          "hbm_bytes": chip.hbm_bytes,
          "peak_bf16_flops": chip.peak_bf16_flops,
          "hbm_bytes_per_s": chip.hbm_bytes_per_s,
          "source": chip.source,
      },
      "machine": machine,
      "rows": rows,
  }
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, path)


if __name__ == "__main__":
  sys.exit(main())
