"""Study grids: a Python file with `get_grid(arg=None) -> Grid`, expanded into named training runs.

A grid names a base config (`path[:arg]`, as `--config=` takes it), overrides shared by every run (`fixed`), axes
crossed in order (`axes`: field -> values), named sets of overrides (`variants`: a method that sets several fields,
crossed as the first axis, "variant"), explicit extra cells (`cells`: override dicts, e.g. an ablation only at the
largest delay) and the seeds. Each (cell, seed) is one run of `python -m minpro_jax.train` in its own workdir,
named from its overrides: `loss.method=grpo,delay=8,seed=1` -> `method-grpo_delay-8_seed-1`.

Runs are ordered seed-major (every cell at seed 0, then every cell at seed 1, ...), so a study stopped half way
has whole seeds of the grid rather than all seeds of half the cells.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minpro_jax.config_lib import files
from minpro_jax.errors import UserError

REPO = files.REPO
# Fields the runner sets itself: a grid that sets them would give two runs one workdir or one seed.
RESERVED_FIELDS = ("workdir", "seed")
VARIANT = "variant"  # the cell field that names one of `Grid.variants`
_SCALAR = (bool, int, float, str)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9.+=-]")


class GridError(UserError, ValueError):
  """A grid file is invalid; the message names the grid field (`grid.axes`, `grid.cells[2]`, ...) and the fix."""


@dataclasses.dataclass(frozen=True)
class Grid:
  """What a grid file's `get_grid(arg)` returns.

  Attributes:
    base: the base config, `path[:arg]` as `--config=` takes it; a relative path is looked up in the current
      directory, then in the repository root.
    axes: dotted config field -> the values it takes; the cells are the product of the axes, first axis slowest.
    seeds: the seeds every cell runs with (`--config.seed`).
    fixed: dotted config field -> value, for every run (not part of the run names).
    variants: optional variant name -> its overrides (field -> value): the cells gain a first axis "variant" over
      these names (`variant-<name>` in the run names; `comparisons` and `panel` may name it); a run gets its
      variant's overrides, not named. For methods that are several fields at once (MIPU's Step 1 + Step 2).
    cells: explicit cells besides the product: each an override dict (every field of it named in the run name);
      with `variants`, a cell may set "variant" to one of their names.
    derived: optional function of a run's cell overrides plus its "seed" -> more overrides for that run (not
      named), e.g. `total_steps` from `delay`, so that every delay makes the same number of updates, or the
      sibling run a run reads (`mipu.match_rate_of`).
    comparisons: (field, reference value) pairs: the aggregation reports, for every cell whose `field` is set to
      another value, the paired difference reference - cell over the seeds both ran, the reference cell being the
      same overrides with `field` set to the reference value (or absent from them). A third element, a tuple of
      values, keeps only the cells whose `field` is one of them: ("variant", "mipu", ("tis", "random")) reports
      mipu - tis and mipu - random alone.
    contrasts: (field, reference value, across, base value) tuples: the aggregation reports, for every cell whose
      `field` and `across` are set to other values, the difference in differences (cell - reference at its
      `across`) - (cell - reference at `across` = base) seed by seed (`contrasts.difference_in_differences`), e.g.
      ("loss.method", "grpo", "delay", 0): the part of each method's gap to GRPO that staleness adds.
    panel: a field with one plot panel per value (e.g. "delay"); None = one panel.
    description: one line for the study's summary.
  """

  base: str
  axes: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
  seeds: Sequence[int] = (0,)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  cells: Sequence[Mapping[str, Any]] = ()
  derived: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
  comparisons: Sequence[tuple[str, Any] | tuple[str, Any, tuple[Any, ...]]] = ()
  contrasts: Sequence[tuple[str, Any, str, Any]] = ()
  panel: str | None = None
  description: str = ""


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of a study.

  Attributes:
    name: the run's directory name under the study workdir, e.g. "method-grpo_delay-8_seed-1".
    cell: the cell's named overrides, ((field, value), ...) in grid order (no seed).
    seed: `config.seed`.
    extra: the overrides of `Grid.derived` for the cell, ((field, value), ...) (not in the name).
  """

  name: str
  cell: tuple[tuple[str, Any], ...]
  seed: int
  extra: tuple[tuple[str, Any], ...] = ()

  @property
  def label(self) -> str:
    """The overrides as one readable line: "loss.method=grpo,delay=8,seed=1"."""
    return ",".join(f"{k}={v}" for k, v in (*self.cell, ("seed", self.seed)))

  @property
  def cell_name(self) -> str:
    """The name without its seed part: the same for every seed of a cell."""
    return self.name.rsplit("_seed-", 1)[0]

  def to_json(self) -> dict[str, Any]:
    return {
        "name": self.name,
        "cell": [list(kv) for kv in self.cell],
        "seed": self.seed,
        "extra": [list(kv) for kv in self.extra],
    }

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Run":
    return cls(
        name=d["name"],
        cell=tuple((k, tuplify(v)) for k, v in d["cell"]),
        seed=int(d["seed"]),
        extra=tuple((k, tuplify(v)) for k, v in d.get("extra", ())),
    )


