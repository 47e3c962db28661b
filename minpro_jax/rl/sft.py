"""Supervised warm start, so a model trained from scratch reaches a non-zero reward before RL.

Each training example is `prompt + " \\boxed{answer}" + eos`, or with worked steps (`config.sft.target=worked`,
`minpro_jax.data.worked`) `prompt + " 2-3=-1 -1+2=1 \\boxed{1}" + eos`; the loss is the token-mean negative
log-likelihood of the response tokens only (fp32, chunked log-probs). The result is cached under a key that hashes
everything it depends on (model config, tokenizer file, problems, hyper-parameters), so a second run — or a resumed
one — reuses it instead of training again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.rl import packing
from minpro_jax.runtime import multihost
from minpro_jax.runtime.param_files import restore_params, save_params

logger = logging.getLogger(__name__)


PACK_ROWS_MULTIPLE = 4  # packed SFT rows are rounded up to this: a few compiled step shapes, at most 3 padding rows


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """steps: optimizer updates; batch_size: examples per update; learning_rate: peak AdamW lr (cosine decay to
  10% after `warmup_steps`); seed: example order; max_len: tokens per row (longer examples are dropped);
  boxed_fraction: share of targets that box the answer (see `build_examples`); row_tokens: 0, or W >= max_len: each
  step's examples packed into rows of W tokens (`pack_step`)."""

  steps: int = 1000
  batch_size: int = 64
  learning_rate: float = 1e-3
  warmup_steps: int = 50
  weight_decay: float = 0.0
  seed: int = 0
  max_len: int = 64
  boxed_fraction: float = 1.0
  row_tokens: int = 0


def sft_target(answer: str, boxed: bool = True, steps: str = "") -> str:
  """The response text a warm-started model learns: a boxed final answer, or the bare answer (which the grader
  does not credit: see `build_examples`). With `steps` (worked steps that end at the answer,
  `minpro_jax.data.worked.worked_steps`): `" {steps} \\boxed{answer}"`, or bare `" {steps}"` (the answer then only
  appears as the last step's result, which the grader does not credit either)."""
  if steps:
    return f" {steps} \\boxed{{{answer}}}" if boxed else f" {steps}"
  return f" \\boxed{{{answer}}}" if boxed else f" {answer}"


