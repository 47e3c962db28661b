"""Prompt templates and prompt encoding with a counted, logged skip of over-long prompts.

Templates:
  * ``"plain"``: ``"Question: {problem}\\nAnswer:"`` (base / from-scratch models).
  * ``"chat"``: the Qwen math prompt -- one user turn ``"{problem}\\nPlease reason step by step, and put your final
    answer within \\boxed{}."`` rendered with the tokenizer's chat template (Qwen3 / SmolLM2 ChatML).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from minpro_jax.data.records import MathProblem

logger = logging.getLogger(__name__)

PLAIN_TEMPLATE = "Question: {problem}\nAnswer:"
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("plain", "chat")


_NAMED_SKIPS = 5  # prompts skipped for length that get a warning line of their own


def format_prompt(
    problem: MathProblem | str, tokenizer=None, template: str = "chat", *, system: str | None = None, **chat_kwargs
) -> str:
  """Render one problem as prompt text.

  Args:
    problem: a MathProblem or the problem text.
    tokenizer: a ``minpro_jax.data.tokenizers.Tokenizer`` (needed for ``"chat"``).
    template: ``"plain"`` or ``"chat"``.
    system: optional system message (chat only; otherwise the template's default applies).
    **chat_kwargs: forwarded to ``apply_chat_template`` (e.g. ``enable_thinking=False`` for Qwen3).

  Raises:
    ValueError: unknown template, or ``"chat"`` without a tokenizer.
  """
  text = problem.prompt if isinstance(problem, MathProblem) else problem
  if template == "plain":
    return PLAIN_TEMPLATE.format(problem=text)
  if template != "chat":
    raise ValueError(f"template={template!r}; expected one of {TEMPLATES}")
  if tokenizer is None:
    raise ValueError("template='chat' needs a tokenizer (its chat template renders the turn)")
  messages = [{"role": "system", "content": system}] if system is not None else []
  messages.append({"role": "user", "content": f"{text}\n{BOXED_INSTRUCTION}"})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **chat_kwargs)


@dataclasses.dataclass
class EncodedPrompts:
  """Prompts that fit, aligned lists; ``skipped`` holds the ids of problems dropped for length."""

  problems: list[MathProblem]
  texts: list[str]
  token_ids: list[list[int]]
  skipped: list[str]


def encode_prompts(
    problems: Sequence[MathProblem],
    tokenizer,
    *,
    max_prompt_tokens: int,
    template: str = "chat",
    add_bos: bool | None = None,
    **format_kwargs,
) -> EncodedPrompts:
  """Format and tokenize problems; prompts longer than ``max_prompt_tokens`` are skipped (counted + logged).

  Args:
    problems: the batch.
    tokenizer: ``minpro_jax.data.tokenizers.Tokenizer``.
    max_prompt_tokens: keep prompts with at most this many tokens.
    template: see ``format_prompt``.
    add_bos: prepend bos; default True for ``"plain"`` (sentencepiece models), False for ``"chat"`` (ChatML
      templates start with ``<|im_start|>`` and Qwen3/SmolLM2 add no bos).

  Returns:
    ``EncodedPrompts``; never raises for a long prompt (a whole batch may come back empty: check
    ``len(result.problems)``).

  Raises:
    ValueError: ``max_prompt_tokens <= 0``, or a bad template (``format_prompt``).
  """
  if max_prompt_tokens <= 0:
    raise ValueError(f"max_prompt_tokens={max_prompt_tokens} must be positive")
  if add_bos is None:
    add_bos = template == "plain"
  out = EncodedPrompts([], [], [], [])
  for p in problems:
    text = format_prompt(p, tokenizer, template, **format_kwargs)
    ids = tokenizer.encode(text, add_bos=add_bos)
    if len(ids) > max_prompt_tokens:
      out.skipped.append(p.id)
      if len(out.skipped) <= _NAMED_SKIPS:
        logger.warning("skipping prompt %s: %d tokens > max_prompt_tokens=%d", p.id, len(ids), max_prompt_tokens)
      continue
    out.problems.append(p)
    out.texts.append(text)
    out.token_ids.append(ids)
  if len(out.skipped) > _NAMED_SKIPS:  # one line for the rest, not one per prompt
    logger.warning(
        "skipped %d prompts in all (%d named above) longer than max_prompt_tokens=%d",
        len(out.skipped),
        _NAMED_SKIPS,
        max_prompt_tokens,
    )
  return out
