"""Everything a run needs before its first step, in one visible function: `setup_run(config) -> RunParts`.

In order: the config is validated (`run_config.validate_config`), the workdir checked, the problems loaded and
split into training and held-out sets, the tokenizer trained or loaded, the model built (from scratch, a Hugging
Face folder or a GGUF file) and, for a fresh scratch run, warm-started with SFT (cached under `sft.cache_dir`);
then the prompts are encoded, dropping the ones longer than `data.max_prompt_tokens`. Every check that needs no
tokenizer or model comes before them, so a config mistake costs seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax.data import encode_prompts, format_prompt, load_file, train_sentencepiece
from minpro_jax.data.records import MathProblem
from minpro_jax.data.rewards import math_reward
from minpro_jax.data.sources import get_source
from minpro_jax.data.tfds_source import load_tfds, parse_tfds_ref
from minpro_jax.data.tokenizers import (
    load_gguf_tokenizer,
    load_hf_tokenizer,
    load_sentencepiece,
    load_tokenizer,
    smollm2_gguf_path,
)
from minpro_jax.data.worked import worked_steps
from minpro_jax.errors import ConfigError, FileFormatError
from minpro_jax.models import Transformer, get_preset, init_model
from minpro_jax.models.gguf_io import load_gguf
from minpro_jax.models.hf_io import load_hf_checkpoint
from minpro_jax.rl.learner import Learner
from minpro_jax.rl.optimizer import make_optimizer
from minpro_jax.rl.sft import SFTConfig, build_examples, long_target_warning, run_sft, sft_target
from minpro_jax.run import run_config
from minpro_jax.run.checkpoint import RunCheckpointer
from minpro_jax.run.memory_check import check_sizes_fit
from minpro_jax.runtime import multihost, pidlock
from minpro_jax.runtime.device_split import DeviceSplit, sampler_device_count, split_devices
from minpro_jax.runtime.host_memory import run_memory_bytes
from minpro_jax.runtime.sharding import make_mesh

logger = logging.getLogger(__name__)

HELDOUT_MAX_FRACTION = 0.2  # a split taken from the training data holds out at most this share of its prompts


@dataclasses.dataclass
class RunParts:
  """What `setup_run` builds for a `Trainer`.

  Attributes:
    config: the validated config.
    workdir: absolute path of `config.workdir` (created, writable).
    mesh: the learner's device mesh of `config.mesh.shape`, or None for one device.
    checkpointer: the run's `RunCheckpointer` (run checkpoints and best parameters under workdir).
    model: the policy `Transformer` (warm-started unless the run resumes from a checkpoint).
    tokenizer: the run's tokenizer (`minpro_jax.data.tokenizers`).
    train_problems: training problems whose prompt fits `data.max_prompt_tokens`, in source order.
    prompt_ids: {problem id: prompt token ids} of the training problems.
    eval_sets: {benchmark name: held-out problems that fit}.
    sft_info: what the warm start did (JSON-able; `{"enabled": False}` without one).
    setup_seconds: wall time of `setup_run`.
    lock: the open lock file that keeps a second process off this workdir (released when the process exits).
    device_split: the sampler's and the learner's devices of `config.sampling.devices`, or None (shared).
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
  lock: Any = None
  device_split: DeviceSplit | None = None


