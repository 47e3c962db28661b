"""Sizes known at config time against the memory the run will have, before the SFT warm start and the first sample.

The sampler's KV cache is the one buffer whose size the config fields set directly: `sampling.num_pages` x
`sampling.page_size` tokens for the paged cache's pool (per layer), a page per decode row for the paged cache's
smallest pool, and `sampling.decode_rows` x (`data.max_prompt_tokens` + `sampling.max_new_tokens`) tokens for the
dense one. A field that makes one such buffer larger than all the memory of the run (a typo, `1e9`) would build the
model and run SFT, then fail at the first sample with XLA's RESOURCE_EXHAUSTED; `check_sizes_fit` says which field
at setup. It is a bound, not a fit: the weights, the optimizer and the activations come on top, so a run that passes
may still run out of memory (`sampling.decode_rows=auto` sizes the rows by what is left).
"""

from __future__ import annotations

from minpro_jax.errors import ConfigError
from minpro_jax.run import sampler_setup


def kv_bytes_per_token(model_config) -> int:
  """Bytes of the K and V cache one token takes over every layer (the cache holds the compute dtype)."""
  itemsize = 2 if "bfloat16" in str(model_config.dtype) else 4
  return int(model_config.num_layers) * 2 * int(model_config.num_kv_heads) * int(model_config.head_dim) * itemsize


def sampler_buffers(c, model_config) -> list[tuple[str, int, str, str]]:
  """(field, bytes, what, fix) of each buffer the config's sampling fields size."""
  per_token = kv_bytes_per_token(model_config)
  tokens = int(c.data.max_prompt_tokens) + int(c.sampling.max_new_tokens)
  rows = sampler_setup.sampler_decode_rows(c)
  rows = rows if isinstance(rows, int) else 1  # "auto" sizes them by the memory: at least one
  out = []
  if sampler_setup.sampler_kv_cache(c) == "paged":
    page, pages = int(c.sampling.page_size), int(c.sampling.num_pages)
    if pages:
      what = f"the KV page pool of {pages} pages x {page} tokens ({per_token} bytes per token over the layers)"
      out.append(("sampling.num_pages", pages * page * per_token, what, "lower it (0 = sized like the dense cache)"))
    what = f"a pool with one page of {page} tokens per decode row ({rows} rows, {per_token} bytes per token)"
    out.append(("sampling.page_size", rows * page * per_token, what, "use 16..256 tokens per page"))
  else:
    what = (
        f"the dense KV cache of {rows} decode rows x {tokens} tokens (data.max_prompt_tokens + "
        f"sampling.max_new_tokens; {per_token} bytes per token)"
    )
    field = "sampling.decode_rows" if rows > 1 else "sampling.max_new_tokens"
    out.append((field, rows * tokens * per_token, what, "lower the rows or the lengths"))
  return out


def _gb(n: float) -> str:
  return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def check_sizes_fit(c, model_config, memory: int | None, where: str) -> None:
  """Raises ConfigError naming the field when one buffer it sizes is larger than `memory` bytes (`where`: what that
  memory is, e.g. "this machine's memory"); nothing is checked when `memory` is None (unknown)."""
  if not memory:
    return
  for field, nbytes, what, fix in sampler_buffers(c, model_config):
    if nbytes > memory:
      raise ConfigError(f"config.{field}: {what} needs {_gb(nbytes)}, more than the {_gb(memory)} of {where}; {fix}")
