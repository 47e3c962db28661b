"""Command line: `python -m minpro_jax.train --config=configs/default.py [--config.FIELD=VALUE ...]`.

Any config field can be overridden on the command line (ml_collections), e.g.
`--config.loss.method=grpo --config.delay=4 --config.workdir=runs/grpo_d4`. Re-running the same command resumes
from the newest checkpoint in the workdir.

A mistake the user can fix (a bad flag or config field, a data / model / tokenizer file, a workdir in use) prints
one line, `error: <what is wrong; the fix>`, and exits with status 2; `--debug` (or `MINPRO_DEBUG=1`) shows the
traceback instead. A full disk (ENOSPC) is such a mistake too. A run stopped by SIGTERM / SIGINT exits with 128 + the
signal: after its checkpoint during training (a second signal: at once), at once (saying so) during the setup and the
final evaluation.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback

os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.path.expanduser("~"), ".cache", "minpro_jax_mpl"))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from minpro_jax.config_lib import files  # noqa: E402
from minpro_jax.errors import UserError  # noqa: E402

DEFAULT_CONFIG = "configs/default.py"  # found from the current directory or the repository root (`_find_config`)
DEFAULTS_FILE = "minpro_jax/config_lib/defaults.py"  # every field and its default
DEBUG_ENV = "MINPRO_DEBUG"
EXIT_USER_ERROR = 2
_NOISY_LOGGERS = ("absl", "jax._src", "orbax", "math_verify", "latex2sympy2_extended", "asyncio")


def parse_config(argv: list[str]):
  """The config of `--config=FILE[:ARG]` with the `--config.FIELD=VALUE` overrides of `argv` (locked).

  Raises:
    UserError: a missing config file, an unknown field, a value that does not parse, an unknown flag; the
      message names the flag.
  """
  fv = flags.FlagValues()
  found = [_find_config(a) if a.startswith("--config=") else a for a in argv]
  try:
    holder = config_flags.DEFINE_config_file(
        "config",
        _find_config(f"--config={DEFAULT_CONFIG}")[len("--config=") :],
        "Experiment config file.",
        flag_values=fv,
        lock_config=True,
        sys_argv=found,
    )
    fv(found)
    config = holder.value
    config.keys()  # the file loads lazily: make its errors happen here
  except (OSError, AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    raise UserError(_flag_message(argv, e)) from e
  _refuse_repeated_tuples(config, argv)
  return config


def _refuse_repeated_tuples(config, argv: list[str]) -> None:
  """ml_collections joins the values of a tuple field given twice (`--config.eval.ks=1,2 --config.eval.ks=1,8` is
  (1, 2, 1, 8)) where a scalar's last value wins. Raises UserError naming such a flag."""
  names = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.") and "=" in a]
  for name in sorted({n for n in names if names.count(n) > 1}):
    value = config
    for part in name.split("."):
      value = value.get(part) if hasattr(value, "get") else None
    if isinstance(value, tuple):
      raise UserError(
          f"--config.{name}: given {names.count(name)} times, so its values were joined into {value}; give a tuple "
          "field once, with every value (e.g. --config.eval.ks=1,8)"
      )


def _find_config(flag: str) -> str:
  """`--config=PATH[:ARG]` with PATH found by `config_lib.files.resolve` when it is not there as given: from the
  repository root, or in `configs/` for a path into the configs' old folder `minpro_jax/configs/` (said on
  stderr). Unchanged when it is found nowhere (the loader then names it)."""
  path, sep, arg = flag[len("--config=") :].partition(":")
  found = None if os.path.isfile(path) else files.resolve(path)
  if found is None:
    return flag
  if files.canonical(path) != path:
    print(f"note: --config={path}: the configs moved to configs/; reading {found}", file=sys.stderr)
  return f"--config={found}{sep}{arg}"