def setup_run(c) -> RunParts:
  """Builds the parts of the run of config `c` (see the module docstring).

  Raises:
    ConfigError: naming the config field at fault (raised before the tokenizer and the model where possible).
  """
  t0 = time.time()
  run_config.validate_config(c)
  workdir = writable_workdir(c.workdir)
  multihost.check_same(c.to_json_best_effort(), "the config (the train command's --config flags)")
  multihost.check_shared_dir(workdir, "workdir")  # every process must write into one workdir (orbax, metrics)
  lock = lock_workdir(workdir) if multihost.is_primary() else None  # one lock per run; process 0 holds it
  try:
    split = split_devices(sampler_device_count(c.sampling.devices, jax.device_count(), jax.process_count()))
    shape = run_config.parse_mesh_shape(c.mesh.shape)
    mesh = make_mesh(shape, devices=split and split.learner) if shape else None
    problems, eval_sets = train_and_eval_problems(c)
    check_gradable(c, problems, eval_sets)
    check_data_lasts(c, len(problems))  # an upper bound: prompts too long for the sampler are dropped below
    run_config.check_mipu_problem_count(c, len(problems))  # before the tokenizer and SFT
    if c.mipu.rollback and c.mipu.mode == "random":
      run_config.random_rollback_rate(c)  # the reference run of mipu.match_rate_of must exist before any work
    checkpointer = RunCheckpointer(workdir, keep=c.checkpoint.keep)
    resuming = checkpointer.latest_step() is not None  # the checkpoint holds the weights: no warm start needed
    tokenizer = build_tokenizer(c, problems)
    if c.model.source == "hf":  # before the weights load: config.json holds the vocabulary and special ids
      check_tokenizer_matches(c, tokenizer, run_config.hf_model_config(c.model.path).vocab_size, _hf_eos_ids(c))
    model = build_model(c, tokenizer, mesh)
    if c.model.source != "scratch":
      check_tokenizer_matches(c, tokenizer, model.config.vocab_size, ())
    check_vocab_fits(c, tokenizer, model)
    run_config.check_routes_fit(c, model.config)  # a GGUF's architecture is known only now
    check_sizes_fit(c, model.config, *run_memory_bytes(mesh.devices.flat if mesh is not None else jax.devices()[:1]))
    check_disk_space(c, checkpointer, model)  # before the SFT warm start
    check_state_layout(c, model, mesh)  # before the SFT warm start: a state orbax cannot write crashes at its save
    sft_info = warm_start(c, model, tokenizer, problems) if not resuming else {"enabled": run_config.sft_enabled(c)}
    if resuming and run_config.sft_enabled(c):
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
    check_data_lasts(c, len(enc.problems))
    return RunParts(
        lock=lock,
        config=c,
        workdir=workdir,
        mesh=mesh,
        device_split=split,
        checkpointer=checkpointer,
        model=model,
        tokenizer=tokenizer,
        train_problems=list(enc.problems),
        prompt_ids={p.id: ids for p, ids in zip(enc.problems, enc.token_ids)},
        eval_sets=fit_eval_sets(c, tokenizer, eval_sets),
        sft_info=sft_info,
        setup_seconds=time.time() - t0,
    )
  except BaseException:
    if lock is not None:
      lock.close()  # a failed setup leaves the workdir free at once
    raise


def writable_workdir(path: str) -> str:
  """`path` made absolute, created, and checked writable. Raises ConfigError naming `config.workdir` (also for a
  URL such as gs://..., which would otherwise become a local folder named "gs:")."""
  if "://" in path:
    raise ConfigError(
        f"config.workdir={path!r}: URLs are not supported as the workdir (the lock, metrics and tables use the file "
        "system); mount the bucket (e.g. gcsfuse) or use a shared NFS path, and pass that path"
    )
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


def lock_workdir(workdir: str):
  """An exclusive `flock` on `workdir/.lock`, held as long as the returned file stays open (the kernel releases it
  when the process exits, however it exits, so a killed run leaves no stale lock).

  Raises:
    ConfigError: naming `config.workdir` and the process that holds it.
  """
  try:
    return pidlock.acquire(os.path.join(workdir, ".lock"))
  except pidlock.HeldError as e:
    raise ConfigError(
        f"config.workdir: {workdir} is in use by another run (pid {e.holder}); wait for it to finish, stop it, or "
        "use another --config.workdir"
    ) from None


def check_gradable(c, train: list[MathProblem], eval_sets: dict[str, list[MathProblem]]) -> None:
  """Every gold answer can be graded in its reward mode (`reward.mode` for training, `eval.reward_mode` or
  `reward.mode` for the held-out sets), so a run never fails at its first grading after the warm start.

  Raises:
    ConfigError: naming the reward-mode field, the count, one example and the fix.
  """
  sets = [("reward.mode", c.reward.mode, "training set", train)]
  field = "eval.reward_mode" if c.eval.reward_mode else "reward.mode"
  sets += [(field, c.eval.reward_mode or c.reward.mode, f"held-out set {n!r}", ps) for n, ps in eval_sets.items()]
  for field, mode, what, problems in sets:
    bad = []
    for p in problems:
      try:
        math_reward("", p.answer, mode=mode, stats=collections.Counter())
      except ValueError:
        bad.append(p)
    if bad:
      raise ConfigError(
          f"config.{field}: {len(bad)} of {len(problems)} answers of the {what} cannot be graded in mode {mode!r} "
          f"(e.g. problem {bad[0].id!r}: {bad[0].answer!r}); set {field}=math for answers that are not integers"
      )