def tuplify(v: Any) -> Any:
  """A JSON list as a tuple (the value a grid gave); anything else as it is."""
  return tuple(v) if isinstance(v, list) else v


# ------------------------------------------------------------------------------------------------ loading
def split_spec(spec: str) -> tuple[str, str | None]:
  """ "path.py:arg" -> ("path.py", "arg"); "path.py" -> ("path.py", None)."""
  path, sep, arg = spec.partition(":")
  return path, (arg if sep else None)


def resolve_path(path: str) -> str | None:
  """`path` if it exists (absolute or from the current directory), else from the repository root, else None; a
  path into the configs' old folder `minpro_jax/configs/` finds the file in `configs/` (`config_lib.files`)."""
  return files.resolve(path)


def load_grid(spec: str) -> Grid:
  """The `Grid` of `--grid=path[:arg]`: the file's `get_grid(arg)` (`get_grid()` without an arg).

  Raises:
    GridError: the file is missing or has no `get_grid`, or `get_grid` fails or returns no `Grid` (or dict of its
      fields), or the grid is malformed (see `check_grid`).
  """
  path, arg = split_spec(spec)
  found = resolve_path(path)
  if found is None:
    where = " or ".join(dict.fromkeys((os.getcwd(), REPO)))  # the repository root once when it is the cwd
    raise GridError(f"--grid={spec}: no such file {path!r} (from {where}); pass a grid .py file")
  mod_spec = importlib.util.spec_from_file_location(f"minpro_study_grid_{abs(hash(found))}", found)
  mod = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(mod)
  except Exception as e:  # noqa: BLE001 - a grid file that does not import is the user's file: name it
    raise GridError(f"--grid={spec}: the file does not load ({type(e).__name__}: {e})") from e
  if not callable(getattr(mod, "get_grid", None)):
    raise GridError(f"--grid={spec}: the file has no get_grid(arg=None) function; define one returning a Grid")
  try:
    grid = mod.get_grid(arg) if arg is not None else mod.get_grid()
  except Exception as e:  # noqa: BLE001 - e.g. a KeyError for an argument the grid does not know: name it
    takes = (mod.get_grid.__doc__ or "").strip().splitlines()[:1]
    raise GridError(
        f"--grid={spec}: get_grid({arg!r}) failed ({type(e).__name__}: {e}); pass an argument the grid file takes "
        f"after the ':'{' (' + takes[0] + ')' if takes else ''}, or none"
    ) from e
  if isinstance(grid, Mapping):
    unknown = sorted(set(grid) - {f.name for f in dataclasses.fields(Grid)})
    if unknown:
      raise GridError(f"--grid={spec}: get_grid returned unknown keys {unknown}; a Grid has {_grid_fields()}")
    grid = Grid(**grid)
  if not isinstance(grid, Grid):
    raise GridError(f"--grid={spec}: get_grid returned a {type(grid).__name__}; return a minpro_jax.study.grid.Grid")
  try:
    check_grid(grid)
  except GridError as e:
    raise GridError(f"--grid={spec}: {e}") from e
  return grid


