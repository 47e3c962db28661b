"""Command line: a run's checkpoint as a Hugging Face folder that `transformers` and vLLM load.

  python -m minpro_jax.export --workdir=runs/NAME [--which=best|final|STEP] --out=DIR [--overwrite]

writes to DIR: the weights (`model.safetensors`, split above 5 GB with an index), `config.json` (with the tokenizer's
bos/eos/pad ids), `generation_config.json` (the run's sampling temperature, top-k/top-p and stop ids) and the
tokenizer (`tokenizer.json` + `tokenizer_config.json`, loadable by `AutoTokenizer`; an `hf`-source run's own
tokenizer files are copied as they are). The export is checked before it is reported: the tokenizer `transformers`
loads from DIR must encode a sample of texts to the run's own ids, else nothing is reported as written and the
command fails naming the text.

Every model source (scratch, `hf`, `gguf`) and layout (scanned or not, dense or MoE) goes through
`minpro_jax.models.hf_io.save_hf_checkpoint`, the inverse of the loader the runs use, so `--config.model.source=hf
--config.model.path=DIR` starts a new run from the export. The parameters are restored on one device (host memory
of about the parameters' size; the optimizer state is not read). docs/checkpoints.md describes the workdir's files.

A bad flag, a missing run or checkpoint prints one line `error: ...` and exits with status 2 (`--debug` shows the
traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from minpro_jax.errors import ConfigError, UserError

EXIT_USER_ERROR = 2
MARKER = "minpro_export.json"  # what marks a folder as an export (so that only an export is ever overwritten)
# texts the exported tokenizer must encode to the run's own ids: digits, spacing, newlines, LaTeX, non-ASCII
CHECK_TEXTS = (
    "Compute 12 + 7 - 3.\nAnswer: \\boxed{16}",
    "  two  spaces,\ttab\n\nand blank lines",
    "Let $x^2 = \\frac{3}{4}$; then x = ±√3/2 (ü, 😀).",
)


def generation_config(c, tokenizer) -> dict:
  """`generation_config.json` of run config `c`: its sampling settings and the tokenizer's stop ids."""
  s = c.sampling
  out = {"do_sample": float(s.temperature) > 0, "temperature": float(s.temperature)}
  if int(s.get("top_k", 0) or 0) > 0:
    out["top_k"] = int(s.top_k)
  if float(s.get("top_p", 1.0) or 1.0) < 1.0:
    out["top_p"] = float(s.top_p)
  out["max_new_tokens"] = int(s.max_new_tokens)
  if tokenizer.bos_id >= 0:
    out["bos_token_id"] = tokenizer.bos_id
  if tokenizer.stop_ids:
    out["eos_token_id"] = list(tokenizer.stop_ids)
  if tokenizer.pad_id >= 0:
    out["pad_token_id"] = tokenizer.pad_id
  return out


def special_ids(tokenizer) -> dict:
  """The bos/eos/pad ids `config.json` carries (those the tokenizer has)."""
  ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
  return {k: v for k, v in ids.items() if v >= 0}


def save_tokenizer(c, tokenizer, out: str) -> None:
  """Writes the run's tokenizer into `out` in a form `transformers.AutoTokenizer` loads."""
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.data.tokenizers import HFTokenizer
  from minpro_jax.run.run_load import copy_tokenizer_source

  if copy_tokenizer_source(c, out):
    return
  if isinstance(tokenizer, HFTokenizer):
    tokenizer.save(out)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
      cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump(cfg, f, indent=1)
    return
  # sentencepiece: transformers converts the .model (its normalizer spec kept) into a fast tokenizer; saving that
  # writes tokenizer.json, so loading the export needs neither sentencepiece nor a conversion
  AutoTokenizer = _auto_tokenizer()

  sp = tokenizer.sp
  names = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id(), "unk_token": sp.unk_id()}
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False}
  cfg.update({k: sp.id_to_piece(i) for k, i in names.items() if i >= 0})
  with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
      f.write(sp.serialized_model_proto())
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
      json.dump(cfg, f)
    AutoTokenizer.from_pretrained(tmp).save_pretrained(out)


def _auto_tokenizer():
  """`transformers.AutoTokenizer`; a ConfigError saying how to install it when it is missing."""
  try:
    from transformers import AutoTokenizer
  except ImportError as e:
    raise ConfigError(
        f"export needs transformers ({e}): pip install 'minpro_jax[export]' (or transformers>=5.23)"
    ) from e
  return AutoTokenizer


