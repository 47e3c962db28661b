"""The sampling engines, one module each, registered by name (`base.ENGINES`): `static`, `continuous` (the
default), `host_refill` and `paged`. `Sampler(model_config, engine=...)` takes a name or an engine's options."""

from minpro_jax.sampling.engines.base import ENGINES, Engine, Requests, SamplerCore, engine_options, register_engine
from minpro_jax.sampling.engines.continuous import Continuous
from minpro_jax.sampling.engines.host_refill import HostRefill
from minpro_jax.sampling.engines.paged import Paged
from minpro_jax.sampling.engines.static import Static

__all__ = [
    "ENGINES",
    "Continuous",
    "Engine",
    "HostRefill",
    "Paged",
    "Requests",
    "SamplerCore",
    "Static",
    "engine_options",
    "register_engine",
]
