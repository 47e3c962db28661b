"""The sampler's own layout: a `data` x `tensor` mesh over the learner's devices, its logical-axis rules, and the
reshard of the learner's parameters into it.

The learner shards weights ZeRO-3 style (`fsdp` on their embed dimension, `runtime/sharding.py`). A decode step on
that layout gathers every weight matrix once per generated token (or, where XLA hoists the gathers out of the
loop, holds all of them on every device). The sampler's layout instead keeps weights resident (MaxText's RL:
"FSDP for training and DP + TP for inference"; verl's hybrid engine):

* mesh axes `data` and `tensor` only (`INFERENCE_AXES`), over the same devices as the learner's mesh, in the same
  order (tensor the fastest-varying, so a tensor group is consecutive devices, i.e. one host's chips);
* `INFERENCE_RULES`: weights split over `tensor` by heads (`q_heads`, `kv_heads`), FFN width (`mlp`) and
  vocabulary, replicated over `data` (no `embed` split, so no weight gather in the decode loop); the batch
  (decode rows, KV cache) split over `data`;
* `reshard`: the converted parameters moved into that layout once per parameter version, one layer at a time.

Config: `config.sampling.mesh` (`parse_sampling_mesh`), "" = the learner's mesh and rules (no reshard).
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minpro_jax.errors import ConfigError
from minpro_jax.runtime.sharding import DEFAULT_RULES, logical_to_spec, make_mesh

INFERENCE_AXES = ("data", "tensor")

# Logical axis -> mesh axis of the sampler's layout: `sharding.DEFAULT_RULES` less every fsdp / expert split (batch
# over data only; weights replicated on their embed dimension and over experts).
_INFERENCE_CHANGES = {"batch": "data", "embed": None, "expert": None}
INFERENCE_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = tuple(
    (name, _INFERENCE_CHANGES.get(name, axis)) for name, axis in DEFAULT_RULES
)


def _fail(msg: str) -> None:
  raise ConfigError(f"config.sampling.mesh: {msg}")


def auto_shape(num_devices: int, num_kv_heads: int, local_devices: int | None = None) -> dict[str, int]:
  """The "auto" inference mesh: `tensor` = the largest divisor of `num_kv_heads` that also divides the devices of
  one process (`local_devices`, default `jax.local_device_count()`, capped at `num_devices`), so a tensor group
  stays on one host; `data` = the rest. No memory model: weights are assumed to fit on one tensor group.

  Example: 8 KV heads on a v5p-64 (4 chips per host) -> {"data": 16, "tensor": 4}; on cpu:8 -> {"data": 1,
  "tensor": 8}; 2 KV heads on cpu:8 -> {"data": 4, "tensor": 2}.
  """
  local = min(num_devices, local_devices or jax.local_device_count())
  tensor = max(t for t in range(1, local + 1) if num_kv_heads % t == 0 and local % t == 0 and num_devices % t == 0)
  return {"data": num_devices // tensor, "tensor": tensor}


def parse_sampling_mesh(
    spec: str,
    num_devices: int,
    num_heads: int | None,
    num_kv_heads: int | None,
    local_devices: int | None = None,
) -> dict[str, int] | None:
  """The sampler's mesh shape of `config.sampling.mesh`.

  Args:
    spec: "" (the learner's mesh: returns None), "auto" (`auto_shape`) or sizes like "tensor=4" / "data=4,tensor=2"
      (absent axes are 1; one size may be -1 = the remaining devices).
    num_devices: the devices the sampler's mesh spans: the learner mesh's, or its own (`config.sampling.devices`).
    num_heads, num_kv_heads: the model's attention and KV heads (`tensor` must divide both; None: not checked,
      and "auto" then refused).
    local_devices: devices per process (for "auto"; default `jax.local_device_count()`).

  Returns:
    {"data": d, "tensor": t} with d * t == num_devices, or None for "".

  Raises:
    ConfigError: naming `config.sampling.mesh` and the fix (a part that does not parse, an axis other than
      data / tensor, sizes that do not multiply to `num_devices`, a tensor size that does not divide the heads).
  """
  spec = (spec or "").strip()
  if not spec:
    return None
  if spec == "auto":
    if num_kv_heads is None:
      _fail("'auto' needs the model's KV-head count")
    return auto_shape(num_devices, num_kv_heads, local_devices)
  shape: dict[str, int] = {}
  for part in spec.split(","):
    name, _, size = (s.strip() for s in part.partition("="))
    if not name or re.fullmatch(r"-?[0-9]+", size) is None:
      _fail(f"cannot parse {part!r} of {spec!r}; write e.g. 'tensor=4' or 'data=4,tensor=2' (or 'auto', or '')")
    if name not in INFERENCE_AXES:
      _fail(
          f"unknown axis {name!r} in {spec!r}; the sampler's mesh has axes {INFERENCE_AXES} (weights split over "
          "tensor, replicated over data; fsdp and expert are the learner's, config.mesh.shape)"
      )
    if name in shape:
      _fail(f"{spec!r} gives axis {name!r} twice; give each axis once")
    shape[name] = int(size)
  if list(shape.values()).count(-1) > 1 or any(v < 1 and v != -1 for v in shape.values()):
    _fail(f"{spec!r}: sizes must be >= 1, with at most one -1 (= the remaining devices)")
  known = math.prod(v for v in shape.values() if v != -1)
  if -1 in shape.values():
    if num_devices % known:
      _fail(
          f"{spec!r}: the fixed sizes ({known}) do not divide the sampler's {num_devices} devices (the learner mesh's, "
          "or config.sampling.devices); on a smaller slice give a smaller tensor, or 'auto'"
      )
    shape = {a: num_devices // known if v == -1 else v for a, v in shape.items()}
  out = {"data": shape.get("data", 1), "tensor": shape.get("tensor", 1)}
  n, t = out["data"] * out["tensor"], out["tensor"]
  if n != num_devices:
    hint = f", e.g. 'data={num_devices // t},tensor={t}'" if num_devices % t == 0 else ""
    _fail(
        f"{spec!r} spans {n} devices, but the sampler's mesh spans {num_devices} (the learner mesh's, "
        f"config.mesh.shape, or its own, config.sampling.devices); make data * tensor = {num_devices}{hint}"
    )
  if num_heads is not None and num_kv_heads is not None and (num_heads % t or num_kv_heads % t):
    divisors = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0 and num_heads % d == 0]
    _fail(
        f"tensor={t} does not divide the model's {num_heads} attention heads and {num_kv_heads} KV heads; "
        f"choose tensor in {divisors} (or 'auto')"
    )
  return out


def inference_mesh(shape: dict[str, int], devices: Sequence[jax.Device]) -> Mesh:
  """A ("data", "tensor") mesh of `shape` over `devices` in their order (tensor fastest)."""
  return make_mesh(shape, axis_names=INFERENCE_AXES, devices=devices)


def sampler_layout(
    spec: str, learner_mesh: Mesh | None, model_config, devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh | None, Any]:
  """(mesh, rules) the trainer builds its `Sampler` with for `config.sampling.mesh`.

  "" gives the learner's own (mesh, None = its default rules), today's layout. Otherwise the sampler's mesh spans
  the learner mesh's devices in their order (one device, the default one, without a learner mesh), with
  `INFERENCE_RULES`; "auto" keeps a tensor group within the devices of one process (those of the mesh's first
  device's process, so a compile-only TPU slice is laid out as on its hosts). With `devices` (the sampler's own,
  `config.sampling.devices`: `device_split.split_devices`) the mesh spans those instead, and "" means "auto".

  Raises:
    ConfigError: as `parse_sampling_mesh`.
  """
  if devices is not None:
    spec = spec or "auto"
  elif learner_mesh is not None:
    devices = list(learner_mesh.devices.flat)
  else:
    devices = jax.devices()[:1]
  devices = list(devices)
  # one process's devices: counted on the mesh (a compile-only TPU topology's hosts are not this process)
  local = sum(d.process_index == devices[0].process_index for d in devices)
  shape = parse_sampling_mesh(spec, len(devices), model_config.num_heads, model_config.num_kv_heads, local)
  if shape is None:
    return learner_mesh, None
  return inference_mesh(shape, devices), INFERENCE_RULES


def layout_name(mesh: Mesh | None, rules) -> str | None:
  """A short name of a sampler's layout, e.g. "data=4,tensor=2 (sampler rules)"; None without a mesh."""
  if mesh is None:
    return None
  sizes = ",".join(f"{a}={n}" for a, n in mesh.shape.items())
  table = tuple(rules or DEFAULT_RULES)
  kind = {DEFAULT_RULES: "learner rules", INFERENCE_RULES: "sampler rules"}.get(table, f"rules {table}")
  return f"{sizes} ({kind})"


