"""One-off experiments of the mechanism studies (docs/mechanism.md): gradient fidelity on an exact toy and on the
model (`fidelity_*`), the MIPU power study (`mipu_power*`), their shared settings and the gradient probe
(`policy_gradient`). They use the library; no module outside `minpro_jax.lab` imports them (tests/test_layers.py),
as big_vision's core never imports its `proj/`."""
