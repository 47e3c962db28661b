"""The drawing of the house (issue 56): the package's imports, read from the source with `ast`, form layers with no
circle and no arrow back up; the library never imports the lab (`minpro_jax/lab`); no module imports another's
private names; every import inside a function says why it is there; the package root holds the entry points and a
few shared modules only."""

import ast
import os
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minpro_jax"
# Low to high: a module may import its own package and the packages below it, never one above.
LAYERS = (
    ("errors",),
    ("config_lib",),
    ("data",),
    ("runtime",),
    ("models",),
    ("sampling",),
    ("rl",),
    ("run",),
    ("study", "aot"),
    ("lab",),
    ("train", "evaluate", "export", "launch_local", "__init__"),  # the entry points
)
ROOT_MODULES_MAX = 12


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


MODULES = _modules()


def _imports(path: pathlib.Path):
  """(line, target module, imported names, inside a function, has a comment) of each import of a minpro_jax
  module in `path`."""
  source = path.read_text()
  lines = source.splitlines()
  tree = ast.parse(source)
  inner = set()
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      inner |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [a.name for a in node.names]
      target = node.module
      subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
      targets = subs or [target]
    elif isinstance(node, ast.Import):
      names, targets = [], [a.name for a in node.names]
    else:
      continue
    for t in targets:
      if not t.startswith("minpro_jax"):
        continue
      above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
      same = lines[node.lineno - 1]
      commented = "#" in same or above.startswith("#") or _block_comment(lines, node.lineno)
      out.append((node.lineno, t, names, id(node) in inner, commented))
  return out


def _block_comment(lines, lineno) -> bool:
  """A comment line just above the run of import lines that holds line `lineno`."""
  i = lineno - 2
  while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
    i -= 1
  return i >= 0 and lines[i].strip().startswith("#")


def _layer(module: str) -> int:
  parts = module.split(".")
  top = parts[1] if len(parts) > 1 else "__init__"
  return next(i for i, names in enumerate(LAYERS) if top in names)


EDGES = {m: [(line, t, names, inner, c) for line, t, names, inner, c in _imports(p)] for m, p in MODULES.items()}


def test_every_module_has_a_layer():
  for m in MODULES:
    _layer(m)  # raises StopIteration for a package no layer names: add it to LAYERS


def test_no_arrow_back_up():
  up = [
      f"{m}:{line} imports {t}"
      for m, edges in EDGES.items()
      for line, t, _, _, _ in edges
      if t in MODULES and _layer(t) > _layer(m)
  ]
  assert not up, up


def test_no_import_circle():
  graph = {m: sorted({t for _, t, _, _, _ in EDGES[m] if t in MODULES and t != m}) for m in MODULES}
  state, circles = {}, []

  def visit(u, stack):
    state[u] = "open"
    for v in graph[u]:
      if state.get(v) == "open":
        circles.append(stack[stack.index(v) :] + [v])
      elif v not in state:
        visit(v, [*stack, v])
    state[u] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not circles, circles


def test_the_library_never_imports_the_lab():
  wrong = [
      f"{m}:{line} imports {t}"
      for m, edges in EDGES.items()
      if not m.startswith("minpro_jax.lab")
      for line, t, _, _, _ in edges
      if t.startswith("minpro_jax.lab")
  ]
  assert not wrong, wrong


def test_no_module_imports_another_s_private_names():
  wrong = [
      f"{m}:{line} imports {n} from {t}"
      for m, edges in EDGES.items()
      for line, t, names, _, _ in edges
      for n in names
      if n.startswith("_") and not n.startswith("__")
  ]
  assert not wrong, wrong


def test_an_import_inside_a_function_says_why():
  """An import inside a function is for a heavy import off the hot path or an optional dependency, said so in a
  comment (on its line or above its block), never to hide a circle (test_no_import_circle counts those too)."""
  silent = [f"{m}:{line} ({t})" for m, edges in EDGES.items() for line, t, _, inner, c in edges if inner and not c]
  assert not silent, silent


def test_the_package_root_holds_at_most_a_dozen_modules():
  root = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert len(root) <= ROOT_MODULES_MAX, root


@pytest.mark.parametrize("path", sorted(str(p) for p in PACKAGE.rglob("*.py")), ids=lambda p: os.path.relpath(p))
def test_no_module_over_700_lines(path):
  """Small modules with one job (~600 lines; a little slack for docstrings)."""
  assert len(pathlib.Path(path).read_text().splitlines()) <= 700