def _resolve(spec: P, shape: tuple[int, ...], mesh: Mesh, rules) -> P:
  """A parameter's `PartitionSpec` of logical names resolved to `mesh` axes by `rules`: axes the mesh lacks or has
  of size 1 dropped, a dimension whose size the remaining axes do not divide kept whole, a mesh axis used once,
  trailing Nones cut."""
  used: set[str] = set()
  out = []
  for size, entry in zip(shape, logical_to_spec(tuple(spec) + (None,) * (len(shape) - len(spec)), rules)):
    names = tuple(
        a
        for a in ((entry,) if isinstance(entry, str) else entry or ())
        if a in mesh.shape and mesh.shape[a] > 1 and a not in used
    )
    if not names or size % math.prod(mesh.shape[a] for a in names):
      out.append(None)
      continue
    used.update(names)
    out.append(names[0] if len(names) == 1 else names)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules) -> dict[str, NamedSharding]:
  """{key path: `NamedSharding`} of every parameter of `abstract_state` (from `nnx.eval_shape` of the model the
  sampler runs: its Variables carry logical axis names) on `mesh` by `rules` (`_resolve`)."""
  specs = nnx.get_partition_spec(abstract_state)
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  spec_leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec)
  shapes = [x.shape for x in jax.tree.leaves(abstract_state)]
  return {
      jax.tree_util.keystr(path): NamedSharding(mesh, _resolve(spec, shape, mesh, rules))
      for (path, spec), shape in zip(spec_leaves, shapes)
  }


