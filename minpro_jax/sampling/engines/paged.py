"""The paged engine: the continuous engine's loop on a paged KV cache (`minpro_jax.sampling.paged_continuous`: a
refill prefills each waiting prompt once for the samples of its group it admits and shares its full pages; a
decode step allocates a page where a row crosses a page boundary and attends to each row's own pages, the Pallas
kernel on TPU). On a mesh whose "batch" rule has axes that do not split the KV heads, the call splits into row
groups, each with its own rows, pool and requests, in a `jax.shard_map` (`row_groups`). Same responses as the
static engine, token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from minpro_jax.models.rope import rope_tables
from minpro_jax.models.transformer import keys_head_dim_major
from minpro_jax.runtime.multihost import to_host
from minpro_jax.runtime.sharding import constrain
from minpro_jax.sampling import paged
from minpro_jax.sampling import paged_continuous as pc
from minpro_jax.sampling.continuous import init_state
from minpro_jax.sampling.engines.base import Requests, SamplerCore, register_engine
from minpro_jax.sampling.engines.continuous import ContinuousEngineBase, ContinuousOptions
from minpro_jax.sampling.methods import SamplingParams
from minpro_jax.sampling.paged_continuous import PagedKV


@register_engine("paged")
@dataclasses.dataclass(frozen=True)
class Paged(ContinuousOptions):
  """Options of the paged engine: `ContinuousOptions` and the cache, `kv` (a `PagedKV`: page size, pool, kernel).

  Raises:
    ValueError: `kv` is no `PagedKV`.
  """

  kv: PagedKV = PagedKV()

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.kv, PagedKV):
      raise ValueError(f"Paged(kv={self.kv!r}): must be a PagedKV")

  def make(self, core: SamplerCore) -> "PagedEngine":
    return PagedEngine(core, self)


def row_groups(core: SamplerCore, rows: int, num_requests: int) -> tuple[tuple[str, ...], int]:
  """(mesh axes, their size G) a paged call splits into G independent row groups: the axes of the sampler's
  "batch" rule that do not split the KV heads (`paged_continuous.row_group_axes`, size-1 axes included), when G
  divides the rows and the requests; else ((), 1).

  Each group runs its own loop on its own rows / G decode rows, a pool of its own (`PagedKV.group_pool`) and a
  contiguous block of N / G requests, so a chip holds and reads the pages of its own group's rows only (a pool
  shared by every group would be whole on every chip). Responses do not change: each request keeps its key."""
  axes, g = pc.row_group_axes(core.mesh, core.rules)
  return (axes, g) if axes and rows % g == 0 and num_requests % g == 0 else ((), 1)


class PagedEngine(ContinuousEngineBase):
  """The paged continuous loop (see the module docstring).

  Attributes:
    kv: the `PagedKV`.
    program: jitted `(state, (tokens [N, P], segs [N, P], groups [N] i32, keys [N, 2] u32); sampling, p_len, rows,
      refill, unit) -> (*outputs, pool error bits [G] i32)` (public for compile-only tools).
  """

  def __init__(self, core: SamplerCore, options: Paged):
    super().__init__(core, options)
    self.kv = options.kv
    self.program = jax.jit(self._run, static_argnames=("sampling", "p_len", "rows", "refill", "unit"))

  def _loop(self, state, requests, sampling, p_len, rows, refill, unit, num_pages, axes):
    """One row group's fresh pool of `num_pages` pages and `decode_with_refills` over its requests (all of them
    outside a row-group split), in lockstep with the other groups over mesh `axes` (() without a split). Returns
    the [N, R] outputs, routes and the pool's error bits ([1] int32)."""
    core = self.core
    model = core.model(state)
    cfg, r = core.config, sampling.max_new_tokens
    sizes = {**self.kv.pool_sizes(rows, p_len, r), "num_pages": num_pages}
    pool = paged.init_pool(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.jnp_dtype, **sizes
    )
    # the pages split by KV head like the dense cache (and the Pallas kernel's shard_map)
    kv_pages = jax.tree.map(lambda a: constrain(a, ("act_kv_heads", None, None, None)), pool.kv_pages)
    pool = pool._replace(kv_pages=kv_pages)
    st = init_state(cfg, rows, requests[0].shape[0], 1, r, core.pad_id, core.record_routes, sampling.truncates)
    st = st._replace(cache=pool)
    cos_s, sin_s = rope_tables(jnp.arange(p_len + r)[None], cfg)
    kernel = self.kv.kernel_fields(core.mesh)
    record_routes = core.record_routes

    def step_fn(cache, tokens_b, pos_b):
      pos, cache = pos_b[:, None], cache._replace(**kernel)
      out = model(tokens_b[:, None], pos, jnp.ones_like(pos), cache=cache, rope=(cos_s[0][pos], sin_s[0][pos]))
      return out.out[:, 0], out.cache.kv_pages, *((out.routes[:, 0],) if record_routes else ())

    st = pc.decode_with_refills(
        st,
        step_fn,
        core.prefill_fn(model),
        requests,
        refill,
        sampling,
        core.pad_id,
        keys_head_dim_major(cfg.jnp_dtype),
        core.logits_processor,
        unit,
        (lambda x: jax.lax.psum(x.astype(jnp.int32), axes) > 0) if axes else (lambda x: x),
    )
    return *st.outputs(), st.cache.errors[None]

  def _run(self, state, requests, *, sampling: SamplingParams, p_len: int, rows: int, refill: int, unit: int = 1):
    """`_loop` on all rows and requests, or, split into `row_groups`, one `_loop` per group in a `jax.shard_map`
    over the group axes (each with rows / G rows, max(1, refill / G) refill rows and num_pages / G pages), the
    groups in lockstep (`decode_with_refills`' `any_group`: no group runs a collective the others skip). Returns
    the [N, R] outputs, routes and the error bits of each group's pool ([G] int32)."""
    self.traced()
    n = requests[0].shape[0]
    axes, g = row_groups(self.core, rows, n)
    num_pages = self.kv.group_pool(g).pool_sizes(rows // g, p_len, sampling.max_new_tokens)["num_pages"]
    loop = functools.partial(
        self._loop,
        sampling=sampling,
        p_len=p_len,
        rows=rows // g,
        refill=max(1, refill // g),
        unit=unit,
        num_pages=num_pages,
        axes=axes,
    )
    if axes:
      split = P(axes)
      loop = jax.shard_map(
          loop, mesh=self.core.mesh, in_specs=(P(), split), out_specs=split, axis_names=set(axes), check_vma=False
      )
    return loop(state, requests)

  def call_shape(self, requests: Requests, sampling: SamplingParams) -> dict:
    """The static arguments of `program` for `requests`: p_len, rows, refill and the requests per shared prefill
    (`unit`, `paged_continuous.share_unit`, whole units in every row group).

    Raises:
      ValueError: a prompt the pool could never hold (`paged.check_request`, naming `PagedKV.num_pages`).
    """
    n, p_len, r = requests.n, requests.prompt_len, sampling.max_new_tokens
    rows, refill_at = self.rows_and_refill(n)
    g = row_groups(self.core, rows, n)[1]
    kv = self.kv.group_pool(g)  # one row group's pool and rows (all of them without a split)
    sizes = kv.pool_sizes(rows // g, p_len, r)
    shape = jax.eval_shape(lambda: paged.init_pool(num_layers=1, num_kv_heads=1, head_dim=1, **sizes))
    lens = np.maximum(np.sum(np.asarray(requests.segs[:n]) > 0, axis=1), 1)
    paged.check_request(shape, int(lens.max()), max(r - 1, 0))  # the longest prompt: its error names what suffices
    unit = pc.share_unit(kv, requests.group_size, rows // g, lens, p_len, r, max(1, refill_at // g))
    return dict(sampling=sampling, p_len=p_len, rows=rows, refill=refill_at, unit=math.gcd(unit, n // g))

  def run(self, state, requests: Requests, sampling: SamplingParams) -> tuple:
    """The paged call: check every request fits an empty pool, run `program`, raise on a broken pool contract.

    Raises:
      ValueError: a prompt the pool could never hold (`call_shape`).
      RuntimeError: the pool's error bits (a bug: `paged.raise_on_errors`).
    """
    kw = self.call_shape(requests, sampling)
    n = requests.n
    inputs = (requests.tokens[:n], requests.segs[:n], requests.row_group[:n].astype(np.int32), requests.key_data())
    *out, errors = self.program(state, inputs, **kw)
    paged.raise_on_errors(to_host(errors))
    return tuple(out)  # on the devices: the front reads them back (each process its rows, `own_rows`)
