"""Logical-axis rules as config: named rule sets and inline overrides (`config.mesh.rules` for the learner,
`config.sampling.rules` for the sampler), so a sharding sweep varies them from the command line, as MaxText keeps
its `logical_axis_rules` in config.

A spec is a rule set's name, or overrides on one: `"NAME"`, `"NAME:logical=axis+axis,logical=,..."` or
`"logical=axis,..."` (on the field's default set). An override maps a logical axis (a name of `DEFAULT_RULES`,
e.g. `mlp`, `embed`, `batch`) to mesh axes joined by `+` (`data`, `fsdp`, `tensor`, `expert`), or to nothing
(`mlp=`: replicated). Examples: `--config.mesh.rules=default:mlp=fsdp,q_heads=fsdp,kv_heads=fsdp` (no tensor split
of the weights); `--config.sampling.rules=inference:vocab=` (the sampler's layout with the vocabulary whole).
"""

from __future__ import annotations

from minpro_jax.errors import ConfigError
from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
from minpro_jax.runtime.sharding import DEFAULT_RULES, MESH_AXES

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

RULE_SETS: dict[str, Rules] = {
    "default": DEFAULT_RULES,  # the learner's: batch over data x fsdp x expert, weights over fsdp and tensor
    "inference": INFERENCE_RULES,  # the sampler's own layout: batch over data, weights over tensor only
}
LOGICAL_AXES = tuple(name for name, _ in DEFAULT_RULES)


def parse_rules(spec: str, default: str | Rules, field: str) -> Rules:
  """The rules of `spec` (see the module docstring); "" is `default`.

  Args:
    spec: the config value.
    default: what an empty spec, or overrides without a name, start from: a rule set's name or a rules table.
    field: the config field, named in errors (e.g. "mesh.rules").

  Raises:
    ConfigError: an unknown rule set, logical axis or mesh axis, a mesh axis named twice in one rule, or an
      override without "=" (naming `config.<field>` and the choices).
  """
  if not isinstance(spec, str):
    raise ConfigError(f"config.{field}: must be a string (a rule set's name or overrides), got {spec!r}")
  spec = spec.strip()
  name, sep, overrides = spec.partition(":")
  if not sep and "=" in name:
    name, overrides = "", name
  name = name.strip()
  if not name and not isinstance(default, str):
    table = dict(default)
  else:
    name = name or default
    if name not in RULE_SETS:
      raise ConfigError(
          f"config.{field}: rule set {name!r} is unknown; choose one of {sorted(RULE_SETS)} (docs/aot.md)"
      )
    table = dict(RULE_SETS[name])
  for item in filter(None, (x.strip() for x in overrides.split(","))):
    logical, eq, axes = item.partition("=")
    logical = logical.strip()
    if not eq:
      raise ConfigError(f"config.{field}: {item!r} is no override; write logical=axis[+axis] or logical= (replicated)")
    if logical not in LOGICAL_AXES:
      raise ConfigError(f"config.{field}: {logical!r} is no logical axis; choose one of {list(LOGICAL_AXES)}")
    names = tuple(a.strip() for a in axes.split("+") if a.strip())
    bad = [a for a in names if a not in MESH_AXES]
    if bad:
      raise ConfigError(f"config.{field}: {logical}={axes}: {bad[0]!r} is no mesh axis; choose from {MESH_AXES}")
    if len(set(names)) != len(names):
      raise ConfigError(f"config.{field}: {logical}={axes} names a mesh axis twice; name each once")
    table[logical] = None if not names else names[0] if len(names) == 1 else names
  return tuple(table.items())


def rules_name(rules: Rules | None) -> str:
  """A short name of `rules` for logs and reports: the rule set's name, or "custom"; None is "default"."""
  table = tuple(rules or DEFAULT_RULES)
  return next((n for n, r in RULE_SETS.items() if r == table), "custom")
