"""Worked-step SFT targets (`config.sft.target = "worked"`), built exactly from a generator's trace.

With `sft.target = "answer"` (the default) the warm start learns `" \\boxed{answer}"`; with `"worked"` it learns the
computation first, one step per operation, then the boxed answer. For reasoning-gym's `chain_sum`, whose problems
carry `metadata["expression"]` (e.g. `"2 - 3 + 2 - 5 + 9"`, answer 5), the steps are the running total from left
to right:

    " 2-3=-1 -1+2=1 1-5=-4 -4+9=5 \\boxed{5}"

A negative term (task_config `allow_negation=True`) is written in parentheses (`"4-(-3)=7"`). The last step's
result is checked against the problem's answer, so a target never teaches a wrong sum.

Which generators carry a trace (reasoning-gym 0.1.25, checked on the metadata of each): `chain_sum` (implemented).
Candidates not implemented: `decimal_chain_sum` (same `expression`, but decimal steps need exact rounding rules and
`reward.mode=math`), `products` (`expression` of one multiplication: no intermediate step), `gsm_symbolic`
(`answer_cot`, a written solution rather than a trace), `leg_counting` (its `animals` dict is dropped by
`reasoning_gym_problems`, which keeps scalar metadata only). `basic_arithmetic`'s `expression` has precedence and
parentheses (a trace would need an evaluator's order). A task is added by writing its `steps(metadata) -> (text,
value)` function into `TRACES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from minpro_jax.data.records import MathProblem
from minpro_jax.errors import ConfigError

SFT_TARGETS = ("answer", "worked")  # config.sft.target
TRACE_SOURCE = "reasoning_gym"  # config.data.source of every generator in TRACES


def chain_sum_steps(metadata: Mapping[str, Any]) -> tuple[str, int]:
  """The worked steps of a `chain_sum` problem and the value they reach.

  Args:
    metadata: the problem's metadata with "expression": integer terms separated by " + " / " - " (reasoning-gym
      0.1.25 `ChainSumDataset`), e.g. "15 + 43 - 72".

  Returns:
    ("15+43=58 58-72=-14", -14): one "a<op>b=c" step per operator, space-separated ("" for a single term).

  Raises:
    ValueError: no "expression", or one that is not integers joined by + and -.
  """
  expr = metadata.get("expression")
  if not isinstance(expr, str) or not expr.strip():
    raise ValueError("chain_sum problem without metadata['expression']")
  parts = expr.split()
  if len(parts) % 2 == 0 or any(op not in ("+", "-") for op in parts[1::2]):
    raise ValueError(f"chain_sum expression {expr!r} is not integers joined by + and -")
  try:
    terms = [int(t) for t in parts[0::2]]
  except ValueError:
    raise ValueError(f"chain_sum expression {expr!r} has a term that is not an integer") from None
  total, steps = terms[0], []
  for op, term in zip(parts[1::2], terms[1:]):
    new = total + term if op == "+" else total - term
    steps.append(f"{total}{op}{term if term >= 0 else f'({term})'}={new}")
    total = new
  return " ".join(steps), total


# reasoning-gym task -> steps(metadata) -> (steps text, final value)
TRACES: dict[str, Callable[[Mapping[str, Any]], tuple[str, int]]] = {"chain_sum": chain_sum_steps}


def has_trace(source: str, task: str) -> bool:
  """Whether problems of `config.data.source=source` (and `data.task=task`) carry a trace for worked targets."""
  return source == TRACE_SOURCE and task in TRACES


def worked_steps(problem: MathProblem) -> str:
  """The worked steps of `problem` (a reasoning-gym problem of a task in `TRACES`), ending at its answer.

  Raises:
    ValueError: the problem's source has no trace, its metadata holds none, or the trace does not reach the answer.
  """
  prefix = f"{TRACE_SOURCE}/"
  task = problem.source[len(prefix) :] if problem.source.startswith(prefix) else None
  if task not in TRACES:
    raise ValueError(f"problem {problem.id!r} of source {problem.source!r} has no trace; traced tasks: {list(TRACES)}")
  steps, value = TRACES[task](problem.metadata)
  if str(value) != problem.answer.strip():
    raise ValueError(f"problem {problem.id!r}: its trace reaches {value}, its answer is {problem.answer!r}")
  return steps


def check_sft_target(target: str, data_config) -> None:
  """Checks `config.sft.target` against `config.data` before any expensive work.

  Raises:
    ConfigError: naming `config.sft.target` and the fix: an unknown target, or `worked` for a source whose
      problems carry no trace.
  """
  if target not in SFT_TARGETS:
    raise ConfigError(f"config.sft.target: {target!r}; choose one of {SFT_TARGETS}")
  if target == "worked" and not has_trace(data_config.source, data_config.get("task", "")):
    what = (
        f"data.task={data_config.task!r}"
        if data_config.source == TRACE_SOURCE
        else f"data.source={data_config.source!r}"
    )
    raise ConfigError(
        f"config.sft.target: 'worked' needs problems that carry their computation, and {what} has none (traced: "
        f"data.source={TRACE_SOURCE} with data.task in {sorted(TRACES)}); set sft.target=answer or use a traced task"
    )
