"""The `Sampler` keyword arguments of a run config: precision, FP8 options, layout, KV cache, decode rows, prompt
buckets.

One place for what the trainer and the standalone evaluation (`minpro_jax.evaluate`) build their samplers from, so
both compile the same programs for the same config.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
from flax import nnx

from minpro_jax import run_config
from minpro_jax.errors import ConfigError
from minpro_jax.runtime.inference_mesh import sampler_layout
from minpro_jax.sampling import PagedKV, paged
from minpro_jax.sampling.paged_continuous import row_group_axes
from minpro_jax.sampling.rows import AUTO, device_hbm_bytes, resolve_decode_rows, tree_bytes_per_device
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

logger = logging.getLogger(__name__)

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def prompt_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  """The prompt lengths the sampler compiles for: the `PROMPT_BUCKETS` below `max_prompt_tokens`, then it."""
  return tuple(b for b in PROMPT_BUCKETS if b < max_prompt_tokens) + (max_prompt_tokens,)


def row_slots(c, paged_kv: PagedKV | None, prompt_len: int) -> int:
  """KV slots one decode row reserves at full length: prompt_len + max_new_tokens in the dense cache; the whole
  pages of its prompt_len + max_new_tokens - 1 tokens in a paged pool (the last sampled token is never stored)."""
  r = c.sampling.max_new_tokens
  if paged_kv is None:
    return prompt_len + r
  return paged.pages_for(prompt_len + max(r - 1, 0), paged_kv.page_size) * paged_kv.page_size


PALLAS_HEAD_DIM = 128  # "auto" calls the Pallas kernel only at head_dims of whole 128-lane vregs (Qwen3's)


def paged_kernel(paged_kv: PagedKV | None, model_config) -> PagedKV | None:
  """`paged_kv` with kernel "auto" turned into "xla" for a model whose head_dim is not a multiple of
  `PALLAS_HEAD_DIM` (the tiny and SmolLM2 presets), so "auto" picks the Pallas kernel only where its tiles are
  whole vregs; an explicit kernel is kept."""
  if paged_kv is not None and paged_kv.kernel == "auto" and model_config.head_dim % PALLAS_HEAD_DIM:
    return dataclasses.replace(paged_kv, kernel="xla")
  return paged_kv


def decode_rows(
    c,
    model_config,
    *,
    paged_kv: PagedKV | None,
    prompt_len: int,
    mesh=None,
    rules=None,
    hbm_bytes: float | None,
    other_resident_bytes: float = 0.0,
) -> int:
  """`config.sampling.decode_rows` as the `Sampler`'s int (the trainer, the evaluation and the aot tool).

  An int as it is. "auto" (`sampling.rows`): as many rows as the HBM holds beside the resident bytes, each row
  with `row_slots` of KV at the configured lengths (64 on CPU); with a paged pool that fixes its own size
  (`sampling.num_pages` > 0), the rows that pool holds at full length (num_pages // pages per row, rounded down
  to a batch bucket), since admission reserves a row's full length: more rows could never all be live. A paged
  pool of num_pages 0 holds rows x pages per row, so "auto" sizes it by the memory left.

  Args:
    c: the run config; model_config: the policy's; paged_kv: `run_config.sampler_paged_kv(c)`; prompt_len: the
      longest prompt bucket; the rest as `sampling.rows.resolve_decode_rows`.

  Raises:
    ConfigError: "auto" fits no row (`sampling.rows.auto_decode_rows`).
  """
  value = run_config.sampler_decode_rows(c)
  slots = row_slots(c, paged_kv, prompt_len)
  if value == AUTO and paged_kv is not None and paged_kv.num_pages:
    rows, top = max(paged_kv.num_pages // (slots // paged_kv.page_size), 1), DEFAULT_BATCH_BUCKETS[-1]
    return rows // top * top if rows >= top else max((b for b in DEFAULT_BATCH_BUCKETS if b <= rows), default=rows)
  return resolve_decode_rows(
      value,
      model_config,
      precision=c.sampling.precision,
      slots=slots,
      mesh=mesh,
      rules=rules,
      hbm_bytes=hbm_bytes,
      other_resident_bytes=other_resident_bytes,
  )


def kv_cache_line(c, paged_kv: PagedKV | None, rows: int) -> str:
  """The resolved sampler for the run's log: "continuous, kv_cache=auto -> paged (pages of 16, pool auto, kernel
  xla), 64 decode rows" (`run_config.sampler_kv_cache` resolves "auto"; rows that are no batch bucket say what they
  round up to)."""
  kind, asked = run_config.sampler_kv_cache(c), c.sampling.get("kv_cache", "dense")
  cache = f"kv_cache={asked}" + (f" -> {kind}" if asked != kind else "")
  if paged_kv is not None:
    pool = paged_kv.num_pages or "auto"
    cache += f" (pages of {paged_kv.page_size}, pool {pool}, kernel {paged_kv.kernel})"
  mode = "continuous" if c.sampling.continuous else "static"
  bucket = next((b for b in DEFAULT_BATCH_BUCKETS if b >= rows), rows)  # `Sampler.continuous_rows` rounds up
  rounded = f" (runs as {bucket}: decode rows round up to a batch bucket)" if bucket != rows else ""
  return f"{mode}, {cache}, {rows} decode rows{rounded}"


def _check_group_pool(c, paged_kv: PagedKV | None, rows: int, mesh, rules) -> None:
  """A fixed pool (`sampling.num_pages`) splits over the sampler's row groups (`paged_continuous.row_groups`):
  each group's num_pages / G pages must hold one row at full length, else its requests would wait forever.

  Raises:
    ConfigError: naming sampling.num_pages, the groups and the pages a group needs."""
  if paged_kv is None or not paged_kv.num_pages:
    return
  _, groups = row_group_axes(mesh, rules)
  need = row_slots(c, paged_kv, c.data.max_prompt_tokens) // paged_kv.page_size
  if groups > 1 and rows % groups == 0 and paged_kv.num_pages // groups < need:
    raise ConfigError(
        f"config.sampling.num_pages: {paged_kv.num_pages} pages split over the sampler's {groups} row groups (its "
        f"data axes, sampling.mesh) leave {paged_kv.num_pages // groups} a group, fewer than one row's {need} pages of {paged_kv.page_size} "
        f"at full length; raise it to at least {groups * need}, or 0 = auto",
    )


def sampler_kwargs(c, model, tokenizer, mesh, split=None, *, optimizer_copies: int = 2) -> dict[str, Any]:
  """`Sampler(model.config, **sampler_kwargs(...))` for run config `c`.

  Args:
    c: the run config.
    model: the policy `Transformer` (its parameters size the "auto" decode rows).
    tokenizer: the run's tokenizer (its pad id).
    mesh: the learner's mesh, or None; the sampler's own layout comes from `config.sampling.mesh`.
    optimizer_copies: parameter-sized buffers resident beside the sampler besides the parameters (AdamW's 2
      moments in training, 0 for an evaluation on its own).
    split: the run's `device_split.DeviceSplit` (`config.sampling.devices`), or None (the sampler uses the
      learner's devices). With one, the sampler's layout spans its own devices, with no learner state beside it.
  """
  devices = None if split is None else split.sampler
  sampler_mesh, sampler_rules = sampler_layout(c.sampling.get("mesh", ""), mesh, model.config, devices)
  learner_copies = 0 if devices is not None else 1 + optimizer_copies
  paged_kv = paged_kernel(run_config.sampler_paged_kv(c), model.config)
  rows = decode_rows(  # "auto": as many as fit beside the weights (and the learner's state)
      c,
      model.config,
      paged_kv=paged_kv,
      prompt_len=c.data.max_prompt_tokens,
      mesh=sampler_mesh,
      rules=sampler_rules,
      hbm_bytes=device_hbm_bytes(jax.local_devices()),
      other_resident_bytes=learner_copies * tree_bytes_per_device(nnx.state(model, nnx.Param)),
  )
  _check_group_pool(c, paged_kv, rows, sampler_mesh, sampler_rules)
  logger.info("sampler: %s", kv_cache_line(c, paged_kv, rows))
  return dict(
      precision=c.sampling.precision,
      **run_config.sampler_fp8_options(c),
      continuous=c.sampling.continuous,
      decode_rows=rows,
      paged_kv=paged_kv,
      mesh=sampler_mesh,
      rules=sampler_rules,
      pad_id=max(tokenizer.pad_id, 0),
      prompt_buckets=prompt_buckets(c.data.max_prompt_tokens),
  )