def build_examples(
    prompt_ids: Sequence[Sequence[int]],
    answers: Sequence[str],
    tokenizer,
    max_len: int,
    *,
    boxed_fraction: float = 1.0,
    seed: int = 0,
    steps: Sequence[str] | None = None,
):
  """Token rows for SFT: (tokens [N, max_len] int32, segment_ids [N, max_len], response_mask [N, max_len]).

  A fraction `boxed_fraction` of the targets (chosen with `seed`) box the answer; the rest give it bare, so the
  warm-started model answers in both formats, like a pretrained model that has seen both. The grader credits only
  extractable (boxed / "The answer is") answers, so RL must also learn the format, as in R1-Zero-style runs.
  `steps`, aligned with `answers`, gives each target its worked steps (`sft_target`); None = answers only.
  Rows are right-padded; examples longer than `max_len` are dropped (counted in the log).

  Raises:
    ValueError: `boxed_fraction` outside [0, 1], `steps` of another length than `answers`, or no example fits.
  """
  if not 0.0 <= boxed_fraction <= 1.0:
    raise ValueError(f"boxed_fraction must lie in [0, 1], got {boxed_fraction}")
  if steps is not None and len(steps) != len(answers):
    raise ValueError(f"steps has {len(steps)} entries for {len(answers)} answers")
  boxed = np.random.default_rng(seed).random(len(answers)) < boxed_fraction
  rows, masks, lengths = [], [], []
  dropped, shortest = 0, None
  for ids, ans, box, st in zip(prompt_ids, answers, boxed, steps if steps is not None else [""] * len(answers)):
    resp = tokenizer.encode(sft_target(ans, bool(box), st)) + [tokenizer.eos_id]
    seq = list(ids) + resp
    if len(seq) > max_len:
      dropped += 1
      shortest = len(seq) if shortest is None else min(shortest, len(seq))
      continue
    pad = max_len - len(seq)
    rows.append(seq + [0] * pad)
    masks.append([0] * len(ids) + [1] * len(resp) + [0] * pad)
    lengths.append(len(seq))
  if dropped:  # the longest examples: the warm start then sees a biased sample
    logger.warning(
        "SFT: dropped %d of %d examples longer than max_len=%d; raise sft.max_len to keep them",
        dropped,
        len(answers),
        max_len,
    )
  if not rows:
    raise ValueError(f"SFT: no example fits max_len={max_len}; the shortest takes {shortest} tokens")
  tokens = np.asarray(rows, np.int32)
  mask = np.asarray(masks, bool)
  seg = (np.arange(max_len)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
  return tokens, seg, mask


def long_target_warning(response_mask: np.ndarray, max_new_tokens: int) -> str | None:
  """A warning when some warm-start targets (with their eos: `response_mask` [N, L] of `build_examples`) are longer
  than the sampler's response budget, which would cut such responses before their answer; None when all fit."""
  lengths = np.asarray(response_mask).sum(1)
  over = int((lengths > max_new_tokens).sum())
  if not over:
    return None
  return (
      f"{over} of {len(lengths)} warm-start targets (with their eos) are longer than sampling.max_new_tokens="
      f"{max_new_tokens} (longest {int(lengths.max())} tokens): the sampler cuts such responses before their answer; "
      f"raise sampling.max_new_tokens to at least {int(lengths.max())}"
  )


def cache_key(parts: dict[str, Any]) -> str:
  """Stable short hash of a JSON-able description of the SFT run."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_key(cfg: SFTConfig, tokens: np.ndarray, key_parts: dict[str, Any] | None = None) -> str:
  """The cache key of an SFT run (`run_sft`'s folder `sft-<key>`): `cfg`, `key_parts` and the example tokens
  [N, L] (their count and sha256)."""
  described = dataclasses.asdict(cfg)
  if not described["row_tokens"]:  # unpacked: the key of a run from before packing existed
    del described["row_tokens"]
  return cache_key(
      {
          "cfg": described,
          **(key_parts or {}),
          "n": int(tokens.shape[0]),
          "tokens_sha": hashlib.sha256(tokens.tobytes()).hexdigest(),
      }
  )


def pack_step(tokens: np.ndarray, segment_ids: np.ndarray, response_mask: np.ndarray, row_tokens: int):
  """One step's examples packed into rows of `row_tokens` tokens, as the learner packs its samples
  (`minpro_jax.rl.packing.plan`: first-fit decreasing, segment ids 1, 2, ... per row, RoPE positions restarting at
  each segment, which `token_logprobs` derives from the segment ids).

  Args:
    tokens, segment_ids, response_mask: [B, L] rows of `build_examples`.
    row_tokens: W >= L.

  Returns:
    (tokens, segment_ids, response_mask), each [R, W]: R = the rows first fit fills, rounded up to a multiple of
    `PACK_ROWS_MULTIPLE` (a few compiled shapes), padding rows and columns 0 / False. The loss (`sft_loss`, a mean
    over the response tokens) is the unpacked one up to float rounding.
  """
  p = packing.plan(segment_ids, row_tokens, micro_batch=1)
  rows = -(-p.used_rows // PACK_ROWS_MULTIPLE) * PACK_ROWS_MULTIPLE
  fit = lambda a: np.pad(a[:rows], ((0, max(0, rows - a.shape[0])), (0, 0)))  # noqa: E731
  return fit(packing.pack_tokens(tokens, p)), fit(p.segment_ids), fit(packing.pack_tokens(response_mask, p))


def sft_loss(model, tokens: jax.Array, segment_ids: jax.Array, response_mask: jax.Array) -> jax.Array:
  """The warm start's loss: mean over the response tokens of -log p(token | the tokens before it), fp32 nats.

  Args:
    model: a `Transformer`.
    tokens, segment_ids, response_mask: [B, L] rows from `build_examples` (prompt and padding positions have
      `response_mask` False and add nothing; a batch with no response token gives 0), or packed by `pack_step`.

  Returns:
    scalar float32.
  """
  lp = token_logprobs(model, tokens, segment_ids).logp
  m = response_mask.astype(jnp.float32)
  return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)


def run_sft(
    model,
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    response_mask: np.ndarray,
    cfg: SFTConfig,
    *,
    cache_dir: str | None = None,
    key_parts: dict[str, Any] | None = None,
    log_every: int = 100,
):
  """Trains `model`'s parameters with next-token NLL on the response tokens; returns (params, info).

  Args:
    model: a `Transformer` (its parameters are the starting point; the model object is not modified).
    tokens, segment_ids, response_mask: [N, L] arrays from `build_examples`.
    cfg: `SFTConfig`.
    cache_dir: if given, the trained parameters are stored in / reused from `cache_dir/sft-<hash>`.
    key_parts: what the cache key hashes besides `cfg` (model config, tokenizer, data description).
    log_every: log the running loss every this many steps.

  Returns:
    (nnx.State params, dict with "cached", "final_loss", "path").
  """
  graphdef, params = nnx.split(model)
  path = None
  if cache_dir is not None:
    path = os.path.join(os.path.abspath(cache_dir), f"sft-{run_key(cfg, tokens, key_parts)}")
    multihost.barrier("sft cache check")  # every process decides on the same files (restore or train: collective)
    if os.path.exists(os.path.join(path, "done")):
      try:
        restored = restore_params(os.path.join(path, "params"), params)
        logger.info("SFT: reusing cached warm start %s", path)
        with open(os.path.join(path, "info.json")) as f:
          info = json.load(f)
        return restored, {**info, "cached": True, "path": path}
      except Exception as e:  # noqa: BLE001 - a broken cache is retrained, never trusted
        logger.warning("SFT: cache at %s unreadable (%s); retraining", path, e)

  # Short runs (tests, smoke configs) warm up for at most half of the steps; optax needs decay_steps > warmup.
  warmup = max(1, min(cfg.warmup_steps, cfg.steps // 2))
  sched = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, warmup, max(cfg.steps, warmup + 1), end_value=cfg.learning_rate * 0.1
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=cfg.weight_decay))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tok, seg, mask):
    loss, grads = jax.value_and_grad(lambda p: sft_loss(nnx.merge(graphdef, p), tok, seg, mask))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(cfg.seed)
  n = tokens.shape[0]
  bs = min(cfg.batch_size, n)
  order = rng.permutation(n)
  pos = 0
  running = None
  for i in range(cfg.steps):
    if pos + bs > n:
      order, pos = rng.permutation(n), 0
    idx = order[pos : pos + bs]
    pos += bs
    batch = (tokens[idx], segment_ids[idx], response_mask[idx])
    if cfg.row_tokens:
      batch = pack_step(*batch, cfg.row_tokens)
    params, opt_state, loss = multihost.settle(step(params, opt_state, *batch))
    if (i + 1) % log_every == 0 or i == cfg.steps - 1:
      running = float(loss)
      logger.info("SFT step %d/%d loss %.4f", i + 1, cfg.steps, running)
  info = {"final_loss": running, "steps": cfg.steps}
  if path is not None:
    save_params(os.path.join(path, "params"), params)
    if multihost.is_primary():
      with open(os.path.join(path, "info.json"), "w") as f:
        json.dump(info, f)
      open(os.path.join(path, "done"), "w").close()
  return params, {**info, "cached": False, "path": path}