def check_data_lasts(c, num_problems: int) -> None:
  """The loader yields a batch for every global step: `num_epochs` passes of `num_problems // prompts_per_step`
  batches must reach `total_steps` (the loader does not cycle past `data.num_epochs`).

  Raises:
    ConfigError: naming `config.data.num_epochs` and the smallest value that lasts.
  """
  per_epoch = num_problems // c.prompts_per_step
  if per_epoch * c.data.num_epochs < c.total_steps:
    need = -(-c.total_steps // max(per_epoch, 1))
    raise ConfigError(
        f"config.data.num_epochs: {num_problems} training problems give {per_epoch} batches of prompts_per_step="
        f"{c.prompts_per_step} per epoch, so num_epochs={c.data.num_epochs} lasts {per_epoch * c.data.num_epochs} "
        f"of total_steps={c.total_steps} global steps; set data.num_epochs >= {need}, add data, or lower total_steps"
    )


def check_vocab_fits(c, tokenizer, model: Transformer) -> None:
  """Every token id of the tokenizer has a row in the model's embedding (checked before the warm start).

  Raises:
    ConfigError: naming `config.tokenizer` and both sizes.
  """
  if tokenizer.vocab_size > model.config.vocab_size:
    raise ConfigError(
        f"config.tokenizer: the tokenizer has {tokenizer.vocab_size} token ids but the model's embedding has "
        f"{model.config.vocab_size} rows (model.source={c.model.source}); use the tokenizer that belongs to the "
        "model (tokenizer.kind=model) or a smaller tokenizer.vocab_size"
    )


MIN_VOCAB_FRACTION = 0.9  # a loaded model's own tokenizer fills its embedding but for padding rows


def _hf_eos_ids(c) -> tuple[int, ...]:
  """The `eos_token_id`(s) of `model.path`/config.json (none when it gives none)."""
  with open(os.path.join(c.model.path, "config.json")) as f:
    eos = json.load(f).get("eos_token_id")
  return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))


def check_tokenizer_matches(c, tokenizer, model_vocab: int, eos_ids: tuple[int, ...]) -> None:
  """A loaded (hf / gguf) model's tokenizer must be its own: it fills at least `MIN_VOCAB_FRACTION` of the
  embedding's `model_vocab` rows (models pad the embedding by a few hundred rows at most), has no id past them,
  and stops at one of the model's `eos_ids` (config.json's `eos_token_id`, when given). An unrelated tokenizer
  would train silently on ids that mean other words to the model.

  Raises:
    ConfigError: naming `config.tokenizer` (or `config.tokenizer.path`), both vocabularies and the fix. A tokenizer
      trained for the run (`tokenizer.kind=train_spm`) is not checked: it is nobody's to match.
  """
  if c.tokenizer.kind not in ("model", "path"):
    return
  field = "tokenizer.path" if c.tokenizer.kind == "path" else "tokenizer"
  where = c.tokenizer.path if c.tokenizer.kind == "path" else c.model.path
  fix = (
      f"the tokenizer at {where} is not the one of the model at {c.model.path}; use the model's own tokenizer "
      "(its tokenizer.json and tokenizer_config.json, tokenizer.kind=model)"
  )
  n = tokenizer.vocab_size
  if not MIN_VOCAB_FRACTION * model_vocab <= n <= model_vocab:
    raise ConfigError(
        f"config.{field}: the tokenizer has {n} token ids, the model's embedding {model_vocab} rows; {fix}"
    )
  stops = set(getattr(tokenizer, "stop_ids", ()))
  if eos_ids and not stops & set(eos_ids):
    raise ConfigError(
        f"config.{field}: the model ends a response with eos_token_id {list(eos_ids)} (config.json), but the "
        f"tokenizer stops at ids {sorted(stops)}; {fix}"
    )
  if c.tokenizer.kind == "path" and c.model.source == "hf":
    _check_same_vocabulary(tokenizer, _own_tokenizer(c.model.path), field, fix)


