"""Command line: evaluate a run's checkpoint, or a Hugging Face folder, on held-out benchmarks, on its own.

  python -m minpro_jax.evaluate --workdir=runs/NAME [--which=best|final|STEP] [--out=DIR] [--FIELD=VALUE ...]
  python -m minpro_jax.evaluate --hf=DIR --out=DIR [--FIELD=VALUE ...]

The tables are the trainer's (`minpro_jax.run.heldout`: pass@k, avg@n, maj@k per benchmark and their macro average),
sampled with the run's sampler settings on the same programs, so a checkpoint scores here as it scored in its run
(same `eval.seed`, same benchmarks: the run's held-out set and its `eval.path` files). Fields that may be set:
`eval.*` (e.g. `--eval.path=math500=math500:data/math500.jsonl,aime24=jsonl:aime24.jsonl --eval.n=16
--eval.ks=1,8,16 --eval.num_problems=500`), `data.template`, `data.max_prompt_tokens`, `sampling.max_new_tokens`,
`sampling.decode_rows`, `sampling.precision`, `sampling.kv_cache` / `page_size` / `num_pages`, `mesh.shape` (the run's
by default: the parameters and the sampling are laid out on that mesh, as in the run). `--hf=DIR` evaluates
a folder (an export, or any Qwen3 / Llama checkpoint) with the default config's settings and its own tokenizer
(`--data.template=chat` for chat models).

Output (default `workdir/eval/standalone/<which>_<step>`): `<benchmark>.json` per benchmark as it finishes, then
`eval.json` and `eval.md` over all of them. Re-running the same command skips the benchmarks already written
(resumable), provided the settings (every `eval` field, the template, the lengths, the precision, the grader) are the
same, else it refuses: use another `--out`. Ctrl-C or SIGTERM ends it at once, keeping the finished benchmarks
(exit status 128 + the signal: 130, 143).

Several processes (a TPU pod's hosts; `python -m minpro_jax.launch_local --module=minpro_jax.evaluate -- ...` on one
machine) run the same command as in training (docs/multihost.md): every process reads the checkpoint's shards onto
the global mesh of `mesh.shape`, samples every benchmark's prompts there, grades its share of the responses, and
holds the same tables; process 0 writes them and prints. The tables equal a one-process evaluation's on the same mesh.
`--out` must be a folder every process sees (checked).

A bad flag, run or file prints one line `error: ...` and exits with status 2 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import signal
import sys
from typing import Any

from minpro_jax.errors import ConfigError, UserError
from minpro_jax.runtime import abort_line

EXIT_USER_ERROR = 2
SETTABLE = ("eval.", "data.template", "data.max_prompt_tokens", "sampling.max_new_tokens", "sampling.decode_rows")
SETTABLE += ("sampling.precision", "sampling.kv_cache", "sampling.page_size", "sampling.num_pages", "mesh.shape")


def _stopped(signum: int, frame) -> None:
  """Ends the process at once with 128 + `signum` (130 for Ctrl-C): each benchmark's table is written atomically as
  it finishes, so nothing finished is lost (`os._exit`: JAX's teardown after an interrupt can crash the
  interpreter)."""
  del frame
  print(
      f"stopped by signal {signum}: the finished benchmarks are kept; re-run the same command to go on", file=sys.stderr
  )
  sys.stderr.flush()
  abort_line.exit_now(128 + signum)


def apply_overrides(c, overrides: dict[str, str]) -> None:
  """Sets `--FIELD=VALUE` strings on config `c`, converted to each field's type.

  Raises:
    ConfigError: a field that may not be set here (only `SETTABLE`), that does not exist, or a value of the wrong
      type, naming the flag.
  """
  for field, text in overrides.items():
    if not any(field == s or (s.endswith(".") and field.startswith(s)) for s in SETTABLE):
      names = ", ".join(s + "*" if s.endswith(".") else s for s in SETTABLE)
      raise ConfigError(f"--{field}: cannot be set when evaluating; settable: {names}")
    *groups, leaf = field.split(".")
    node = c
    try:
      for g in groups:
        node = node[g]
      old = node[leaf]
    except (KeyError, AttributeError):
      raise ConfigError(f"--{field}: no such config field") from None
    try:
      node[leaf] = _convert(old, text)
    except (TypeError, ValueError, SyntaxError) as e:
      kind = type(old).__name__
      raise ConfigError(f"--{field}={text!r}: not {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({e})") from None


def _convert(old: Any, text: str) -> Any:
  if isinstance(old, bool):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError("use true or false")
    return text.lower() in ("true", "1")
  if isinstance(old, int):
    return int(text)
  if isinstance(old, float):
    return float(text)
  if isinstance(old, (tuple, list)):
    return tuple(ast.literal_eval(text if text.strip().startswith("(") else f"({text},)"))
  return text


def _default_config():
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.config_lib.defaults import base_config

  return base_config()


def eval_mesh(c):
  """The device mesh of `c.mesh.shape` over every process's devices, or None ("": one device, one process).

  Raises:
    ConfigError: naming `--mesh.shape`: it does not parse or fit the devices, or it is empty in a multi-process
      evaluation (the parameters must span every process's devices).
  """
  import jax

  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.run.config_checks import parse_mesh_shape
  from minpro_jax.runtime.sharding import make_mesh

  shape = parse_mesh_shape(c.mesh.shape)
  if not shape:
    if jax.process_count() > 1:
      raise ConfigError(
          f"--mesh.shape: empty means one device, but this evaluation has {jax.process_count()} processes with "
          f"{jax.device_count()} devices in all; set e.g. --mesh.shape=fsdp=-1"
      )
    return None
  try:
    return make_mesh(shape)
  except ValueError as e:
    raise ConfigError(f"--mesh.shape={c.mesh.shape!r}: {e}") from None


def load_model(args, overrides: dict[str, str]):
  """(config, tokenizer, model, the output folder, policy step, mesh) of `--workdir`/`--which` or `--hf`."""
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.run import run_config, run_load

  if args.hf:
    # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
    from minpro_jax.errors import FileFormatError
    from minpro_jax.models.hf_io import load_hf_checkpoint
    from minpro_jax.run.run_setup import build_tokenizer

    if not args.out:
      raise ConfigError("--out: give the folder for the tables (required with --hf)")
    if args.which is not None:
      raise ConfigError("--which: chooses a checkpoint of a run (--workdir); an --hf folder holds one model")
    c = _default_config()
    c.model.source, c.model.path, c.tokenizer.kind = "hf", args.hf, "model"
    apply_overrides(c, overrides)
    _check(c, args.out)
    if not os.path.isfile(os.path.join(args.hf, "config.json")):
      raise ConfigError(f"--hf: {args.hf} has no config.json; give a Hugging Face model folder")
    mesh = eval_mesh(c)
    try:
      rules = run_config.learner_rules(c)
      model = load_hf_checkpoint(args.hf, mesh=mesh, rules=rules, **run_config.model_overrides(c))[0]
      tokenizer = build_tokenizer(c, [])
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - a folder that does not load is a bad folder: name it
      raise FileFormatError(f"--hf: {args.hf} does not load as a model ({type(e).__name__}: {e})") from e
    return c, tokenizer, model, args.out, 0, mesh
  c = run_load.load_run_config(args.workdir)
  apply_overrides(c, overrides)
  _check(c, args.out)  # before the checkpoint loads
  mesh = eval_mesh(c)
  run = run_load.load_run(args.workdir, args.which or "best", mesh=mesh)
  apply_overrides(run.config, overrides)
  out = args.out or os.path.join(args.workdir, "eval", "standalone", f"{run.which}_{run.step}")
  _check(run.config, out)
  return run.config, run.tokenizer, run.model, out, run.eval_step, mesh


def _check(c, out: str) -> None:
  """The evaluation's settings and `--out`, before any model is loaded. Raises ConfigError naming the field."""
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.run import run_config

  run_config.check_eval(c)
  for field in ("data.max_prompt_tokens", "sampling.max_new_tokens"):
    group, leaf = field.split(".")
    if int(c[group][leaf]) < 1:
      raise ConfigError(f"--{field}: must be >= 1, got {c[group][leaf]}")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"--out: {out} is a file; give a folder")


