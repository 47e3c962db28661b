"""The ``MathProblem`` record and the load report used by every data source."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from minpro_jax.errors import UserError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MathProblem:
  """One math problem with a verifiable final answer.

  Attributes:
    id: unique, stable id (from the file, e.g. MATH-500 ``unique_id``, or ``"<file>:<line>"``).
    prompt: the problem statement (no chat template, no answer-format instruction).
    answer: ground-truth final answer as a string (LaTeX or plain; integers for DAPO/GSM8K/AIME).
    source: dataset name, e.g. ``"math500"``, ``"dapo"``, ``"reasoning_gym/chain_sum"``.
    metadata: JSON-serialisable extras (level, subject, original prompt, ...).

  Raises:
    TypeError: id, prompt, answer or source is not a str.
    ValueError: the prompt or the answer is empty or whitespace.
  """

  id: str
  prompt: str
  answer: str
  source: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

  def __post_init__(self):
    for name in ("id", "prompt", "answer", "source"):
      v = getattr(self, name)
      if not isinstance(v, str):
        raise TypeError(f"MathProblem.{name} must be str, got {type(v).__name__}")
    if not self.prompt.strip():
      raise ValueError(f"MathProblem {self.id!r}: empty prompt")
    if not self.answer.strip():
      raise ValueError(f"MathProblem {self.id!r}: empty answer")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "MathProblem":
    return cls(
        id=d["id"], prompt=d["prompt"], answer=d["answer"], source=d["source"], metadata=dict(d.get("metadata") or {})
    )


class DataError(UserError, ValueError):
  """A malformed row (raised only with ``strict=True``); the message names file and line."""


@dataclasses.dataclass
class LoadReport:
  """What a loader did: rows loaded, and each skipped row as ``(file, line, reason)``.

  Skip policy (documented in README): a row that is not valid JSON, not valid UTF-8, not an object, has an empty or
  missing prompt, a missing/empty answer, or fields of the wrong type is **skipped**, logged at WARNING with
  ``file:line: reason`` and recorded here; ``strict=True`` raises ``DataError`` on the first such row instead.
  """

  loaded: int = 0
  skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)

  def skip(self, file: str, line: int, reason: str, strict: bool) -> None:
    msg = f"{file}:{line}: {reason}"
    if strict:
      raise DataError(msg)
    logger.warning("skipping row %s", msg)
    self.skipped.append((file, line, reason))

  @property
  def num_skipped(self) -> int:
    return len(self.skipped)
