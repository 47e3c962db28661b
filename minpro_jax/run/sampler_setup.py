"""The sampler of a run config, read and checked in one place: `config.sampling` (precision and its FP8 options,
the engine and its KV cache, decode rows, the sampling parameters) turned into a `Sampler`'s arguments.

The trainer, the standalone evaluation (`minpro_jax.evaluate`) and the compile-only tool (`minpro_jax.aot`) all
build their samplers from here, so they compile the same programs for the same config. The engine is
`sampling.engine` when set (a registered name, `minpro_jax.sampling.engines`), else the one `sampling.continuous`
and `sampling.kv_cache` choose (`engine_name`): continuous=False -> "static"; kv_cache "dense" -> "continuous";
"paged" or "auto" -> "paged".
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import jax
from flax import nnx

from minpro_jax.errors import ConfigError
from minpro_jax.models.quant import FP8_ACTIVATIONS, FP8_FORMATS, FP8_WEIGHT_SCALES, PRECISIONS
from minpro_jax.run.config_checks import need as _need
from minpro_jax.runtime.inference_mesh import sampler_layout
from minpro_jax.runtime.rules import parse_rules
from minpro_jax.sampling import PagedKV, SamplingParams, paged
from minpro_jax.sampling.engines import ENGINES
from minpro_jax.sampling.paged_continuous import row_group_axes
from minpro_jax.sampling.rows import AUTO, device_hbm_bytes, resolve_decode_rows, tree_bytes_per_device
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

logger = logging.getLogger(__name__)

# config.sampling.kv_cache: "auto" (`resolve_kv_cache`), or the continuous sampler's KV caches
# (minpro_jax.sampling.paged_continuous)
KV_CACHES = ("auto", "dense", "paged")
# config.sampling.fp8_* field, choices, default (the sampler's FP8 options, minpro_jax.models.quant)
FP8_OPTIONS = (
    ("fp8_weight_scale", FP8_WEIGHT_SCALES, "tensor"),
    ("fp8_format", tuple(FP8_FORMATS), "e4m3"),
    ("fp8_activations", FP8_ACTIVATIONS, "token"),
)


def sampler_fp8_options(c) -> dict[str, str]:
  """The `Sampler` keyword arguments of `config.sampling.fp8_*` (defaults where a config lacks them).

  Raises:
    ConfigError: a value outside its choices, or one changed from its default while sampling.precision is not fp8.
  """
  out = {}
  for field, choices, default in FP8_OPTIONS:
    value = c.sampling[field]
    _need(value in choices, f"sampling.{field}", f"{value!r}; choose one of {choices}")
    _need(
        value == default or c.sampling.precision == "fp8",
        f"sampling.{field}",
        f"{value!r} needs sampling.precision='fp8' (got {c.sampling.precision!r}); set it or unset this field",
    )
    out[field] = value
  return out


def sampler_decode_rows(c) -> int | str:
  """`config.sampling.decode_rows` (64, the `Sampler` default, where a config lacks it): an int, or "auto", which
  the trainer and the compile-only tool resolve for their layout (`minpro_jax.sampling.rows`).

  Raises:
    ConfigError: neither an int >= 1 nor "auto".
  """
  rows = c.sampling.decode_rows
  ok = rows == "auto" or isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1
  _need(
      ok,
      "sampling.decode_rows",
      f"must be an int >= 1 (the continuous sampler's decode rows) or 'auto' (as many as fit), got {rows!r}",
  )
  return rows


def resolve_kv_cache(kv_cache: str, continuous: bool) -> str:
  """The KV cache `sampling.kv_cache` stands for with the sampler `sampling.continuous` picks: "auto" is "paged"
  with the continuous sampler and "dense" with the static one (which has no paged cache); "dense" and "paged" are
  themselves. The one place "auto" is resolved (the trainer, the evaluation and the aot tool all reach it through
  `sampler_paged_kv`). Any other value is returned as it is, for `sampler_paged_kv` to refuse."""
  if kv_cache == "auto":
    return "paged" if continuous else "dense"
  return kv_cache


def sampler_kv_cache(c) -> str:
  """`config.sampling.kv_cache` resolved (`resolve_kv_cache`): "dense" or "paged"; with `sampling.engine` set,
  "paged" where that engine's options take a cache (`kv`), else "dense"; "auto" is "dense" in the in-flight mode
  (`config.staleness.mode`).

  Raises:
    ConfigError: an unknown kv_cache.
  """
  kind = c.sampling.kv_cache
  _need(kind in KV_CACHES, "sampling.kv_cache", f"{kind!r}; choose one of {KV_CACHES}")
  if c.sampling.engine in ENGINES:  # the named engine decides: a paged cache where its options take one
    return "paged" if "kv" in {f.name for f in dataclasses.fields(ENGINES[c.sampling.engine])} else "dense"
  if c.get("staleness") is not None and c.staleness.mode == "inflight" and kind == "auto":
    return "dense"  # the streaming pool (minpro_jax/sampling/streaming.py) runs the continuous engine's dense cache
  return resolve_kv_cache(kind, bool(c.sampling.continuous))


def sampler_paged_kv(c) -> PagedKV | None:
  """The paged engine's cache (`engines.Paged(kv=...)`) of `config.sampling.kv_cache` / `page_size` / `num_pages`:
  a `PagedKV` where the cache resolves to "paged" (`sampler_kv_cache`; num_pages 0 = None, the dense cache's
  memory), None where it resolves to "dense".

  Raises:
    ConfigError: an unknown kv_cache, "paged" without sampling.continuous, a page_size < 1, a num_pages < 0, a
      num_pages set for the dense cache, or a pool too small for one response at the configured lengths (it would
      wait forever).
  """
  kind = sampler_kv_cache(c)
  page_size, num_pages = c.sampling.page_size, c.sampling.num_pages
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
  _need(is_int(page_size) and page_size >= 1, "sampling.page_size", f"must be an int >= 1 (tokens), got {page_size!r}")
  _need(
      is_int(num_pages) and num_pages >= 0,
      "sampling.num_pages",
      f"must be an int >= 0 (pages per layer; 0 = auto), got {num_pages!r}",
  )
  if kind == "dense":
    _need(
        num_pages == 0,
        "sampling.num_pages",
        f"{num_pages} sizes a page pool, but sampling.kv_cache={c.sampling.kv_cache!r} resolves to the "
        "dense cache here, which has none; set sampling.kv_cache=paged (with sampling.continuous=True) or unset it",
    )
    return None
  _need(
      c.sampling.continuous,
      "sampling.kv_cache",
      "'paged' runs the continuous sampler; set sampling.continuous=True or sampling.kv_cache='dense'",
  )
  tokens = c.data.max_prompt_tokens + c.sampling.max_new_tokens - 1  # the last sampled token is never stored
  per_row = -(-tokens // page_size)
  _need(
      num_pages == 0 or num_pages >= per_row,
      "sampling.num_pages",
      f"{num_pages} pages of {page_size} tokens cannot hold one response of data.max_prompt_tokens + "
      f"sampling.max_new_tokens - 1 = {tokens} tokens ({per_row} pages); raise it, or 0 = auto",
  )
  if page_size > tokens:
    logger.warning(
        "sampling.page_size=%d is longer than a whole response (data.max_prompt_tokens + sampling.max_new_tokens "
        "- 1 = %d tokens): every row holds one page with %d unused slots, and the auto pool (num_pages=0) is that "
        "much larger than the dense cache; use pages of at most %d tokens (16-256 are usual)",
        page_size,
        tokens,
        page_size - tokens,
        tokens,
    )
  return PagedKV(page_size=page_size, num_pages=num_pages or None)


def engine_name(c) -> str:
  """The engine `config.sampling` selects: `sampling.engine` when set, else the one `sampling.continuous` and
  `sampling.kv_cache` choose ("static" without continuous; "continuous" for the dense cache; "paged").

  Raises:
    ConfigError: an unknown engine, or sampling.engine set together with a non-default continuous / kv_cache.
  """
  name = c.sampling.engine
  if not name:
    if not c.sampling.continuous:
      return "static"
    return "paged" if sampler_kv_cache(c) == "paged" else "continuous"
  _need(
      name in ENGINES, "sampling.engine", f"{name!r}; choose one of {sorted(ENGINES)}, or '' (by continuous/kv_cache)"
  )
  _need(
      c.sampling.continuous and c.sampling.kv_cache == "auto",
      "sampling.engine",
      f"{name!r} names the engine, so sampling.continuous and sampling.kv_cache must keep their defaults (True, "
      f"'auto'); got {c.sampling.continuous!r}, {c.sampling.kv_cache!r}: unset them, or unset sampling.engine",
  )
  return name


def engine_options(c, paged_kv: PagedKV | None, rows: int):
  """The `Sampler(engine=...)` options of `config.sampling`: the engine of `engine_name` with the fields its
  options take, from `rows` (decode rows) and `paged_kv` (the cache, for an engine with a `kv` field)."""
  cls = ENGINES[engine_name(c)]
  fields = {f.name for f in dataclasses.fields(cls)}
  kw = {k: v for k, v in (("decode_rows", rows), ("kv", paged_kv)) if k in fields and v is not None}
  return cls(**kw)


def sampler_rules_of(c, layout_rules):
  """The sampler's logical-axis rules: those of its layout (`layout_rules`: `INFERENCE_RULES` on its own mesh; None
  on the learner's mesh, which means the learner's `config.mesh.rules`), or `config.sampling.rules` when set (a rule
  set's name, or overrides on the layout's rules).

  Raises:
    ConfigError: naming config.sampling.rules or config.mesh.rules.
  """
  own = layout_rules if layout_rules is not None else parse_rules(c.mesh.rules, "default", "mesh.rules")
  return parse_rules(c.sampling.rules, own, "sampling.rules")


def check_sampling(c) -> None:
  """Every check of `config.sampling` that needs no device: the sampling parameters, the precision and its FP8
  options, the engine, decode rows and the paged cache (`validate_config` runs it).

  Raises:
    ConfigError: naming `config.sampling.<field>` and the fix.
  """
  sampling_params(c, stop_token_ids=())
  _need(
      c.sampling.precision in PRECISIONS, "sampling.precision", f"{c.sampling.precision!r}; choose one of {PRECISIONS}"
  )
  sampler_fp8_options(c)
  sampler_decode_rows(c)
  sampler_paged_kv(c)
  engine_name(c)
  parse_rules(c.sampling.rules, "default", "sampling.rules")


def sampling_params(c, stop_token_ids) -> SamplingParams:
  """The sampler's `SamplingParams` of `config.sampling` (top_k 0 and top_p 1 mean off).

  Raises:
    ConfigError: naming the `config.sampling` field `SamplingParams` refuses.
  """
  s = c.sampling
  try:
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k or None,
        top_p=s.top_p if s.top_p != 1.0 else None,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=tuple(int(i) for i in stop_token_ids),
    )
  except ValueError as e:
    hit = re.search(r"SamplingParams\.(\w+)", str(e))
    raise ConfigError(f"config.sampling.{hit.group(1) if hit else ''}: {e}") from e


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
    c: the run config; model_config: the policy's; paged_kv: `sampler_paged_kv(c)`; prompt_len: the
      longest prompt bucket; the rest as `sampling.rows.resolve_decode_rows`.

  Raises:
    ConfigError: "auto" fits no row (`sampling.rows.auto_decode_rows`).
  """
  value = sampler_decode_rows(c)
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
  """The resolved sampler for the run's log: "paged, kv_cache=auto -> paged (pages of 16, pool auto, kernel
  xla), 64 decode rows" (the engine first) (`sampler_kv_cache` resolves "auto"; rows that are no batch bucket say what they
  round up to)."""
  kind, asked = sampler_kv_cache(c), c.sampling.kv_cache
  cache = f"kv_cache={asked}" + (f" -> {kind}" if asked != kind else "")
  if paged_kv is not None:
    pool = paged_kv.num_pages or "auto"
    cache += f" (pages of {paged_kv.page_size}, pool {pool}, kernel {paged_kv.kernel})"
  mode = engine_name(c)
  bucket = next((b for b in DEFAULT_BATCH_BUCKETS if b >= rows), rows)  # the continuous engines round up
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
  sampler_mesh, sampler_rules = sampler_layout(c.sampling.mesh, mesh, model.config, devices)
  sampler_rules = sampler_rules_of(c, sampler_rules)
  learner_copies = 0 if devices is not None else 1 + optimizer_copies
  paged_kv = paged_kernel(sampler_paged_kv(c), model.config)
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
      **sampler_fp8_options(c),
      engine=engine_options(c, paged_kv, rows),
      mesh=sampler_mesh,
      rules=sampler_rules,
      pad_id=max(tokenizer.pad_id, 0),
      prompt_buckets=prompt_buckets(c.data.max_prompt_tokens),
  )
