"""The `Sampler` keyword arguments of a run config: precision, FP8 options, layout, decode rows, prompt buckets.

One place for what the trainer and the standalone evaluation (`minpro_jax.evaluate`) build their samplers from, so
both compile the same programs for the same config.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from minpro_jax import run_config
from minpro_jax.runtime.inference_mesh import sampler_layout
from minpro_jax.sampling.rows import device_hbm_bytes, resolve_decode_rows, tree_bytes_per_device

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def prompt_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  """The prompt lengths the sampler compiles for: the `PROMPT_BUCKETS` below `max_prompt_tokens`, then it."""
  return tuple(b for b in PROMPT_BUCKETS if b < max_prompt_tokens) + (max_prompt_tokens,)


def sampler_kwargs(c, model, tokenizer, mesh, split=None, *, optimizer_copies: int = 2) -> dict[str, Any]:
  """`Sampler(model.config, **sampler_kwargs(...))` for run config `c`.

  Args:
    c: the run config.
    model: the policy `Transformer` (its parameters size the "auto" decode rows).
    tokenizer: the run's tokenizer (its pad id).
    mesh: the learner's mesh, or None; the sampler's own layout comes from `config.sampling.mesh`.
    optimizer_copies: parameter-sized buffers resident beside the sampler besides the parameters (AdamW's 2
      moments in training, 0 for an evaluation on its own).
    split: the run's `device_split.DeviceSplit` (`config.sampling.devices`), or None (the sampler uses the
      learner's devices). With one, the sampler's layout spans its own devices, with no learner state beside it.
  """
  devices = None if split is None else split.sampler
  sampler_mesh, sampler_rules = sampler_layout(c.sampling.get("mesh", ""), mesh, model.config, devices)
  learner_copies = 0 if devices is not None else 1 + optimizer_copies
  decode_rows = resolve_decode_rows(  # "auto": as many as fit beside the weights (and the learner's state)
      run_config.sampler_decode_rows(c),
      model.config,
      precision=c.sampling.precision,
      slots=c.data.max_prompt_tokens + c.sampling.max_new_tokens,
      mesh=sampler_mesh,
      rules=sampler_rules,
      hbm_bytes=device_hbm_bytes(jax.local_devices()),
      other_resident_bytes=learner_copies * tree_bytes_per_device(nnx.state(model, nnx.Param)),
  )
  return dict(
      precision=c.sampling.precision,
      **run_config.sampler_fp8_options(c),
      continuous=c.sampling.continuous,
      decode_rows=decode_rows,
      mesh=sampler_mesh,
      rules=sampler_rules,
      pad_id=max(tokenizer.pad_id, 0),
      prompt_buckets=prompt_buckets(c.data.max_prompt_tokens),
  )
