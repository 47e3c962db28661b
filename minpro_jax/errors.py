"""The project's own error types: mistakes a user can fix, printed by the CLI as one message without a traceback.

Each message names what to change: `config.<field>: what is wrong; the fix`, or the file (and line) at fault.
`python -m minpro_jax.train` prints `error: <message>` and exits with status 2 for these (and for command-line
flag errors); `--debug` (or `MINPRO_DEBUG=1`) shows the traceback instead.
"""

from __future__ import annotations


class UserError(Exception):
  """Base class: a mistake in the config, the data, a model or tokenizer file, or the workdir."""


class ConfigError(UserError, ValueError):
  """A config field is invalid; the message starts with `config.<field>:` and says how to fix it."""


class FileFormatError(UserError, ValueError):
  """A model, tokenizer or checkpoint file cannot be read as what it should be; the message names the file."""


class CheckpointError(UserError, RuntimeError):
  """No run checkpoint in the workdir reads back; the message names the newest one and its error."""


class TrainingError(UserError, RuntimeError):
  """The run stopped because training went wrong (e.g. every update non-finite); the message names the newest
  checkpoint it left."""


class DiskFullError(UserError, OSError):
  """The workdir's disk has no room for the checkpoints the run writes; the message names `config.workdir`."""


class LaunchError(UserError, RuntimeError):
  """The processes of a multi-process run were not started alike (e.g. with different commands); the message
  names the processes."""


class LaunchEnvironmentError(LaunchError, ValueError):
  """A launch variable (MINPRO_DISTRIBUTED, JAX_NUM_PROCESSES, JAX_PROCESS_ID, SLURM_NTASKS, ...) holds an
  unusable value; the message names the variable and the values it takes."""
