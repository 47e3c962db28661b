"""Packaging: pyproject.toml declares every third-party import of the package, in ranges that hold the pins of
requirements.txt, and `pip install .` gives an importable package (built here without the network)."""

import ast
import functools
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minpro_jax"


def _project():
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins() -> dict[str, str]:
  """requirements.txt's exact pins: canonical name -> version."""
  pins = {}
  for line in (ROOT / "requirements.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      req = Requirement(line)
      (spec,) = req.specifier
      assert spec.operator == "==", f"requirements.txt: {line!r} is not an exact pin"
      pins[canonicalize_name(req.name)] = spec.version
  return pins


def _provides(req: Requirement) -> set[str]:
  """The distributions a requirement brings: itself, and those its named extras add (read from the installed
  metadata, one level: `jax[tpu]` brings libtpu)."""
  names = {canonicalize_name(req.name)}
  if req.extras:
    for dep in importlib.metadata.requires(req.name) or []:
      sub = Requirement(dep)
      if sub.marker is not None and any(sub.marker.evaluate({"extra": e}) for e in req.extras):
        names.add(canonicalize_name(sub.name))
  return names


def _imports() -> dict[str, bool]:
  """Top-level third-party module imported anywhere in the package -> whether some import of it is unguarded (at a
  module's top level, outside any function and any `try`)."""
  found: dict[str, bool] = {}

  def visit(node, guarded):
    for child in ast.iter_child_nodes(node):
      inner = guarded or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try))
      names = []
      if isinstance(child, ast.Import):
        names = [a.name for a in child.names]
      elif isinstance(child, ast.ImportFrom) and child.level == 0:
        names = [child.module]
      for name in names:
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top != "minpro_jax":
          found[top] = found.get(top, False) or not guarded
      visit(child, inner)

  for path in PACKAGE.rglob("*.py"):
    visit(ast.parse(path.read_text(), str(path)), False)
  return found


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
  return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
  """The installed distributions that provide `module` (its own name when none is installed, e.g. libtpu)."""
  dists = _module_distributions().get(module) or [module]
  return {canonicalize_name(d) for d in dists}


def test_every_import_of_the_package_is_declared():
  project = _project()
  core = {n for r in project["dependencies"] for n in _provides(Requirement(r))}
  extras = {n for reqs in project["optional-dependencies"].values() for r in reqs for n in _provides(Requirement(r))}
  imports = _imports()
  assert {"jax", "flax", "optax", "sympy", "tensorflow_datasets", "libtpu"} <= set(imports)  # the scan sees them
  missing = {m: sorted(_distributions(m)) for m, top in imports.items() if not _distributions(m) & core}
  # an import guarded by a function or a try (an optional feature) may come from an extra instead
  missing = {m: d for m, d in missing.items() if imports[m] or not set(d) & extras}
  assert not missing, f"imported by minpro_jax but not declared in pyproject.toml: {missing}"
  imported = {d for m in imports for d in _distributions(m)}
  unused = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]} - imported - {"jaxlib"}
  assert not unused, f"declared in pyproject.toml but imported nowhere in minpro_jax: {sorted(unused)}"


def test_the_ranges_hold_the_pins_and_are_ranges():
  project = _project()
  pins = _pins()
  reqs = [Requirement(r) for r in project["dependencies"]]
  reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
  for req in reqs:
    name = canonicalize_name(req.name)
    assert not any(s.operator in ("==", "===") for s in req.specifier), f"pyproject.toml pins {req}: give a range"
    assert any(s.operator == "<" for s in req.specifier), f"pyproject.toml: {req} has no upper bound"
    if name in pins:
      assert req.specifier.contains(pins[name]), f"requirements.txt pins {name}=={pins[name]}, outside {req}"
  declared = {canonicalize_name(r.name) for r in reqs}
  assert set(pins) <= declared, f"pinned in requirements.txt, not declared: {sorted(set(pins) - declared)}"


def test_pip_install_gives_an_importable_package(tmp_path):
  """The wheel `pip install .` builds holds every module of the package, and imports from where it is installed.
  Built without build isolation (the venv's setuptools) and installed without dependencies: no network."""
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    (src / name).write_bytes((ROOT / name).read_bytes())
  tracked = subprocess.run(["git", "ls-files", "minpro_jax"], cwd=ROOT, capture_output=True, text=True, check=True)
  modules = sorted(tracked.stdout.split())
  for rel in modules:
    (src / rel).parent.mkdir(parents=True, exist_ok=True)
    (src / rel).write_bytes((ROOT / rel).read_bytes())
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)], check=True)
  (wheel,) = (tmp_path / "w").glob("minpro_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
  assert set(modules) <= names
  assert "Requires-Dist: jax<0.11,>=0.10.2" in requires and len(requires) >= len(_project()["dependencies"])
  target = tmp_path / "site"
  subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], check=True)
  env = {**os.environ, "PYTHONPATH": str(target)}
  code = (  # the configs' defaults travel in the package; the config files (configs/) stay in the repository
      "import minpro_jax, minpro_jax.train, minpro_jax.run.heldout; from minpro_jax.config_lib import defaults; "
      "assert defaults.base_config().loss.method == 'minpro'; print(minpro_jax.__file__)"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert pathlib.Path(out.stdout.strip()).is_relative_to(target)


@pytest.mark.parametrize(
    "doc", ["README.md", "launch/README.md", "docs/mipu.md", "docs/configs.md", "docs/study.md", "docs/mechanism.md"]
)
def test_the_paths_a_doc_names_exist(doc):
  """Every repository path a doc names in backticks (`minpro_jax/...`, `launch/...`, `results/...`, ...) exists
  (runs/ holds what users' runs write, so its paths are not checked; a committed study under results/ may still be
  kept under runs/ in a checkout from before the move: `study.results.resolve` finds it there). A results/ path in a
  fenced command block is what the command writes or reads once run, so it may not exist yet."""
  from minpro_jax.study.results import other_root

  text = (ROOT / doc).read_text()
  text = re.sub(r"```.*?```", lambda m: re.sub(r"results/[^\s`]*", "", m.group()), text, flags=re.S)
  stale = []
  for span in text.split("`")[1::2]:
    for word in span.replace("=", " ").split():
      word = word.rstrip(".,;:)").split(":")[0]  # `FILE.py:minpro,2` (a config argument), `tests/x.py::test`
      if word.startswith(
          ("minpro_jax/", "configs/", "launch/", "tests/", "benchmarks/", "docs/", "colab/", "results/")
      ):
        path = word.split("#")[0]
        old = other_root(path) if path.startswith("results/") else None
        exists = (ROOT / path).exists() or (old is not None and (ROOT / old).exists())
        if "*" not in word and "{" not in word and "<" not in word and not exists:
          stale.append(word)
  assert not stale, f"{doc} names paths that do not exist: {stale}"