def _own_tokenizer(model_path: str):
  """The tokenizer an hf model folder ships (tokenizer.json, or a sentencepiece tokenizer.model), or None."""
  for name in ("tokenizer.json", "tokenizer.model"):
    if os.path.isfile(os.path.join(model_path, name)):
      try:
        return load_tokenizer(os.path.join(model_path, name))
      except (OSError, ValueError, RuntimeError, json.JSONDecodeError):
        return None  # a damaged file: the size and eos checks are all there is to go on
  return None


def _check_same_vocabulary(tokenizer, own, field: str, fix: str) -> None:
  """Raises ConfigError when `tokenizer` maps an id to another token string than the model's `own` tokenizer (a
  same-size tokenizer trained on other text: ids that mean other words to the model). Nothing to compare without
  `own` or when either cannot list its vocabulary."""
  mine, theirs = tokenizer.vocabulary(), own.vocabulary() if own is not None else None
  if mine is None or theirs is None:
    return
  differ = [i for i in range(max(len(mine), len(theirs))) if mine[i : i + 1] != theirs[i : i + 1]]
  if differ:
    shown = ", ".join(
        f"id {i}: {(mine[i : i + 1] or ['-'])[0]!r} vs {(theirs[i : i + 1] or ['-'])[0]!r}" for i in differ[:3]
    )
    raise ConfigError(
        f"config.{field}: {len(differ)} of {max(len(mine), len(theirs))} token ids are other token strings than "
        f"in the model's own tokenizer ({shown}{', ...' if len(differ) > 3 else ''}); {fix}"
    )


def check_disk_space(c, checkpointer: RunCheckpointer, model: Transformer) -> None:
  """`RunCheckpointer.check_disk_space` before the warm start, for the learner state `model`'s parameters and
  their optimizer state (abstract: nothing is allocated) will have.

  Raises:
    DiskFullError: naming `config.workdir`, the free and the needed space.
  """
  params = nnx.split(model)[1]
  optimizer = make_optimizer(run_config.optimizer_config(c))
  state = (params, jax.eval_shape(optimizer.init, params))
  checkpointer.check_disk_space(state, params)


def check_state_layout(c, model: Transformer, mesh) -> None:
  """In a multi-process run, makes the learner state the trainer will checkpoint (`Learner.init_state` of
  `model`'s parameters: the parameters, zero optimizer moments and the counters), which checks that every leaf is
  a global array on `mesh`, and frees it. It costs one optimizer state (the SFT warm start that follows makes its
  own) for a moment; a single-process run skips it (orbax writes any of its arrays).

  Raises:
    ConfigError: naming `config.mesh.shape` and the first leaf orbax could not write (`sharding.check_global`).
  """
  if mesh is None or multihost.process_count() == 1:
    return
  learner = Learner(
      model,
      run_config.loss_config(c),
      run_config.optimizer_config(c),
      micro_batch_size=run_config.learner_micro_batch(c),
      mesh=mesh,
  )
  learner.init_state(nnx.split(model)[1])


def check_finite_params(model: Transformer, path: str) -> None:
  """Raises FileFormatError naming `path` and the first parameter holding NaN or inf."""
  for key, leaf in jax.tree_util.tree_leaves_with_path(nnx.split(model)[1]):
    if not bool(jnp.all(jnp.isfinite(leaf))):
      raise FileFormatError(
          f"{path}: parameter {jax.tree_util.keystr(key)} holds NaN or inf; the checkpoint is damaged"
      )


# --------------------------------------------------------------------------------------------------- problems
def load_problems(c, *, seed: int, size: int) -> list[MathProblem]:
  """Problems of `config.data` from its registered source (`minpro_jax.data.sources.SOURCES`)."""
  return get_source(c.data.source).load(c.data, seed=seed, size=size)