def _grid_fields() -> list[str]:
  return [f.name for f in dataclasses.fields(Grid)]


def _check_value(where: str, field: str, value: Any, *, scalar: bool) -> None:
  ok = isinstance(value, _SCALAR) or (
      not scalar and isinstance(value, (tuple, list)) and all(isinstance(x, _SCALAR) for x in value)
  )
  if not ok:
    kinds = "bool, int, float or str" + ("" if scalar else " (or a tuple of them)")
    hint = "; to keep the base config's value, leave the field out" if value is None else ""
    raise GridError(f"{where}: {field}={value!r} is of type {type(value).__name__}; a value must be a {kinds}{hint}")


def check_grid(grid: Grid) -> None:
  """Checks the grid's own structure (the fields against a config: `check_fields`).

  Raises:
    GridError: naming the grid field: no cells, a reserved field (workdir, seed), a field in both `fixed` and
      `axes`, an empty axis, a value that is not a bool/int/float/str (tuples allowed in `fixed`), a repeated value
      or seed, a cell repeated, a `comparisons`, `contrasts` entry or `panel` naming a field or value of no cell.
  """
  if not isinstance(grid.base, str) or not grid.base:
    raise GridError("grid.base: must be the base config path[:arg], e.g. 'configs/default.py'")
  for name in ("axes", "fixed"):
    if not isinstance(getattr(grid, name), Mapping):
      kind = "list of values" if name == "axes" else "value"
      raise GridError(f"grid.{name}: must be a dict field -> {kind}, got a {type(getattr(grid, name)).__name__}")
  if isinstance(grid.seeds, (str, bytes)) or not isinstance(grid.seeds, Sequence):
    raise GridError(
        f"grid.seeds: must be a tuple of ints, got the {type(grid.seeds).__name__} {grid.seeds!r}; write e.g. "
        "seeds=(0,) for one seed or seeds=(0, 1, 2) for three"
    )
  seeds = list(grid.seeds)
  if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
    raise GridError(f"grid.seeds: must be a non-empty list of ints, got {grid.seeds!r}")
  if len(set(seeds)) != len(seeds):
    raise GridError(f"grid.seeds: {seeds} repeats a seed; list each once")
  for where, fields in (("grid.fixed", grid.fixed), ("grid.axes", grid.axes)):
    for f in fields:
      if f in RESERVED_FIELDS:
        raise GridError(f"{where}: {f!r} is set by the runner (grid.seeds / --workdir); remove it from {where}")
  both = sorted(set(grid.fixed) & set(grid.axes))
  if both:
    raise GridError(f"grid.axes: {both} are also in grid.fixed; keep each field in one of them")
  for f, v in grid.fixed.items():
    _check_value("grid.fixed", f, v, scalar=False)
  _check_variants(grid)
  for f, values in grid.axes.items():
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
      raise GridError(f"grid.axes: {f} must map to a non-empty list of values, got {values!r}")
    for v in values:
      _check_value("grid.axes", f, v, scalar=True)
    if len(set(map(repr, values))) != len(values):
      raise GridError(f"grid.axes: {f} lists a value twice ({list(values)}); list each once")
  for i, cell in enumerate(grid.cells):
    if not isinstance(cell, Mapping) or not cell:
      raise GridError(f"grid.cells[{i}]: must be a non-empty dict field -> value, got {cell!r}")
    for f, v in cell.items():
      if f in RESERVED_FIELDS:
        raise GridError(f"grid.cells[{i}]: {f!r} is set by the runner; remove it")
      if f in grid.fixed:
        raise GridError(f"grid.cells[{i}]: {f} is also in grid.fixed; keep each field in one of them")
      if f == VARIANT and grid.variants and v not in grid.variants:
        raise GridError(f"grid.cells[{i}]: variant {v!r} is none of grid.variants {list(grid.variants)}")
      _check_value(f"grid.cells[{i}]", f, v, scalar=True)
  cells = grid_cells(grid)
  if not cells:
    raise GridError("grid: no cells; give grid.axes or grid.cells")
  fields = {f for cell in cells for f, _ in cell}
  for i, comp in enumerate(grid.comparisons):
    if not (isinstance(comp, (tuple, list)) and len(comp) in (2, 3) and isinstance(comp[0], str)):
      raise GridError(
          f"grid.comparisons[{i}]: must be a (field, reference value) pair or a (field, reference value, (values "
          f"compared,)) triple, got {comp!r}"
      )
    if comp[0] not in fields:
      raise GridError(f"grid.comparisons[{i}]: {comp[0]!r} is no field of any cell; use one of {sorted(fields)}")
    values = {v for cell in cells for f, v in cell if f == comp[0]}
    if len(comp) == 3 and (not isinstance(comp[2], (tuple, list)) or not comp[2] or set(comp[2]) - values):
      raise GridError(
          f"grid.comparisons[{i}]: the values compared must be a non-empty tuple of values of {comp[0]!r} "
          f"({sorted(map(str, values))}), got {comp[2]!r}"
      )
  for i, con in enumerate(grid.contrasts):
    values = lambda f: {v for cell in cells for k, v in cell if k == f}  # noqa: E731
    ok = isinstance(con, (tuple, list)) and len(con) == 4 and all(isinstance(con[j], str) for j in (0, 2))
    if not ok or con[0] == con[2] or con[1] not in values(con[0]) or con[3] not in values(con[2]):
      raise GridError(
          f"grid.contrasts[{i}]: must be a (field, reference value, across, base value) tuple of two different "
          f"fields of the cells, each value one they take (e.g. ('loss.method', 'grpo', 'delay', 0)), got {con!r}"
      )
  if grid.panel is not None and grid.panel not in fields:
    raise GridError(f"grid.panel: {grid.panel!r} is no field of any cell; use one of {sorted(fields)} or None")