def check_tokenizer(tokenizer, out: str, texts=CHECK_TEXTS) -> None:
  """Raises ValueError when the tokenizer `transformers` loads from `out` encodes one of `texts` differently."""
  hf = _auto_tokenizer().from_pretrained(out)
  for text in texts:
    want, got = tokenizer.encode(text), hf.encode(text, add_special_tokens=False)
    if want != got:
      raise ValueError(
          f"the exported tokenizer in {out} encodes {text!r} as {got[:12]}..., the run's as {want[:12]}...; the "
          "tokenizer cannot be exported faithfully (report it with the run's tokenizer config)"
      )


def check_out(out: str, workdir: str) -> None:
  """Raises ConfigError unless `out` is new and can be created, an empty folder, or an earlier export (it holds
  `MARKER`)."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"--out: {out} is a file; give a folder (new or empty)")
  parent = os.path.abspath(out)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    what = "is a file" if not os.path.isdir(parent) else "is not writable"
    raise ConfigError(f"--out: {out} cannot be created ({parent} {what}); give a folder in a writable place")
  if os.path.abspath(out) == os.path.abspath(workdir):
    raise ConfigError(f"--out: {out} is the run's workdir; give another folder (e.g. {os.path.join(out, 'hf')})")
  if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, MARKER)):
    raise ConfigError(f"--out: {out} is a non-empty folder that holds no export; give a new or empty folder")


def check_replaces(out: str, workdir: str, which: str, step: int, overwrite: bool) -> None:
  """Raises ConfigError when `out` holds an export of another checkpoint (another run, `which` or step) and not
  `overwrite`: e.g. `--which=final` into the folder of the best export would replace it."""
  marker = os.path.join(out, MARKER)
  if overwrite or not os.path.isfile(marker):
    return
  try:
    with open(marker) as f:
      old = json.load(f)
    same = (old["workdir"], old["which"], int(old["step"])) == (os.path.abspath(workdir), which, int(step))
  except (OSError, ValueError, KeyError, TypeError):
    old, same = {}, False
  if not same:
    held = f"the {old.get('which')} checkpoint (step {old.get('step')}) of {old.get('workdir')}" if old else "an export"
    raise ConfigError(
        f"--out: {out} holds {held}; this is the {which} checkpoint (step {step}) of {os.path.abspath(workdir)}: "
        "give another --out (e.g. runs/NAME/hf_final), or --overwrite to replace it"
    )


def export(workdir: str, out: str, which: str = "best", overwrite: bool = False) -> dict:
  """Exports checkpoint `which` of the run in `workdir` to the Hugging Face folder `out`; returns what it wrote.

  Raises:
    ConfigError / CheckpointError: as `run_load.load_run`; `out` is a file, the workdir, a folder that cannot be
      created, a non-empty folder holding no export (`check_out`), or one holding an export of another checkpoint
      without `overwrite` (`check_replaces`).
    ValueError: the exported tokenizer does not reproduce the run's ids (`check_tokenizer`).
  """
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.models.hf_io import save_hf_checkpoint
  from minpro_jax.run.run_load import load_run

  check_out(out, workdir)
  run = load_run(workdir, which)
  check_replaces(out, workdir, run.which, run.step, overwrite)
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:  # a race, or a place os.access does not see through (/proc, a read-only mount)
    raise ConfigError(f"--out: {out} cannot be created ({e.strerror}); give a folder in a writable place") from e
  with open(os.path.join(out, MARKER), "w") as f:  # first: a half-written export is still known as one
    json.dump({"workdir": os.path.abspath(workdir), "which": run.which, "step": run.step}, f)
  files = save_hf_checkpoint(run.model, out, extra_config=special_ids(run.tokenizer))
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation_config(run.config, run.tokenizer), f, indent=2)
  save_tokenizer(run.config, run.tokenizer, out)
  check_tokenizer(run.tokenizer, out)
  return {"out": os.path.abspath(out), "which": run.which, "step": run.step, "files": files}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="the run's workdir (runs/NAME)")
  ap.add_argument("--which", default="best", help="best (default) | final | a kept run checkpoint's global step")
  ap.add_argument("--out", required=True, help="the folder to write (new or empty)")
  ap.add_argument("--overwrite", action="store_true", help="replace an export of another checkpoint that --out holds")
  ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
  args = ap.parse_args(argv)
  try:
    info = export(args.workdir, args.out, args.which, overwrite=args.overwrite)
  except UserError as e:
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  print(json.dumps(info, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
