"""Everything a run needs before its first step, in one visible function: `setup_run(config) -> RunParts`.

In order: the config is validated (`run_config.validate_config`), the workdir checked, the problems loaded and
split into training and held-out sets, the tokenizer trained or loaded, the model built (from scratch, a Hugging
Face folder or a GGUF file) and, for a fresh scratch run, warm-started with SFT (cached under `sft.cache_dir`);
then the prompts are encoded, dropping the ones longer than `data.max_prompt_tokens`. Every check that needs no
tokenizer or model comes before them, so a config mistake costs seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from typing import Any

import numpy as np
from flax import nnx

from minpro_jax import run_config
from minpro_jax.checkpoint import RunCheckpointer
from minpro_jax.data import encode_prompts, format_prompt, load_file, train_sentencepiece
from minpro_jax.data.records import MathProblem
from minpro_jax.data.sources import get_source
from minpro_jax.data.tokenizers import (
    load_gguf_tokenizer,
    load_hf_tokenizer,
    load_sentencepiece,
    load_tokenizer,
    smollm2_gguf_path,
)
from minpro_jax.errors import ConfigError
from minpro_jax.models import Transformer, get_preset, init_model
from minpro_jax.models.gguf_io import load_gguf
from minpro_jax.models.hf_io import load_hf_checkpoint
from minpro_jax.rl.sft import SFTConfig, build_examples, run_sft, sft_target
from minpro_jax.runtime.sharding import make_mesh

logger = logging.getLogger(__name__)

HELDOUT_MAX_FRACTION = 0.2  # a split taken from the training data holds out at most this share of its prompts


@dataclasses.dataclass
class RunParts:
  """What `setup_run` builds for a `Trainer`.

  Attributes:
    config: the validated config.
    workdir: absolute path of `config.workdir` (created, writable).
    mesh: the device mesh of `config.mesh.shape`, or None for one device.
    checkpointer: the run's `RunCheckpointer` (run checkpoints and best parameters under workdir).
    model: the policy `Transformer` (warm-started unless the run resumes from a checkpoint).
    tokenizer: the run's tokenizer (`minpro_jax.data.tokenizers`).
    train_problems: training problems whose prompt fits `data.max_prompt_tokens`, in source order.
    prompt_ids: {problem id: prompt token ids} of the training problems.
    eval_sets: {benchmark name: held-out problems that fit}.
    sft_info: what the warm start did (JSON-able; `{"enabled": False}` without one).
    setup_seconds: wall time of `setup_run`.
  """

  config: Any
  workdir: str
  mesh: Any
  checkpointer: RunCheckpointer
  model: Transformer
  tokenizer: Any
  train_problems: list[MathProblem]
  prompt_ids: dict[str, list[int]]
  eval_sets: dict[str, list[MathProblem]]
  sft_info: dict[str, Any]
  setup_seconds: float


def setup_run(c) -> RunParts:
  """Builds the parts of the run of config `c` (see the module docstring).

  Raises:
    ConfigError: naming the config field at fault (raised before the tokenizer and the model where possible).
  """
  t0 = time.time()
  run_config.validate_config(c)
  if c.total_steps <= c.delay:
    logger.warning(
        "total_steps=%d <= delay=%d: every rollout is still in the delay buffer at the end, so the run makes no update",
        c.total_steps,
        c.delay,
    )
  workdir = writable_workdir(c.workdir)
  shape = run_config.parse_mesh_shape(c.mesh.shape)
  mesh = make_mesh(shape) if shape else None
  problems, eval_sets = train_and_eval_problems(c)
  run_config.check_mipu_problem_count(c, len(problems))  # before the tokenizer and SFT
  checkpointer = RunCheckpointer(workdir, keep=c.checkpoint.keep)
  resuming = checkpointer.latest_step() is not None  # the checkpoint holds the weights: no warm start needed
  tokenizer = build_tokenizer(c, problems)
  model = build_model(c, tokenizer, mesh)
  sft_info = warm_start(c, model, tokenizer, problems) if not resuming else {"enabled": bool(c.sft.enabled)}
  if resuming and c.sft.enabled:
    sft_info["skipped"] = "resumed from a run checkpoint"
  enc = encode_fitting(c, tokenizer, problems, "training set")
  if len(enc.problems) < c.prompts_per_step:
    raise ConfigError(
        f"config.data: {len(enc.problems)} training problems are left ({len(problems)} after removing the held-out "
        f"prompts, {len(enc.skipped)} of them longer than data.max_prompt_tokens={c.data.max_prompt_tokens}), "
        f"fewer than prompts_per_step={c.prompts_per_step}; use more data, a larger max_prompt_tokens or a "
        "smaller prompts_per_step"
    )
  run_config.check_mipu_problem_count(c, len(enc.problems))  # after prompts too long were dropped
  return RunParts(
      config=c,
      workdir=workdir,
      mesh=mesh,
      checkpointer=checkpointer,
      model=model,
      tokenizer=tokenizer,
      train_problems=list(enc.problems),
      prompt_ids={p.id: ids for p, ids in zip(enc.problems, enc.token_ids)},
      eval_sets=fit_eval_sets(c, tokenizer, eval_sets),
      sft_info=sft_info,
      setup_seconds=time.time() - t0,
  )


def writable_workdir(path: str) -> str:
  """`path` made absolute, created, and checked writable. Raises ConfigError naming `config.workdir`."""
  workdir = os.path.abspath(path)
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise ConfigError(
        f"config.workdir: cannot write to {workdir} ({e.strerror or e}); choose a "
        "writable directory, e.g. --config.workdir=runs/my_run"
    ) from e
  return workdir


# --------------------------------------------------------------------------------------------------- problems
def load_problems(c, *, seed: int, size: int) -> list[MathProblem]:
  """Problems of `config.data` from its registered source (`minpro_jax.data.sources.SOURCES`)."""
  return get_source(c.data.source).load(c.data, seed=seed, size=size)


def eval_benchmarks(c) -> dict[str, list[MathProblem]]:
  """Held-out problems: for a generator source, a draw with generator seed `eval.seed` (benchmark
  "<stem>_heldout"); plus the `eval.path` files (at most `eval.num_problems` problems each)."""
  out: dict[str, list[MathProblem]] = {}
  source = get_source(c.data.source)
  if source.generator:
    probs = load_problems(c, seed=c.eval.seed, size=c.eval.num_problems)
    out[f"{source.heldout_name(c.data)}_heldout"] = list({p.prompt: p for p in probs}.values())
  for name, fmt, path in run_config.eval_files(c):
    out[name] = load_file(path, fmt)[: c.eval.num_problems]
  return out


def remove_heldout(train: list[MathProblem], eval_sets: dict[str, list[MathProblem]]) -> list[MathProblem]:
  """Training problems whose prompt text appears in no held-out set."""
  held = {p.prompt for ps in eval_sets.values() for p in ps}
  return [p for p in train if p.prompt not in held]


def train_and_eval_problems(c) -> tuple[list[MathProblem], dict[str, list[MathProblem]]]:
  """The run's training problems and held-out benchmarks.

  Held-out sets are `eval_benchmarks(c)`. When there is none (a fixed-set source such as a file or CHAMP, and no
  `eval.path`), `min(eval.num_problems, 20 % of the distinct prompts)` problems (at least 1) are split off the
  training data with a shuffle seeded by `eval.seed` (benchmark "<stem>_heldout"), so every run is evaluated on
  problems it does not train on. Training problems whose prompt is in any held-out set are removed.

  Returns:
    (train problems in source order, {benchmark name: problems}).

  Raises:
    ConfigError: naming `config.data` when too few problems are left on either side.
  """
  eval_sets = eval_benchmarks(c)
  problems = load_problems(c, seed=c.seed, size=c.data.size)
  if not eval_sets:
    prompts = list(dict.fromkeys(p.prompt for p in problems))
    if len(prompts) < 2:
      raise ConfigError(
          f"config.data: {len(prompts)} distinct problem(s), too few to split off a held-out set; "
          "give more problems or a held-out file with eval.path=name=fmt:path"
      )
    n_held = min(int(c.eval.num_problems), max(1, int(HELDOUT_MAX_FRACTION * len(prompts))))
    held = {prompts[i] for i in np.random.default_rng(int(c.eval.seed)).permutation(len(prompts))[:n_held]}
    first: dict[str, MathProblem] = {}
    for p in problems:
      if p.prompt in held:
        first.setdefault(p.prompt, p)
    name = get_source(c.data.source).heldout_name(c.data)
    eval_sets[f"{name}_heldout"] = list(first.values())
    logger.warning(
        "config.eval.path is empty: holding out %d of %d distinct %s problems (eval.seed=%d) as benchmark "
        "%s_heldout; set eval.path=name=fmt:path to evaluate on a separate file instead",
        n_held,
        len(prompts),
        c.data.source,
        int(c.eval.seed),
        name,
    )
  train = remove_heldout(problems, eval_sets)
  if not train:
    raise ConfigError(
        "config.data: every training problem is also in a held-out set (eval.path or the generator draw "
        "of eval.seed); use other data or other held-out problems"
    )
  return train, eval_sets


def encode_fitting(c, tokenizer, problems: list[MathProblem], what: str):
  """`encode_prompts` at `data.max_prompt_tokens`; a warning counts the prompts skipped as too long."""
  enc = encode_prompts(problems, tokenizer, max_prompt_tokens=c.data.max_prompt_tokens, template=c.data.template)
  if enc.skipped:
    logger.warning(
        "%s: skipped %d of %d problems longer than data.max_prompt_tokens=%d",
        what,
        len(enc.skipped),
        len(problems),
        c.data.max_prompt_tokens,
    )
  return enc


def fit_eval_sets(c, tokenizer, eval_sets: dict[str, list[MathProblem]]) -> dict[str, list[MathProblem]]:
  """Held-out sets without the prompts longer than `data.max_prompt_tokens` (the sampler cannot take them).

  Raises:
    ConfigError: naming `config.data.max_prompt_tokens` when no prompt of a set fits.
  """
  out = {}
  for name, problems in eval_sets.items():
    enc = encode_fitting(c, tokenizer, problems, f"held-out set {name}")
    if not enc.problems:
      raise ConfigError(
          f"config.data.max_prompt_tokens: no prompt of held-out set {name!r} fits in "
          f"{c.data.max_prompt_tokens} tokens; raise it"
      )
    out[name] = list(enc.problems)
  return out


# ------------------------------------------------------------------------------------------- tokenizer, model
def _cache_dir(c) -> str:
  d = c.sft.cache_dir
  return d if os.path.isabs(d) else os.path.join(os.getcwd(), d)


def build_tokenizer(c, problems: list[MathProblem]):
  """The run's tokenizer (see `config.tokenizer`). A trained sentencepiece model is cached by corpus hash."""
  t = c.tokenizer
  if t.kind == "path":
    return load_tokenizer(t.path, chat_format=t.chat_format)
  if t.kind == "model":
    if c.model.source == "hf":
      return load_hf_tokenizer(c.model.path, chat_format=t.chat_format)
    return load_gguf_tokenizer(c.model.path or smollm2_gguf_path(), chat_format=t.chat_format)
  corpus = [format_prompt(p, template="plain") + sft_target(p.answer) for p in problems]  # tokenizer corpus only
  key = hashlib.sha256(("\n".join(corpus) + f"|{t.vocab_size}|{c.seed}").encode()).hexdigest()[:16]
  path = os.path.join(_cache_dir(c), f"spm-{key}.model")
  if not os.path.exists(path):
    tmp = path + f".tmp{os.getpid()}"
    train_sentencepiece(corpus, t.vocab_size, tmp, seed=c.seed)
    os.replace(tmp, path)
    logger.info("trained sentencepiece tokenizer (%d pieces) -> %s", t.vocab_size, path)
  return load_sentencepiece(path, chat_format=t.chat_format or "plain")