def _flag_message(argv: list[str], e: BaseException) -> str:
  text = str(e)
  if "Failed loading config file" in text or "Configuration is not available" in text:
    path = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--config=")), DEFAULT_CONFIG)
    return (
        f"--config={path}: cannot load the config file ({text.splitlines()[-1].strip()}); pass an existing .py file "
        f"(looked as given, from {os.getcwd()} and from the repository root; the experiment configs ship with the "
        "repository, not the installed package: clone it, or write a get_config() that calls "
        "minpro_jax.config_lib.defaults.base_config())"
    )
  if isinstance(e, AttributeError) and "no attribute 'get_config'" in text:  # e.g. a study grid (get_grid)
    path = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("--config=")), DEFAULT_CONFIG)
    file = files.resolve(path.partition(":")[0]) or path.partition(":")[0]
    try:
      with open(file) as f:
        is_grid = "def get_grid" in f.read()
    except OSError:
      is_grid = False
    what = f"it is a study grid: run python -m minpro_jax.study --grid={path}" if is_grid else "pass a config file"
    return f"--config={path}: the file has no get_config(); {what}"
  if m := re.match(r"Found (\S+) in argv before a value for --config was specified", text):
    return f"{m.group(1)}: comes before --config=FILE; put --config=FILE first (the overrides apply to that file)"
  if "Error whilst parsing config file" in text:  # get_config raised: its reason is the traceback's last line
    flag = next((a for a in reversed(argv) if a.startswith("--config=")), "--config")
    reason = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return f"{flag}: the config file's get_config refused its argument ({reason}); fix the part after ':'"
  if isinstance(e, (AttributeError, KeyError)):  # an override names a field the config does not have
    return _unknown_field_message(argv, e)
  return text.splitlines()[0] if text else type(e).__name__


def _unknown_field_message(argv: list[str], e: BaseException) -> str:
  """`config.FIELD: the config has no such field` for the override that names FIELD (the whole flag, e.g.
  `config.samplng.x` for a typo in `samplng`), with ml_collections' suggestion as `did you mean ...?`."""
  while isinstance(e, AttributeError) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]  # ml_collections wraps the KeyError of a nested field in an AttributeError
  raw = str(e.args[0]) if e.args else str(e)
  first, _, rest = raw.partition("\n")
  key = first.strip("\"'")
  pattern = rf"--config\.(.+\.)?{re.escape(key)}[.=]"
  flag = next((a.split("=", 1)[0] for a in argv if re.match(pattern, a)), key)
  hint = ""
  if m := re.search(r'Did you mean "([^"]+)" instead of', rest):
    parts = flag.lstrip("-").split(".")
    parts[parts.index(key)] = m.group(1)
    hint = f"; did you mean {'.'.join(parts)}?"
  elif elsewhere := _fields_named(flag.lstrip("-").split(".")[-1], flag.lstrip("-")):
    hint = f"; did you mean {' or '.join(elsewhere)}?"
  return f"{flag.lstrip('-')}: the config has no such field{hint}; see {DEFAULTS_FILE} for the fields"


def _fields_named(leaf: str, flag: str) -> list[str]:
  """The default config's fields (`config.a.b`) whose last name is `leaf`, other than `flag` (a field put in the
  wrong section: `config.learner.micro_batch_size` for `config.micro_batch_size`)."""
  from minpro_jax.config_lib.defaults import base_config

  def walk(d, prefix):
    for k, v in d.items():
      path = f"{prefix}.{k}"
      if hasattr(v, "items"):
        yield from walk(v, path)
      elif k == leaf and path != flag:
        yield path

  return sorted(walk(base_config(), "config"))


def _quiet_logging() -> None:
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for name in _NOISY_LOGGERS:  # library noise (orbax's background-thread tracebacks, asyncio) stays out of the way
    logging.getLogger(name).setLevel(logging.CRITICAL if name in ("orbax", "asyncio") else logging.WARNING)


def _run(config) -> dict | None:
  """Trains; returns the summary to print (None on the processes of a multi-process run other than process 0)."""
  from minpro_jax.runtime.host_memory import keep_freed_host_memory

  keep_freed_host_memory()  # host (XLA:CPU) steps stop re-faulting their temporaries; before JAX starts threads
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  maybe_initialize_distributed()  # multi-host TPU / multi-node GPU only; must precede any JAX computation
  from minpro_jax.run_setup import setup_run
  from minpro_jax.runtime import multihost
  from minpro_jax.trainer import Trainer

  if not multihost.is_primary():  # process 0 reports progress; the others only their warnings and errors
    logging.getLogger("minpro_jax").setLevel(logging.WARNING)
  summary = Trainer(setup_run(config)).run()
  return summary if multihost.is_primary() else None


