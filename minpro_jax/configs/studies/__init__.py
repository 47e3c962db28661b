"""Study grids (`get_grid(arg=None)` -> `minpro_jax.study.grid.Grid`); run one with
`python -m minpro_jax.study --grid=minpro_jax/configs/studies/NAME.py --workdir=runs/NAME` (docs/study.md)."""
