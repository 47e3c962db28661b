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
import signal
import sys
import threading
import traceback

os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.path.expanduser("~"), ".cache", "minpro_jax_mpl"))

from minpro_jax.config_lib.parse import parse_config  # noqa: E402
from minpro_jax.errors import UserError  # noqa: E402
from minpro_jax.runtime import abort_line

DEBUG_ENV = "MINPRO_DEBUG"
EXIT_USER_ERROR = 2
_NOISY_LOGGERS = ("absl", "jax._src", "orbax", "math_verify", "latex2sympy2_extended", "asyncio")


def _quiet_logging() -> None:
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for name in _NOISY_LOGGERS:  # library noise (orbax's background-thread tracebacks, asyncio) stays out of the way
    logging.getLogger(name).setLevel(logging.CRITICAL if name in ("orbax", "asyncio") else logging.WARNING)


def _run(config) -> dict | None:
  """Trains; returns the summary to print (None on the processes of a multi-process run other than process 0)."""
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.runtime.host_memory import keep_freed_host_memory

  keep_freed_host_memory()  # host (XLA:CPU) steps stop re-faulting their temporaries; before JAX starts threads
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  maybe_initialize_distributed()  # multi-host TPU / multi-node GPU only; must precede any JAX computation
  # heavy imports (JAX, the model), after the flags are parsed: --help and a flag's error stay instant
  from minpro_jax.run.run_setup import setup_run
  from minpro_jax.run.trainer import Trainer
  from minpro_jax.runtime import multihost

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
  abort_line.exit_now(128 + signum)


def exit_quietly_on_signal(status: int) -> None:
  """After `main` returned `status`: a SIGTERM / SIGINT during the interpreter's teardown (orbax's and JAX's exit
  handlers, which can take seconds) ends the process at once with `status` and one line, instead of 143 / 130 and
  no word: the run's work is already written."""

  def finished(signum, frame):
    del frame
    sys.stderr.write(
        f"stopped by signal {signum} while exiting: the command had already finished (exit status {status}) and "
        "written its results; nothing is lost\n"
    )
    sys.stderr.flush()
    abort_line.exit_now(status)

  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, finished)


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
        abort_line.exit_now(128 + signum)
    os.close(read_fd)

  def stop():
    signal.set_wakeup_fd(previous)
    os.close(write_fd)

  threading.Thread(target=watch, name="signal-watch", daemon=True).start()
  return stop


def _on_peer_loss(config) -> None:
  """In a multi-process run, the line a lost peer ends every other process with names the newest checkpoint."""
  from minpro_jax.runtime.distributed import on_peer_loss  # JAX-free until the run starts

  on_peer_loss(lambda: f"{_newest_checkpoint(config)} with the same launch command on every host")


def _peer_ended(e: BaseException) -> bool:
  """Whether this process is one of several and `e` says another one ended (killed, crashed, its host lost)."""
  # JAX is loaded by now (the run started): the process count is known without starting anything
  from minpro_jax.runtime.distributed import peer_gone

  return "jax" in sys.modules and sys.modules["jax"].process_count() > 1 and peer_gone(e)


def _exit_peer_ended(config, e: BaseException) -> None:
  """A collective failed because another process ended: one line and the process ends (`report_peer_loss`)."""
  # JAX is loaded by now (the run started); the module-level imports stay JAX-free for --help and flag errors
  import jax

  from minpro_jax.runtime.distributed import report_peer_loss  # the same: imports JAX

  first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
  who = f"process {1 - jax.process_index()}" if jax.process_count() == 2 else "another process"
  report_peer_loss(who, f"{type(e).__name__}: {first}")


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
    _on_peer_loss(config)
    summary = _run(config)
  except UserError as e:
    if debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  except Exception as e:  # a bug, not a user mistake: the traceback, then where the work is
    if not debug and config is not None and _peer_ended(e):  # one line, and no wait in the shutdown barrier
      _exit_peer_ended(config, e)
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
  exit_status = main()
  exit_quietly_on_signal(exit_status)  # the command line's own process only: a test calling main keeps its handlers
  sys.exit(exit_status)
