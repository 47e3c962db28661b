"""A parameter pytree saved to and restored from an orbax folder (the SFT warm-start cache, the best parameters'
template): shapes, dtypes and shardings come from a template."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
  """`tree` with every array replaced by its `jax.ShapeDtypeStruct` (shape, dtype, sharding): a restore target."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def save_params(path: str, params: Any) -> None:
  """Saves a parameter pytree (e.g. the SFT warm-start cache) to `path` with orbax."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.abspath(path), params, force=True)
  ckptr.wait_until_finished()


def restore_params(path: str, params_template: Any) -> Any:
  """Restores a parameter pytree saved by `save_params` onto the template's shapes/dtypes/shardings."""
  return ocp.StandardCheckpointer().restore(os.path.abspath(path), abstract_like(params_template))