def build_model(c, tokenizer, mesh) -> Transformer:
  """The policy: a loaded HF folder / GGUF file, or a scratch preset (vocabulary = the tokenizer's), on `mesh`."""
  overrides = run_config.model_overrides(c)
  if c.model.source == "hf":
    return load_hf_checkpoint(c.model.path, mesh=mesh, **overrides)[0]
  if c.model.source == "gguf":
    return load_gguf(c.model.path or smollm2_gguf_path(), mesh=mesh, **overrides)[0]
  cfg = get_preset(c.model.preset, vocab_size=tokenizer.vocab_size, **dict(c.model.overrides), **overrides)
  return init_model(cfg, seed=c.seed, mesh=mesh)


def warm_start(c, model: Transformer, tokenizer, problems: list[MathProblem]) -> dict[str, Any]:
  """SFT on the tail of the training problems (`config.sft`), cached; updates `model` in place.

  Returns:
    What was done, JSON-able: `{"enabled": False}`, or the SFT info (loss, cache path, whether it was cached).
  """
  if not c.sft.enabled:
    return {"enabled": False}
  n = min(c.sft.num_examples, len(problems))
  sft_problems = problems[-n:]
  prompt_ids = [
      tokenizer.encode(format_prompt(p, tokenizer, c.data.template), add_bos=c.data.template == "plain")
      for p in sft_problems
  ]
  tokens, seg, mask = build_examples(
      prompt_ids,
      [p.answer for p in sft_problems],
      tokenizer,
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
      cache_dir=_cache_dir(c),
      key_parts={"model": repr(model.config), "source": c.model.source, "path": c.model.path},
  )
  nnx.update(model, params)
  return {"enabled": True, **info, "examples": int(tokens.shape[0])}