def eval_benchmarks(c) -> dict[str, list[MathProblem]]:
  """Held-out problems: for a generator source, a draw with generator seed `eval.seed` (benchmark
  "<stem>_heldout"); plus the `eval.path` files (at most `eval.num_problems` problems each). An `eval.path` item
  `name=tfds:DATASET/SPLIT@DATA_DIR` reads a split of a prepared TFDS dataset (`minpro_jax.data.tfds_source`)."""
  out: dict[str, list[MathProblem]] = {}
  source = get_source(c.data.source)
  if source.generator:
    probs = load_problems(c, seed=c.eval.seed, size=c.eval.num_problems)
    out[f"{source.heldout_name(c.data)}_heldout"] = list({p.prompt: p for p in probs}.values())
  for name, fmt, path in run_config.eval_files(c):
    if fmt == "tfds":
      out[name] = load_tfds(*parse_tfds_ref(path), limit=c.eval.num_problems)
      continue
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
  for name, held in eval_sets.items():
    if not held:
      raise ConfigError(
          f"config.eval.path: held-out set {name!r} holds no usable problem (skipped rows are logged above); "
          "each row needs a question and an answer in its format"
      )
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
  if t.kind != "train_spm":
    path = t.path if t.kind == "path" else c.model.path or smollm2_gguf_path()
    try:
      if t.kind == "path":
        return load_tokenizer(t.path, chat_format=t.chat_format)
      if c.model.source == "hf":
        return load_hf_tokenizer(c.model.path, chat_format=t.chat_format)
      return load_gguf_tokenizer(path, chat_format=t.chat_format)
    except Exception as e:  # noqa: BLE001 - any failure to read the file is a bad file: name it
      field = "tokenizer.path" if t.kind == "path" else "model.path"
      raise FileFormatError(f"{path}: cannot read a tokenizer from it (config.{field}; {type(e).__name__}: {e})") from e
  steps = sft_steps(c, problems)  # the corpus holds the responses the warm start teaches
  corpus = [format_prompt(p, template="plain") + sft_target(p.answer, steps=s) for p, s in zip(problems, steps)]
  key = hashlib.sha256(("\n".join(corpus) + f"|{t.vocab_size}|{c.seed}").encode()).hexdigest()[:16]
  path = os.path.join(_cache_dir(c), f"spm-{key}.model")
  if not os.path.exists(path):
    tmp = path + f".tmp{os.getpid()}"
    try:
      train_sentencepiece(corpus, t.vocab_size, tmp, seed=c.seed)
    except ValueError as e:
      raise ConfigError(f"config.tokenizer.vocab_size: {e}") from e
    os.replace(tmp, path)
    logger.info("trained sentencepiece tokenizer (%d pieces) -> %s", t.vocab_size, path)
  return load_sentencepiece(path, chat_format=t.chat_format or "plain")


def build_model(c, tokenizer, mesh) -> Transformer:
  """The policy: a loaded HF folder / GGUF file, or a scratch preset (vocabulary = the tokenizer's), on `mesh` by
  the learner's rules (`config.mesh.rules`)."""
  overrides = run_config.model_overrides(c)
  if c.model.source in ("hf", "gguf"):
    path = c.model.path or smollm2_gguf_path()
    try:
      load = load_hf_checkpoint if c.model.source == "hf" else load_gguf
      model = load(path, mesh=mesh, rules=run_config.learner_rules(c), **overrides)[0]
    except Exception as e:  # noqa: BLE001 - a file that does not load is a bad file: name it
      raise FileFormatError(
          f"{path}: cannot load a {c.model.source} checkpoint (config.model.path; " f"{type(e).__name__}: {e})"
      ) from e
    run_config.check_overrides_match(c, model.config)
    check_finite_params(model, path)
    return model
  cfg = get_preset(c.model.preset, vocab_size=tokenizer.vocab_size, **dict(c.model.overrides), **overrides)
  return init_model(cfg, seed=c.seed, mesh=mesh, rules=run_config.learner_rules(c))


MAX_TOKENS_PER_CHAR = 0.6  # a tokenizer that knows the text takes about a token per 3-4 characters of it