def _chunk(path) -> Any:
  """The chunk a parameter moves in: its layer index for `layers[i]...`, else None (embedding, norms, head)."""
  first = path[0] if path else None
  if getattr(first, "key", None) == "layers" and len(path) > 1:
    return getattr(path[1], "key", None)
  return None


def reshard(state: nnx.State, shardings: dict[str, NamedSharding]) -> nnx.State:
  """`state` (a per-layer parameter State on any layout over the same devices) moved to `shardings`
  (`param_shardings`), one chunk at a time: each layer's parameters, then the rest, with a wait after each
  (`jax.device_put`, a no-op for a leaf already so laid out).

  Memory: the result is one parameter copy in the new layout. Nothing here frees `state`; its arrays go when the
  caller drops them, so peak memory is the input plus the result plus one chunk's transfer buffers. XLA's SPMD
  partitioner moves some splits (e.g. fsdp on the embed dimension to tensor on the vocabulary) by gathering the
  array whole first ("involuntary full rematerialization"), so that transient can be one layer's weights, unsplit,
  per device: the reason for the chunks.

  Raises:
    KeyError: a parameter that `shardings` does not name (a State of another model).
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  out = [x for _, x in leaves]
  chunks: dict[Any, list[int]] = {}
  for i, (path, _) in enumerate(leaves):
    chunks.setdefault(_chunk(path), []).append(i)
  for idx in chunks.values():
    placed = jax.device_put([out[i] for i in idx], [shardings[jax.tree_util.keystr(leaves[i][0])] for i in idx])
    jax.block_until_ready(placed)
    for i, x in zip(idx, placed):
      out[i] = x
  return jax.tree.unflatten(treedef, out)