def _check_variants(grid: Grid) -> None:
  if not isinstance(grid.variants, Mapping):
    raise GridError(f"grid.variants: must be a dict name -> overrides, got a {type(grid.variants).__name__}")
  if grid.variants and VARIANT in grid.axes:
    raise GridError(f"grid.axes: {VARIANT!r} is the axis of grid.variants; rename the axis or drop grid.variants")
  for name, overrides in grid.variants.items():
    where = f"grid.variants[{name!r}]"
    if not isinstance(name, str) or not name or format_name_value(name) != name:
      raise GridError(f"{where}: a variant name must be a non-empty string of [A-Za-z0-9.+=-]")
    if not isinstance(overrides, Mapping):
      raise GridError(f"{where}: must be a dict field -> value ({{}} for none), got {overrides!r}")
    for f, v in overrides.items():
      if f in RESERVED_FIELDS or f == VARIANT:
        raise GridError(f"{where}: {f!r} is set by the runner; remove it")
      if f in grid.fixed or f in grid.axes:
        raise GridError(f"{where}: {f} is also in grid.fixed or grid.axes; keep each field in one place")
      _check_value(where, f, v, scalar=False)


def variant_overrides(grid: Grid, cell: Mapping[str, Any]) -> dict[str, Any]:
  """The overrides a cell's variant sets ({} when the grid has no variants or the cell names none)."""
  return dict(grid.variants[cell[VARIANT]]) if grid.variants and VARIANT in cell else {}


