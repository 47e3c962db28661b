# MIPU's variants on the embedded default (tiny model, CPU): the config argument picks one.
#
#   python -m minpro_jax.train --config=configs/mipu.py:mipu      # Step 1 + Step 2
#   python -m minpro_jax.train --config=configs/mipu.py:tis       # Step 1 only
#   python -m minpro_jax.train --config=configs/mipu.py:step2     # Step 2 only
#   ... grpo | mis | mis_sequence | mis_geometric | lr_decay | random (minpro_jax/config_lib/mipu_variants.py)
"""The default config with an fp8 sampler and one of MIPU's variants (default: mipu)."""

from minpro_jax.config_lib.defaults import base_config
from minpro_jax.config_lib.mipu_variants import apply_variant


def get_config(arg=None):
  variant = arg or "mipu"
  c = apply_variant(base_config(), variant)
  c.workdir = f"runs/mipu_{variant}"
  return c
