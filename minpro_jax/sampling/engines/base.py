"""What every sampling engine shares: the `Engine` interface, the `SamplerCore` an engine runs, the `Requests` of one
call, and the registry of engine options by name.

A `Sampler` (the front, `minpro_jax.sampling.sampler`) owns what is the same for every strategy: the precision
cast and layout of the parameters (`prepare_params`), the requests of a call (prompt buckets, row keys, group ids)
and the `GenerationBatch` it returns. An engine owns one decoding strategy and its compiled programs: it takes the
prepared parameters and the call's `Requests` and returns the [N, R] outputs on the devices. Every engine gives
every request the same tokens (its row key and prompt decide them, `sampling.continuous`), so engines differ only
in cost.

Adding an engine (as Tunix adds a rollout engine): one module in `minpro_jax/sampling/engines/` with a frozen
options dataclass decorated by `register_engine("name")`, whose `make(core)` returns an `Engine`, plus its import
line in `engines/__init__.py`. `Sampler(model_config, engine="name")` or `engine=Options(...)` then runs it.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.transformer import KVCache
from minpro_jax.sampling.methods import SamplingParams

ENGINES: dict[str, type] = {}  # engine name -> its options dataclass (`register_engine`)


def register_engine(name: str) -> Callable[[type], type]:
  """Class decorator: registers a frozen options dataclass (with `make(core) -> Engine`) under `name`.

  Raises:
    ValueError: `name` is registered already.
  """

  def add(cls: type) -> type:
    if name in ENGINES:
      raise ValueError(f"sampling engine {name!r} is registered already (by {ENGINES[name].__name__})")
    cls.name = name
    ENGINES[name] = cls
    return cls

  return add


def engine_options(engine: Any) -> Any:
  """The options of `engine`: an engine name (its default options) or an options instance of a registered engine.

  Raises:
    ValueError: an unknown name or an object that is no registered engine's options (naming the engines).
  """
  if isinstance(engine, str):
    if engine not in ENGINES:
      raise ValueError(f"engine={engine!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[engine]()
  if type(engine) not in ENGINES.values():
    raise ValueError(
        f"engine={engine!r}: not a sampling engine's options; pass one of {sorted(ENGINES)} or its options"
    )
  return engine


def bucket(n: int, buckets: Sequence[int]) -> int | None:
  """The smallest of the increasing `buckets` >= n, or None when n exceeds them all."""
  i = bisect.bisect_left(buckets, n)
  return buckets[i] if i < len(buckets) else None


@dataclasses.dataclass(frozen=True, eq=False)
class SamplerCore:
  """What an engine runs, fixed for the sampler's life (built by the `Sampler`).

  config: the sampler's own per-layer inference `ModelConfig` (precision applied, layers unrolled, maybe fused q/k/v).
  graphdef: the `nnx.GraphDef` of that model (`nnx.merge(graphdef, prepared_state)` is the model).
  pad_id: the padding token id.
  batch_buckets: increasing row counts a call's rows are padded to.
  logits_processor: None or a hashable `f(logits [B, V] f32, response index [B] i32, group id [B] i32) -> logits`.
  record_routes: MoE router replay: also return each token's experts.
  mesh, rules: the sampler's device mesh and logical-axis rules (None: one device / the default rules).
  """

  config: ModelConfig
  graphdef: Any
  pad_id: int
  batch_buckets: tuple[int, ...]
  logits_processor: Any = None
  record_routes: bool = False
  mesh: jax.sharding.Mesh | None = None
  rules: Any = None

  def model(self, state):
    """The sampler's model with the prepared parameters `state` (inside a jitted function)."""
    return nnx.merge(self.graphdef, state)

  def prefill_fn(self, model):
    """`f(tokens [M, P], positions [M, P], segment ids [M, P]) -> (last-position logits [M, V], KVCache of P slots)`:
    the prompts of a refill run into a fresh cache (the continuous engines' admission)."""

    def prefill(tokens, positions, segs):
      cache = KVCache.zeros(model.config, tokens.shape[0], tokens.shape[1])
      out = model(tokens, positions, segs, cache=cache, cache_index=0, return_hidden=True)
      return model.logits(out.out[:, -1:])[:, 0], out.cache

    return prefill


@dataclasses.dataclass(frozen=True)
class Requests:
  """The N = prompts x group_size requests of one call, prompt-major, left-padded to the prompt bucket P.

  tokens / segs: [rows, P] int32 numpy, rows = N rounded up to a batch bucket (the rows after N copy the last
    request and are dropped; the static engine runs them, the continuous ones take the first N).
  row_keys: [rows] PRNG keys (request r of group g, sample s: fold_in(fold_in(key(seed), g), s)).
  row_group: [rows] int32 group ids (0 on the padding rows); what a logits processor sees.
  n: N, the real requests. group_size: samples per prompt (consecutive requests).
  """

  tokens: np.ndarray
  segs: np.ndarray
  row_keys: jax.Array
  row_group: np.ndarray
  n: int
  group_size: int = 1

  @property
  def prompt_len(self) -> int:
    return int(self.tokens.shape[1])

  def key_data(self) -> np.ndarray:
    """[N, 2] uint32: the first N row keys' data (what the continuous engines carry)."""
    keys = self.row_keys[: self.n]
    data = jax.random.key_data(keys) if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
    return np.asarray(data).astype(np.uint32)


class Engine(abc.ABC):
  """One decoding strategy bound to a `SamplerCore`: `run` turns prepared parameters and a call's `Requests` into
  the outputs (tokens, logp, entropy, mask [N', R], stopped [N'], routes or None, kept-set thresholds or None), on
  the devices, N' >= N rows of which the first N are the requests'.

  Attributes:
    core: the `SamplerCore`.
    options: the engine's options (a registered options dataclass).
    name: the engine's registered name (its options').
    trace_count: how often the engine's programs were traced (tests assert parameter updates never retrace).
  """

  def __init__(self, core: SamplerCore, options: Any):
    self.core = core
    self.options = options
    self.trace_count = 0

  @property
  def name(self) -> str:
    return type(self.options).name

  def traced(self) -> None:
    """Called inside each of the engine's jitted functions: counts a trace."""
    self.trace_count += 1

  @abc.abstractmethod
  def run(self, state, requests: Requests, sampling: SamplingParams) -> tuple:
    """The outputs of `requests` under the prepared parameters `state` (see the class docstring)."""

  def decode_rows(self, num_requests: int) -> int:
    """The rows a call of `num_requests` requests decodes on at once (the static engine: all of them)."""
    return bucket(num_requests, self.core.batch_buckets) or num_requests