def _sft_fit_error(c, tokenizer, problems, prompt_ids, e: ValueError) -> ConfigError:
  """No SFT example fits `sft.max_len`: blames the tokenizer when it splits the prompts into about a token per
  character (it does not know the text), else `sft.max_len`."""
  chars = sum(len(format_prompt(p, tokenizer, c.data.template)) for p in problems)
  per_char = sum(map(len, prompt_ids)) / max(chars, 1)
  if per_char > MAX_TOKENS_PER_CHAR and c.tokenizer.kind != "train_spm":
    field = "tokenizer.path" if c.tokenizer.kind == "path" else "tokenizer"
    return ConfigError(
        f"config.{field}: {e}, because the tokenizer splits the prompts into {per_char:.2f} tokens per character "
        "(a tokenizer that knows the text takes about 0.3): it is not the model's tokenizer, or not one for "
        "this text; use the model's own tokenizer (tokenizer.kind=model)"
    )
  return ConfigError(f"config.sft.max_len: {e}; raise sft.max_len to at least that")


def sft_steps(c, problems: list[MathProblem]) -> list[str]:
  """The worked steps of each problem's SFT target (`config.sft.target=worked`), or "" each for `answer`.

  Raises:
    ConfigError: naming `config.sft.target`, when a problem's trace is missing or does not reach its answer.
  """
  if c.sft.target != "worked":
    return [""] * len(problems)
  try:
    return [worked_steps(p) for p in problems]
  except ValueError as e:
    raise ConfigError(f"config.sft.target: 'worked' needs a trace for every problem: {e}; set sft.target=answer") from e


def warm_start(c, model: Transformer, tokenizer, problems: list[MathProblem]) -> dict[str, Any]:
  """SFT on the tail of the training problems (`config.sft`), cached; updates `model` in place.

  Returns:
    What was done, JSON-able: `{"enabled": False}`, or the SFT info (loss, cache path, whether it was cached).
  """
  if not run_config.sft_enabled(c):
    if c.sft.enabled is None:
      logger.info(
          "sft: off for model.source=%s (a pretrained model starts RL as it is); --config.sft.enabled=True "
          "warm-starts it anyway",
          c.model.source,
      )
    return {"enabled": False}
  n = min(c.sft.num_examples, len(problems))
  sft_problems = problems[-n:]
  prompt_ids = [
      tokenizer.encode(format_prompt(p, tokenizer, c.data.template), add_bos=c.data.template == "plain")
      for p in sft_problems
  ]
  steps = sft_steps(c, sft_problems) if c.sft.target == "worked" else None
  try:
    tokens, seg, mask = build_examples(
        prompt_ids,
        [p.answer for p in sft_problems],
        tokenizer,
        c.sft.max_len,
        boxed_fraction=c.sft.boxed_fraction,
        seed=c.seed,
        steps=steps,
    )
  except ValueError as e:
    raise _sft_fit_error(c, tokenizer, sft_problems, prompt_ids, e) from e
  if too_long := long_target_warning(mask, c.sampling.max_new_tokens):
    logger.warning(too_long)
  multihost.check_same(  # a tokenizer or data that differ between hosts would hang the SFT's collectives
      hashlib.sha256(tokens.tobytes() + repr(tokens.shape).encode()).hexdigest(), "the SFT warm-start examples"
  )
  scfg = SFTConfig(
      steps=c.sft.steps,
      batch_size=c.sft.batch_size,
      learning_rate=c.sft.learning_rate,
      seed=c.seed,
      max_len=c.sft.max_len,
      boxed_fraction=c.sft.boxed_fraction,
      row_tokens=c.sft.row_tokens,
  )
  params, info = run_sft(
      model,
      tokens,
      seg,
      mask,
      scfg,
      cache_dir=_cache_dir(c),
      key_parts=sft_key_parts(c, model),
  )
  nnx.update(model, params)
  return {"enabled": True, **info, "examples": int(tokens.shape[0])}


def sft_key_parts(c, model: Transformer) -> dict[str, Any]:
  """What the SFT cache key hashes besides the SFT hyper-parameters and the example tokens: the model and, for
  `sft.target=worked` only, the target (absent for `answer`, so the default config keeps the key it always had
  and its cached warm start and committed results still match)."""
  parts = {"model": repr(model.config), "source": c.model.source, "path": c.model.path}
  target = c.sft.target
  return parts if target == "answer" else {**parts, "target": target}
