"""The sampler's converted parameters (`Sampler.prepare_params`): one record per parameter version, and the
messages that name what differs when a `Sampler` is handed parameters or a record that do not match it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def signature_diff(got: tuple, want: tuple) -> str:
  """Which part of two `PreparedParams.signature`s differs, e.g. "precision ('bf16', this Sampler: 'fp32')"."""
  names = ("precision", "fp8_activations", "fp8_weight_scale", "fp8_format", "fuse_qkv", "layout")
  for name, a, b in zip(names, got, want):
    if a != b:
      return f"{name} ({a!r}, this Sampler: {b!r})"
  got_cfg, want_cfg = got[-1], want[-1]
  fields = [f.name for f in dataclasses.fields(want_cfg) if getattr(got_cfg, f.name) != getattr(want_cfg, f.name)]
  return (
      "ModelConfig ("
      + ", ".join(f"{f}={getattr(got_cfg, f)!r}, this Sampler: {getattr(want_cfg, f)!r}" for f in fields)
      + ")"
  )


def param_shapes(state) -> list[tuple[str, tuple[int, ...]]]:
  """(path, shape) of every parameter array of an nnx State, in tree order (for mismatch messages)."""
  return [
      (jax.tree_util.keystr(k).removesuffix(".value"), x.shape) for k, x in jax.tree_util.tree_leaves_with_path(state)
  ]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedParams:
  """Parameters already converted by `Sampler.prepare_params`: pass them to `generate` any number of times.

  The conversion (precision cast and per-layer copy, step 2 of the module docstring) then runs once per
  parameter version instead of once per `generate` call, like a weight sync to an inference engine. It holds
  one parameter-sized buffer for as long as the object lives.

  Attributes:
    state: the converted `nnx.State` (per-layer layout, the sampler's precision).
    signature: (precision, fp8_activations, fp8_weight_scale, fp8_format, fuse_qkv, layout, ModelConfig) of the
      Sampler that made it (layout: `inference_mesh.layout_name` of its mesh and rules, None on one device);
      `generate` of a Sampler with another signature rejects it.
  """

  state: Any
  signature: tuple
