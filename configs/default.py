# The embedded default: a tiny Qwen3-style model trained from scratch on reasoning-gym arithmetic.
#
#   make train            # == python -m minpro_jax.train --config=configs/default.py
#
# Pipeline: train a sentencepiece tokenizer on the task corpus, SFT warm start (cached), then MinPRO with
# rollouts delayed by 2 global steps (4 updates per step, so staleness 8..11 updates after warm-up).
# Expected on a 2-core CPU: about 4.5 minutes after the install (SFT ~2 of them, cached for later runs; RL ~2.3 s
# per step); held-out pass@1 14.4% after SFT, 26.7% final (AMD EPYC, 2026-12-07, 9fe40a0; README "Results" has
# each CPU type).
# Output: runs/default/.
"""Default experiment config: every field at its default (the fields and their defaults are in
minpro_jax/config_lib/defaults.py, which the package carries; docs/configs.md explains them)."""

from minpro_jax.config_lib.defaults import base_config


def get_config():
  return base_config()
