"""What the experiment configs build on: the defaults (`defaults.base_config`), MIPU's variants, the paper-scale
settings, and finding and loading config files (`files`).

The configs themselves live in the repository's `configs/` (docs/configs.md); run one with
`python -m minpro_jax.train --config=configs/NAME.py`. Importing this package imports no JAX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def set_fields(config, fields: Mapping[str, Any]):
  """Sets dotted fields ({"loss.tis_cap": 2.0, ...}) of an ml_collections ConfigDict in place; returns it.

  Raises:
    KeyError / AttributeError: from ml_collections, for a group that does not exist (a locked config also refuses
      a new leaf).
  """
  for field, value in fields.items():
    *groups, leaf = field.split(".")
    node = config
    for g in groups:
      node = node[g]
    node[leaf] = value
  return config
