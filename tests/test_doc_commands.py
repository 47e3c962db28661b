"""Every `python -m minpro_jax.X ...` command line in README.md and docs/*.md runs verbatim after the README's
set-up (`make setup` makes `.venv`, not a `python` with JAX on the PATH): each is written `.venv/bin/python -m ...`
and its flags pass that tool's own argument parser (no tool is run: the parser's answer is caught).

Placeholders are read as a reader would fill them in: `...` and `<words>` are dropped, `[--a=x|y]` is `--a=x`, a
`--flag=...` is dropped (the tool's default), `$G` is the grid the block sets.
"""

import argparse
import importlib
import pathlib
import re
import shlex
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?<![\w/.\-])((?:\.venv/bin/)?python) -m (minpro_jax[\w.]*)")
GENERATED_MARKER = re.compile(r"^<!-- [\w-]+:(begin|end)")


def _command_lines() -> list[tuple[str, str, str, list[str], bool]]:
  """(file:line, interpreter, module, argv, inline) of each documented command; argv with placeholders filled in.

  inline: the command is quoted in prose (`...`), often a tool's name and one flag, so the flags it gives must be
  the tool's but the ones it leaves out may be required; a code block's line must parse whole."""
  found = []
  for path in DOCS:
    lines = path.read_text().splitlines()
    shell_vars = {}
    for i, line in enumerate(lines):
      if m := re.match(r"^([A-Z]\w*)=(\S+)$", line):
        shell_vars[m.group(1)] = m.group(2)
      if GENERATED_MARKER.match(line):  # the report tools' block markers: written by code, not run
        continue
      for m in COMMAND.finditer(line):
        inline = line[: m.start()].count("`") % 2 == 1
        text, j = line[m.end() :], i
        if inline:
          text = text.split("`", 1)[0]
        else:
          text = text.split(" #", 1)[0]
          while text.rstrip().endswith("\\") and j + 1 < len(lines):
            j += 1
            text = text.rstrip()[:-1] + " " + lines[j].split(" #", 1)[0]
        if inline and "`" not in line[m.end() :] and i + 1 < len(lines):  # an inline command broken over a line
          text += " " + lines[i + 1].split("`", 1)[0]
        for name, value in shell_vars.items():
          text = text.replace(f"${name}", value)
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        found.append((where, m.group(1), m.group(2), _fill(text), inline))
  return found


def _fill(text: str) -> list[str]:
  """The argv a reader types for a documented line: placeholders filled in as the module docstring says."""
  text = re.sub(r"\[(--[^\]|]+)(?:\|[^\]]*)?\]", r"\1", text)  # [--which=best|final|STEP] -> --which=best
  text = re.sub(r"\[[^\]]*\]", "", text)  # other optional groups: left out
  text = re.sub(r"<[^>]*>", "...", text)  # <train flags>, --config=<base>: the reader's own
  argv = []
  for token in shlex.split(text):
    if "..." in token or (token.startswith("<") and token.endswith(">")) or token.endswith(","):
      continue
    flag, eq, value = token.rstrip(",;.)").partition("=")
    argv.append(flag + eq + ("2" if re.fullmatch(r"[A-Z]+", value) else value))  # --num_processes=N
  return argv


class _Parsed(Exception):
  """Raised by the patched parser once it has accepted the argv."""


_inside = threading.local()


@pytest.fixture
def parse_only(monkeypatch):
  """argparse answers: a bad argv exits 2 as usual; a good one raises _Parsed instead of running the tool."""
  parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

  def patched_parse_args(self, args=None, namespace=None):
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
      parse_args(self, args, namespace)
    finally:
      _inside.depth -= 1
    raise _Parsed()

  def patched_parse_known_args(self, args=None, namespace=None):
    result = parse_known_args(self, args, namespace)
    if getattr(_inside, "depth", 0):
      return result
    raise _Parsed(result[1])

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", patched_parse_args)
  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", patched_parse_known_args)


def _check_train_flags(argv: list[str]) -> None:
  """The train command's flags (`--config=FILE[:ARG]` and `--config.FIELD=VALUE`) through its config parser."""
  from minpro_jax.config_lib.parse import parse_config  # the parser JAX-free; imported in the test that needs it

  parse_config(["train", *argv])


def _check(module: str, argv: list[str]) -> None:
  if module == "minpro_jax.train":
    _check_train_flags(argv)
    return
  if module == "minpro_jax.launch_local":
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    _check(next((a.split("=", 1)[1] for a in ours if a.startswith("--module=")), "minpro_jax.train"), rest)
    argv = ours
  tool = importlib.import_module(module + ".__main__" if module in ("minpro_jax.aot", "minpro_jax.study") else module)
  with pytest.raises(_Parsed) as parsed:
    tool.main(argv)
  if module == "minpro_jax.aot" and any(a.startswith("--config=") for a in argv):
    _check_train_flags([a for a in argv if a.startswith("--config")])
  if module == "minpro_jax.evaluate":  # its other flags are `--FIELD=VALUE` config fields
    assert all(a.startswith("--") and "=" in a for a in parsed.value.args[0]), parsed.value.args


COMMANDS = _command_lines()


def test_the_docs_have_commands_to_check():
  assert len(COMMANDS) > 40 and {c[2] for c in COMMANDS} >= {"minpro_jax.train", "minpro_jax.evaluate"}


@pytest.mark.parametrize("where,interpreter", [(c[0], c[1]) for c in COMMANDS])
def test_every_documented_command_uses_the_venvs_python(where, interpreter):
  assert interpreter == ".venv/bin/python", f"{where}: write .venv/bin/python -m ... (make setup makes .venv)"


@pytest.mark.parametrize(
    "where,module,argv,inline", [(c[0], c[2], c[3], c[4]) for c in COMMANDS], ids=[c[0] for c in COMMANDS]
)
def test_every_documented_command_passes_its_parser(where, module, argv, inline, parse_only, capsys):
  del parse_only
  try:
    _check(module, argv)
  except SystemExit as e:
    err = capsys.readouterr().err
    if inline and re.search(r"error: (the following arguments are required|one of the arguments .* is required)", err):
      return  # prose names the tool and a flag; the rest of its command is elsewhere on the page
    pytest.fail(f"{where}: {module} {shlex.join(argv)}: exit {e.code}: {err[-600:]}")
  except Exception as e:  # a UserError of the config parser
    pytest.fail(f"{where}: {module} {shlex.join(argv)}: {type(e).__name__}: {e}")
