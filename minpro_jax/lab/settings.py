"""The tasks the mechanism studies run on (docs/mechanism.md): the config fields each puts on the MIPU study's
fixed fields (`configs/studies/mipu.py`: the staleness setting at delay 0, GRPO).

  * ``short``: the MIPU study's own task (three-term chain_sum, answers of ~6 tokens; T ~ 6);
  * ``worked``: the long-response study's (`configs/studies/minpro_long.py`'s FIXED: eight-term chain_sum, worked-step
    SFT target, 128 new tokens, answers of ~60 tokens; T ~ 70) at its learning rate.
"""

from __future__ import annotations

from minpro_jax.config_lib.files import load_module

SETTINGS = ("short", "worked")  # the task: the MIPU study's (T ~ 6) | minpro_long.py's worked steps (T ~ 70)


def setting_overrides(setting: str) -> dict:
  """The config fields `setting` (one of `SETTINGS`) puts on the MIPU study's fixed fields.

  Raises:
    ValueError: an unknown setting, naming the choices; for ``worked``, minpro_long.py's placeholder rate.
  """
  if setting not in SETTINGS:
    raise ValueError(f"setting {setting!r}; choose one of {SETTINGS}")
  if setting == "short":
    return {}

  long = load_module("configs/studies/minpro_long.py")
  return {**long.FIXED, "optimizer.learning_rate": long.chosen_rate()}
