"""Tokenizer and model for a run: trained/loaded tokenizer, model from scratch (+ cached SFT warm start), a
Hugging Face folder or a GGUF file."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from minpro_jax.data import format_prompt
from minpro_jax.data.records import MathProblem
from minpro_jax.models import get_preset, init_model
from minpro_jax.rl.sft import SFTConfig, build_examples, run_sft, sft_target

logger = logging.getLogger(__name__)


def _cache_dir(c, workdir: str) -> str:
  d = c.sft.cache_dir
  return d if os.path.isabs(d) else os.path.join(os.getcwd(), d)


def build_tokenizer(c, problems: list[MathProblem], workdir: str):
  """The run's tokenizer (see `config.tokenizer`). A trained sentencepiece model is cached by corpus hash."""
  from minpro_jax.data.tokenizers import load_gguf_tokenizer, load_hf_tokenizer, load_sentencepiece, load_tokenizer

  t = c.tokenizer
  fmt = t.chat_format or None
  if t.kind == "path":
    return load_tokenizer(t.path, chat_format=fmt)
  if t.kind == "model":
    if c.model.source == "hf":
      return load_hf_tokenizer(c.model.path, chat_format=fmt)
    if c.model.source == "gguf":
      from minpro_jax.data.tokenizers import smollm2_gguf_path

      return load_gguf_tokenizer(c.model.path or smollm2_gguf_path(), chat_format=fmt)
    raise ValueError("config.tokenizer.kind='model' needs model.source hf or gguf")
  from minpro_jax.data import train_sentencepiece

  corpus = [format_prompt(p, template="plain") + sft_target(p.answer) for p in problems]  # tokenizer corpus only
  key = hashlib.sha256(("\n".join(corpus) + f"|{t.vocab_size}|{c.seed}").encode()).hexdigest()[:16]
  path = os.path.join(_cache_dir(c, workdir), f"spm-{key}.model")
  if not os.path.exists(path):
    tmp = path + f".tmp{os.getpid()}"
    train_sentencepiece(corpus, t.vocab_size, tmp, seed=c.seed)
    os.replace(tmp, path)
    logger.info("trained sentencepiece tokenizer (%d pieces) -> %s", t.vocab_size, path)
  return load_sentencepiece(path, chat_format=t.chat_format or "plain")


def _model_overrides(c) -> dict[str, Any]:
  return {
      "param_dtype": c.model.param_dtype,
      "dtype": c.model.dtype,
      "remat": c.model.remat,
      "scan_layers": bool(c.model.scan_layers),
  }


def build_model_and_tokenizer(c, problems: list[MathProblem], mesh, workdir: str, *, skip_sft: bool = False):
  """(model, tokenizer, sft_info) for config `c`.

  scratch: preset + overrides with the tokenizer's vocabulary, randomly initialised (directly sharded on `mesh`),
  then the SFT warm start if `sft.enabled` (cached under `sft.cache_dir`). hf / gguf: loaded checkpoints.
  `skip_sft`: a resumed run restores its weights from its own checkpoint, so the warm start is not rebuilt.
  """
  tok = build_tokenizer(c, problems, workdir)
  info: dict[str, Any] = {"enabled": False}
  if c.model.source == "hf":
    from minpro_jax.models.hf_io import load_hf_checkpoint

    model, _ = load_hf_checkpoint(c.model.path, mesh=mesh, **_model_overrides(c))
  elif c.model.source == "gguf":
    from minpro_jax.models.gguf_io import load_gguf, smollm2_gguf_path

    model, _ = load_gguf(c.model.path or smollm2_gguf_path(), mesh=mesh, **_model_overrides(c))
  else:
    cfg = get_preset(c.model.preset, vocab_size=tok.vocab_size, **dict(c.model.overrides), **_model_overrides(c))
    model = init_model(cfg, seed=c.seed, mesh=mesh)
  if c.sft.enabled and skip_sft:
    info = {"enabled": True, "skipped": "resumed from a run checkpoint"}
  elif c.sft.enabled:
    from flax import nnx

    n = min(c.sft.num_examples, len(problems))
    sft_problems = problems[-n:]  # the tail of the training set
    prompt_ids = [
        tok.encode(format_prompt(p, tok, c.data.template), add_bos=c.data.template == "plain") for p in sft_problems
    ]
    tokens, seg, mask = build_examples(
        prompt_ids,
        [p.answer for p in sft_problems],
        tok,
        c.sft.max_len,
        boxed_fraction=c.sft.boxed_fraction,
        seed=c.seed,
    )
    scfg = SFTConfig(
        steps=c.sft.steps,
        batch_size=c.sft.batch_size,
        learning_rate=c.sft.learning_rate,
        seed=c.seed,
        max_len=c.sft.max_len,
        boxed_fraction=c.sft.boxed_fraction,
    )
    params, info = run_sft(
        model,
        tokens,
        seg,
        mask,
        scfg,
        cache_dir=_cache_dir(c, workdir),
        key_parts={"model": repr(model.config), "source": c.model.source, "path": c.model.path},
    )
    nnx.update(model, params)
    info = {"enabled": True, **info, "examples": int(tokens.shape[0])}
  return model, tok, info