def run_evaluation(
    c, tokenizer, model, out: str, eval_step: int = 0, progress: bool = True, mesh=None
) -> dict[str, Any]:
  """Evaluates `model` on config `c`'s held-out benchmarks; writes and returns the tables (module docstring).

  `eval_step` (the global steps done, `run_load.LoadedRun.eval_step`) offsets the seed as the trainer's evaluation
  after that many global steps does (`eval.seed + eval_step`), so a run's checkpoint gets the samples, and the
  scores, its run logged. `mesh`: the mesh `model` is laid out on (`eval_mesh`), or None. Every process of a
  multi-process evaluation calls it alike and gets the tables; process 0 writes them.

  Raises:
    ConfigError: `out` holds tables of other settings, or is not one folder every process sees; a benchmark with no
      prompt that fits.
  """
  from flax import nnx
  from tqdm import tqdm

  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.data import format_prompt
  from minpro_jax.run import heldout, run_config, sampler_setup
  from minpro_jax.run.run_setup import eval_benchmarks, fit_eval_sets
  from minpro_jax.run.sampler_setup import sampler_kwargs
  from minpro_jax.runtime import multihost
  from minpro_jax.runtime.sharding import use_mesh
  from minpro_jax.sampling import Sampler, SamplingParams

  e = c.eval
  seed = e.seed + eval_step
  settings = {k: v for k, v in json.loads(e.to_json_best_effort()).items() if k != "every"}
  settings.update(seed=seed, template=c.data.template, max_prompt_tokens=c.data.max_prompt_tokens)  # the seed used
  settings.update(max_new_tokens=c.sampling.max_new_tokens, precision=c.sampling.precision, reward_mode=c.reward.mode)
  benches = fit_eval_sets(c, tokenizer, eval_benchmarks(c))
  os.makedirs(out, exist_ok=True)
  multihost.check_shared_dir(out, "--out")
  _check_settings(out, settings, write=multihost.is_primary())
  sampler = Sampler(model.config, **sampler_kwargs(c, model, tokenizer, mesh, optimizer_copies=0))
  rules = run_config.learner_rules(c)
  with use_mesh(mesh, rules):
    params = sampler.prepare_params(nnx.state(model, nnx.Param))
  run_sampling = sampler_setup.sampling_params(c, tokenizer.stop_ids)
  sp = SamplingParams(  # as `Trainer.generate_texts`
      temperature=e.temperature,
      top_p=e.top_p if e.top_p < 1.0 else None,
      max_new_tokens=run_sampling.max_new_tokens,
      stop_token_ids=run_sampling.stop_token_ids,
  )
  batch_size = max(1, 256 // e.n)  # as the trainer's evaluation
  todo = {b: ps for b, ps in benches.items() if not os.path.isfile(os.path.join(out, f"{b}.json"))}
  # every process must sample the same benchmarks (a collective each batch): they see the same finished ones
  multihost.check_same(json.dumps(sorted(todo)), f"the benchmarks left to evaluate in --out={out}")
  primary = multihost.is_primary()
  total = sum(math.ceil(len(ps) / batch_size) for ps in todo.values())
  bar = tqdm(total=total, disable=not (progress and primary), unit="batch")

  def generate(prompts, n, seed):
    ids = [tokenizer.encode(p, add_bos=c.data.template == "plain") for p in prompts]
    with use_mesh(mesh, rules):
      gen = sampler.generate(params, ids, sp, seed, group_size=n)
    texts = [tokenizer.decode(t[m].tolist()) for t, m in zip(gen.response_tokens, gen.response_mask)]
    bar.update(1)
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

  results: dict[str, Any] = {"benchmarks": {}, "macro": {}, "samples": {}, "config": settings}
  for j, (bench, problems) in enumerate(benches.items()):
    path = os.path.join(out, f"{bench}.json")
    if bench in todo:  # seed as the trainer's single call over all benchmarks gives benchmark j
      one = heldout.evaluate(
          generate,
          {bench: problems},
          n=e.n,
          ks=tuple(e.ks),
          seed=seed + 1000003 * j,
          batch_size=batch_size,
          prompt_fn=lambda p: format_prompt(p, tokenizer, c.data.template),
          modes=e.reward_mode or c.reward.mode,
      )
      one = json.loads(json.dumps(one))  # as read back from the file (str keys, lists)
      if primary:
        with open(path + ".tmp", "w") as f:
          json.dump(one, f, indent=1)
        os.replace(path + ".tmp", path)
    else:
      with open(path) as f:
        one = json.load(f)
    results["benchmarks"][bench] = one["benchmarks"][bench]
    results["samples"][bench] = one["samples"][bench]
  bar.close()
  results["macro"] = heldout.macro_average(results["benchmarks"])
  if primary:
    heldout.write_report(results, out, "eval")
  return results


def _check_settings(out: str, settings: dict[str, Any], write: bool = True) -> None:
  """Refuses `out` when it holds tables of other `settings`; else (with `write`) records them in settings.json."""
  path = os.path.join(out, "settings.json")
  if os.path.isfile(path):
    with open(path) as f:
      had = json.load(f)
    tables = [f for f in os.listdir(out) if f.endswith(".json") and f != "settings.json"]
    if had != json.loads(json.dumps(settings)) and tables:
      diff = {k: (had.get(k), v) for k, v in settings.items() if had.get(k) != json.loads(json.dumps(v))}
      raise ConfigError(
          f"--out: {out} holds tables evaluated with other settings {diff} (had, now); use another --out or delete it"
      )
    if tables:
      return
  if write:  # a new folder, or one whose earlier evaluation wrote no table yet
    with open(path + ".tmp", "w") as f:
      json.dump(settings, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a run's workdir (runs/NAME)")
  src.add_argument("--hf", help="a Hugging Face model folder (e.g. an export)")
  ap.add_argument("--which", default=None, help="with --workdir: best (default) | final | a run checkpoint's step")
  ap.add_argument("--out", default="", help="the folder for the tables (default: under the run's eval/)")
  ap.add_argument("--no-progress", action="store_true", help="no progress bar")
  ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
  args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
  if argv is None:  # the process's own signals: SIGTERM (a preemption, a scheduler) ends it as Ctrl-C does
    signal.signal(signal.SIGTERM, _stopped)
  try:
    # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
    from minpro_jax.runtime import multihost
    from minpro_jax.runtime.distributed import maybe_initialize_distributed

    maybe_initialize_distributed()  # several processes (docs/multihost.md); before any JAX computation
    multihost.check_same(json.dumps([vars(args), rest]), "the evaluate command")
    if not multihost.is_primary():  # process 0 reports; the others only their warnings and errors
      logging.getLogger("minpro_jax").setLevel(logging.WARNING)
    overrides = {}
    for item in rest:
      field, eq, value = item.removeprefix("--").partition("=")
      if not item.startswith("--") or not eq:
        raise ConfigError(f"{item}: give fields as --FIELD=VALUE (e.g. --eval.n=16)")
      overrides[field] = value
    c, tokenizer, model, out, eval_step, mesh = load_model(args, overrides)
    results = run_evaluation(c, tokenizer, model, out, eval_step, progress=not args.no_progress, mesh=mesh)
  except UserError as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  except KeyboardInterrupt:
    _stopped(signal.SIGINT, None)
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.run.heldout import to_markdown

  if not multihost.is_primary():
    return 0
  print(to_markdown(results), end="")
  print(f"tables: {os.path.join(out, 'eval.md')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