def grid_cells(grid: Grid) -> list[tuple[tuple[str, Any], ...]]:
  """The cells: the product of the axes (first axis slowest), then `grid.cells`, as ((field, value), ...).

  Raises:
    GridError: `grid.cells[i]` repeats a cell of the product or an earlier one.
  """
  out = []
  axes = {VARIANT: list(grid.variants), **grid.axes} if grid.variants else dict(grid.axes)
  if axes:
    fields = list(axes)
    out = [tuple(zip(fields, values)) for values in itertools.product(*(axes[f] for f in fields))]
  seen = {_cell_key(c): None for c in out}
  for i, cell in enumerate(grid.cells):
    c = tuple(cell.items())
    if _cell_key(c) in seen:
      raise GridError(f"grid.cells[{i}]: {dict(cell)} is already a cell of the grid; remove it")
    seen[_cell_key(c)] = None
    out.append(c)
  return out


def _cell_key(cell: tuple[tuple[str, Any], ...]) -> tuple:
  return tuple(sorted((k, repr(v)) for k, v in cell))


# ------------------------------------------------------------------------------------------------ naming
def short_names(fields: Sequence[str]) -> dict[str, str]:
  """field -> its name part: the last dotted component ("loss.method" -> "method"), or the whole dotted path
  where two fields share their last component."""
  last = [f.rsplit(".", 1)[-1] for f in fields]
  return {f: (s if last.count(s) == 1 else f) for f, s in zip(fields, last)}


def format_name_value(v: Any) -> str:
  """A value as a directory-name part: `str`, with characters other than [A-Za-z0-9.+=-] as '~'."""
  return _NAME_UNSAFE.sub("~", str(v))


def expand(grid: Grid) -> list[Run]:
  """The grid's runs, seed-major (every cell at seeds[0], then at seeds[1], ...).

  Raises:
    GridError: two runs would get the same directory name (values that differ only in characters a name
      cannot hold), or `grid.derived` returns a field that is no str-keyed scalar/tuple or overlaps the cell.
  """
  cells = grid_cells(grid)
  fields = list(dict.fromkeys(f for cell in cells for f, _ in cell))
  short = short_names(fields)
  order = {f: i for i, f in enumerate(fields)}
  runs, names = [], {}
  for seed in grid.seeds:
    for cell in cells:
      cell = tuple(sorted(cell, key=lambda kv: order[kv[0]]))
      extra = _derived(grid, cell, seed)
      name = "_".join(f"{short[f]}-{format_name_value(v)}" for f, v in cell) + f"_seed-{seed}"
      if name in names:
        raise GridError(
            f"grid: runs {names[name]} and {Run(name, cell, seed).label} would share the directory {name}; "
            "make the values differ in letters, digits or . + = -"
        )
      names[name] = Run(name, cell, seed).label
      runs.append(Run(name=name, cell=cell, seed=seed, extra=extra))
  return runs


def _derived(grid: Grid, cell: tuple[tuple[str, Any], ...], seed: int) -> tuple[tuple[str, Any], ...]:
  if grid.derived is None:
    return ()
  try:
    out = grid.derived({**dict(cell), "seed": seed})
  except Exception as e:  # noqa: BLE001 - the grid file's own function: name it, the cell and the fix
    raise GridError(
        f"grid.derived: raised {type(e).__name__}: {e} for the cell {dict(cell)} at seed {seed}; it gets only the "
        "cell's named fields and 'seed' (not grid.fixed, a variant's overrides or the base config), so read a "
        "field that not every cell sets with cell.get(field, default)"
    ) from e
  variant = variant_overrides(grid, dict(cell))
  if not isinstance(out, Mapping):
    raise GridError(f"grid.derived: must return a dict field -> value, returned {out!r} for {dict(cell)}")
  for f, v in out.items():
    if f in RESERVED_FIELDS or f in dict(cell) or f in grid.fixed or f in variant:
      raise GridError(
          f"grid.derived: returns {f!r} for {dict(cell)}, which the cell, its variant, grid.fixed or the runner sets"
      )
    _check_value("grid.derived", f, v, scalar=False)
  return tuple(out.items())
