"""Experiment configs (ml_collections); run one with `python -m minpro_jax.train --config=minpro_jax/configs/NAME.py`."""
