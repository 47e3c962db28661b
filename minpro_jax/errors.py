"""The project's own error types: a user's mistake that names the field or file to fix."""

from __future__ import annotations


class ConfigError(ValueError):
  """A config field is invalid; the message starts with `config.<field>:` and says how to fix it."""