def _interrupted_during_setup(signum, frame):
  """SIGTERM / SIGINT before the first step: nothing is checkpointed yet, and the tokenizer and SFT caches are
  written atomically, so the process ends at once (an exception raised here could be swallowed by the code it
  interrupts, e.g. a logging handler)."""
  del frame
  sys.stderr.write(
      f"error: stopped by signal {signum} during setup (tokenizer, SFT warm start); nothing was "
      "checkpointed yet: re-running the same command starts the setup again (a finished SFT is cached)\n"
  )
  sys.stderr.flush()
  os._exit(128 + signum)


def _chain(e: BaseException | None):
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


def _disk_full(e: BaseException) -> bool:
  """Whether `e`, or an exception it came from, is "no space left on device" (ENOSPC)."""
  return any(
      (isinstance(x, OSError) and x.errno == errno.ENOSPC) or "No space left on device" in str(x) for x in _chain(e)
  )


def _watch_signals():
  """Makes SIGTERM / SIGINT effective while the main thread waits inside native code (Python runs its signal
  handlers only between bytecodes): e.g. for the other processes of a multi-process run at
  `jax.distributed.initialize` or in a collective. A thread reads each signal from the wakeup fd: during the setup
  it ends the process at once (`_interrupted_during_setup`); later, where the trainer checkpoints after its step on
  the first signal, a second one ends the process at once, without that checkpoint.

  Returns:
    a function that stops the watch (restores the previous wakeup fd; the thread then ends).
  """
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

  def watch():
    seen = 0
    while data := os.read(read_fd, 1):
      signum = data[0]
      if signum not in (signal.SIGTERM, signal.SIGINT):
        continue
      seen += 1
      if signal.getsignal(signum) is _interrupted_during_setup:
        _interrupted_during_setup(signum, None)
      if seen >= 2:
        sys.stderr.write(
            f"error: a second signal ({signum}): exiting at once, without the checkpoint of the current step; "
            "re-running the same command resumes from the newest checkpoint\n"
        )
        sys.stderr.flush()
        os._exit(128 + signum)
    os.close(read_fd)

  def stop():
    signal.set_wakeup_fd(previous)
    os.close(write_fd)

  threading.Thread(target=watch, name="signal-watch", daemon=True).start()
  return stop


def _newest_checkpoint(config) -> str:
  """Where a crashed run's work is: its newest run checkpoint (the step folders orbax wrote) or that it has none."""
  if config is None:
    return "nothing was run"
  folder = os.path.join(os.path.abspath(config.workdir), "checkpoints")
  steps = sorted(int(d) for d in (os.listdir(folder) if os.path.isdir(folder) else ()) if d.isdigit())
  if not steps:
    return f"no run checkpoint was written under {folder} yet"
  return f"the newest run checkpoint is {folder}/{steps[-1]}; re-running the same command resumes from it"


def main(argv: list[str] | None = None) -> int:
  """Runs the CLI; returns the exit status (0, 2 for a user error, 128 + signal when stopped by one)."""
  argv = list(sys.argv if argv is None else argv)
  debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") == "1"
  argv = [a for a in argv if a != "--debug"]
  config = None
  _quiet_logging()
  previous = {s: signal.signal(s, _interrupted_during_setup) for s in (signal.SIGTERM, signal.SIGINT)}
  stop_watch = _watch_signals()
  try:
    config = parse_config(argv)
    summary = _run(config)
  except UserError as e:
    if debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  except Exception as e:  # a bug, not a user mistake: the traceback, then where the work is
    if _disk_full(e) and not debug:  # ENOSPC outside a checkpoint write (metrics, tables, plots, caches)
      where = next((f" writing {x.filename}" for x in _chain(e) if getattr(x, "filename", None)), "")
      print(
          f"error: config.workdir: no space left on the device{where}; free space on that disk (old runs, "
          f"checkpoints_unreadable/, cache/) or lower --config.checkpoint.keep; {_newest_checkpoint(config)}",
          file=sys.stderr,
      )
      return EXIT_USER_ERROR
    traceback.print_exc()
    print(f"error: the run crashed (traceback above); {_newest_checkpoint(config)}", file=sys.stderr)
    return 1
  finally:
    stop_watch()
    for s, handler in previous.items():
      signal.signal(s, handler)
  if summary is not None:
    keys = ("eval_after_sft", "eval_final", "best", "policy_version", "skipped_updates")
    print(json.dumps({k: summary[k] for k in keys}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
