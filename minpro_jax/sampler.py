"""Short import path for the generation side (`minpro_jax.sampling`)."""

from minpro_jax.sampling import *  # noqa: F401,F403
from minpro_jax.sampling import __all__  # noqa: F401
