"""Studies: a grid of training runs (configs/studies/), run resumably (`python -m minpro_jax.study`), aggregated
over seeds with confidence intervals (docs/study.md)."""
