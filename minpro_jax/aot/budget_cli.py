"""The `--budget` command line and its table: one global step's roofline, bound and forecast, per part.

  python -m minpro_jax.aot --budget --config=<file[:arg]> --topology=v5p-64 [--mesh=fsdp=-1]
      [--lengths=gamma:mean=8192 | const:N | FILE] [--prompt-len=256] [--seed=0] [--parts=sampling,...]
      [--config.<field>=<value> ...] [--out=reports/NAME.json] [--dump-hlo=DIR] [--hlo-from=DIR]

`minpro_jax.aot.budget` says what each part is and how it is costed; docs/aot.md says what is a bound, what is a
forecast and what neither covers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from minpro_jax.aot.budget import PARTS, Budget
from minpro_jax.aot.efficiency import constants_for
from minpro_jax.aot.environment import prepare_environment, run_config_of
from minpro_jax.aot.split_step import split_step
from minpro_jax.aot.sweep import machine_info
from minpro_jax.aot.topologies import GIB, parse_slice
from minpro_jax.errors import UserError


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


def _band(f: dict | None, key: str = "seconds") -> str:
  v = (f or {}).get(key)
  return "" if not v else " / ".join(_t(v[k]) for k in ("low", "central", "high"))


def render(rows: list[dict[str, Any]]) -> str:
  """The budget rows as a Markdown table: part, iterations, time per iteration (roofline / central forecast) and
  what limits the roofline, the roofline (communication overlapped and serial), the bound for the same work, the
  forecast band (low / central / high), and roofline and central forecast over the bound."""
  lines = [
      "| part | iterations | per iteration: roofline / forecast | limiter | roofline | roofline, serial ICI | bound "
      "| forecast: low / central / high | roofline / bound | forecast / bound |",
      "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if r.get("fits") is False:
      mem = r.get("memory", {})
      size = mem.get("total_bytes") or mem.get("temp_bytes")
      what = f"does not fit ({size / GIB:.1f} GiB)" if size else "does not fit"
      lines.append(f"| {r['part']} | | | {what} | | | {_t(r.get('bound_seconds'))} | | | |")
      continue
    it = r.get("iterations")
    ratio, f = r.get("ratio"), r.get("forecast") or {}
    per_f = (f.get("seconds_per_iteration") or {}).get("central")
    per = f"{_t(r.get('seconds_per_iteration'))} / {_t(per_f)}" if per_f else _t(r.get("seconds_per_iteration"))
    bound = r.get("bound_seconds") if not r.get("sub") else None
    central = (f.get("seconds") or {}).get("central")
    f_ratio = f"{central / bound:.1f}x" if central and bound else ""
    lines.append(
        f"| {r['part']} | {'' if it is None else f'{it:,.0f}'} | {per} | {r.get('limiter', '')} | "
        f"{_t(r.get('seconds_overlapped'))} | {_t(r.get('seconds_serial'))} | {_t(bound)} | {_band(f)} | "
        f"{'' if ratio is None else f'{ratio:.1f}x'} | {f_ratio} |"
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
  argv = list(sys.argv[1:] if argv is None else argv)
  config_args = [a for a in argv if a.startswith("--config")]
  args = _parser().parse_args([a for a in argv if not a.startswith("--config")])
  prepare_environment(args.topology)

  try:
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
    rows = split_step(config, sl, mesh, **kw) if config.sampling.devices else Budget(config, sl, mesh, **kw).run()
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  r0 = rows[0]
  print(
      f"# {name} on {sl.name} ({sl.num_chips} chips), mesh {r0['mesh']}; lengths {r0['lengths_from']} "
      f"(mean {r0['lengths_mean']:.0f}); prompts {r0['prompt_len']} tokens"
  )
  print("# roofline and bound: from compiled programs at peak rates; forecast: the same programs at published")
  print("# efficiencies and latencies (docs/aot.md); none of them a measurement on the accelerator")
  print(render(rows))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)

    k = constants_for(sl.chip.platform)
    report = {"tool": "python -m minpro_jax.aot --budget", "config": name, "machine": machine_info(),
              "forecast_constants": k.as_dict() if k else None, "rows": rows}  # fmt: skip
    with open(args.out + ".tmp", "w") as f:
      json.dump(report, f, indent=1, default=float)
    os.replace(args.out + ".tmp", args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
