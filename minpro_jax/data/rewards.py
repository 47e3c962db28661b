"""Answer extraction and verifiable math rewards.

``extract_answer`` finds the model's final answer; ``math_reward`` grades it against the ground truth with
`math-verify <https://github.com/huggingface/Math-Verify>`_ (symbolic equivalence) plus the rules it lacks
(Bnn: the case ids of tests/CASES.md):

* Extraction (our own; math-verify's extractor concatenates all boxes and falls back to any number in the text):
  the **last** ``\\boxed{...}``/``\\fbox{...}`` with balanced nested braces wins (B16, B20). If the last box is
  unclosed (truncated response) there is no answer (B16). Without a box: the text after the last ``####`` (GSM8K),
  then the last final-answer phrase ("The answer is X", "Final answer: X", "answer: X"). Optionally
  (``last_number=True``, "final-number mode") the last number in the text. The whole text is never handed to the
  verifier (B19).
* Normalisation: ``{,}`` and ``\\,`` inside numbers, and well-formed thousands groups (``8,000``, ``-1,234.5``) are
  un-grouped; malformed groups (``12,34``) and lists (``3,5,7``, ``0,1``) are kept, so they stay tuples/sets and
  never fuse into one integer (B17); a first group starts with 1-9 (``0,125`` is not 125, B43). Signs are kept
  (B18). A trailing unit word after a value (``12 \\text{ ft}``, ``2\\sqrt3\\text{ cm}^2``) is dropped (B40).
* Percent (B40): a percent sign is optional on either side (``25\\%`` = ``25``), and math-verify also reads
  ``25\\%`` as 0.25, so gold ``25\\%`` accepts ``25\\%``, ``25`` and ``0.25``.
* Exactness: if both sides parse to exact rationals (integers, fractions, powers of them), they must be equal
  exactly -- math-verify's 6-decimal numeric tolerance would say 1/2^99 == 1/2^98 (B21). If one side is a decimal
  (a float), math-verify's rule applies: values equal after rounding to 6 decimals. Hence "1/12" vs "0.0833" is
  **wrong** and "1/12" vs "0.083333" is **right** (B21's implementation-defined case).
* ``mode="integer"`` (DAPO-Math-17K style): the gold must be an integer; the prediction must be exactly that
  integer (a literal like ``8,000`` or an exact expression like ``2^{10}``), never a float approximation.
* Bounded time: answers longer than ``max_answer_chars`` and expressions whose exact evaluation would be
  astronomically large (``10^{10^{10}}``, ``(x+1)^{100000}``, ``100000000!``) are refused before evaluation, because
  CPython big-int arithmetic cannot be interrupted by a signal; everything else runs under a ``SIGALRM`` timer of
  ``timeout_s`` (main thread only; in other threads only the pre-screen applies). A timeout or refusal scores 0 and is
  counted in ``STATS`` (module-level ``collections.Counter``) and in ``grade``'s returned stats.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import re
import signal
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

logger = logging.getLogger(__name__)

# Module-level counters: "graded", "correct", "no_answer", "timeout", "refused", "error".
STATS: collections.Counter = collections.Counter()

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PHRASE_RE = re.compile(r"(?:final\s+answer|the\s+answer|answer)\s*(?:is\s*[:=]?|[:=])\s*", re.IGNORECASE)
_NUM_RE = re.compile(r"(?<![\w)\]}.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_THOUSANDS_RE = re.compile(r"^[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")  # a first group of 0 is no group (B43)
_PERCENT_RE = re.compile(r"^(.+?)\s*\\?%$")
_UNIT_RE = re.compile(r"(?<=[\d}).])\s*\\(?:text|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?[23]\}?)?$")
_INT_RE = re.compile(r"^[+-]?\d+$")
_DEC_RE = re.compile(r"^[+-]?\d+\.\d+$")


class _NoTimeoutWarning(logging.Filter):
  """We bound time ourselves (``_time_limit``), so math-verify's "Timeout is disabled" warning is noise."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader", "math_verify.utils", "math_verify"):
  logging.getLogger(_name).addFilter(_NoTimeoutWarning())


class VerifyTimeout(BaseException):
  """Raised inside the guarded region when ``timeout_s`` elapses (a BaseException so that the broad
  ``except Exception`` blocks inside sympy/math-verify cannot swallow it)."""


# ----------------------------------------------------------------------------------------------- extraction
def last_box(text: str) -> tuple[bool, str | None]:
  """(found_any_box, content of the last box or None if that box is unclosed)."""
  starts = [m.end() for m in _BOX_RE.finditer(text)]
  if not starts:
    return False, None
  i = starts[-1]
  depth = 1
  for j in range(i, len(text)):
    c = text[j]
    if c == "{" and text[j - 1] != "\\":
      depth += 1
    elif c == "}" and text[j - 1] != "\\":
      depth -= 1
      if depth == 0:
        return True, text[i:j].strip()
  return True, None


_LEAD_NUM_RE = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?=$|\s|[.;!?,](?:\s|$))")


def _clip_value(s: str) -> str | None:
  """The answer at the start of ``s`` (after ``####`` or a final-answer phrase).

  A math span (``$..$``, ``\\(..\\)``, ``\\[..\\]``) gives its inside; a leading number followed by a break
  gives the number ("42 and so on" -> "42"; "3,5,7" is not a number and stays whole); otherwise the text up to
  the end of the line or the first punctuation followed by whitespace.
  """
  s = s.lstrip()
  if not s:
    return None
  for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(open_):
      end = s.find(close, len(open_))
      return s[len(open_) : end].strip() if end > 0 else None
  m = _LEAD_NUM_RE.match(s)
  if m:
    return m.group(0)
  m = re.search(r"\n|[.,;!?](?:\s|$)", s)
  val = (s[: m.start()] if m else s).strip().rstrip(".")
  return val or None


def extract_answer(text: str, *, last_number: bool = False) -> str | None:
  """Extract the final answer string from a model response.

  Priority: last ``\\boxed{}``/``\\fbox{}`` (nested braces; unclosed last box -> None), else text after the last
  ``####``, else the last final-answer phrase, else (only if ``last_number``) the last number (sign and
  thousands separators kept, e.g. ``-1,234.5``).

  Args:
    text: the response (str).
    last_number: "final-number mode": fall back to the last number in the text.

  Returns:
    The raw answer string (not normalised) or None.

  Raises:
    TypeError: ``text`` is not a str.
  """
  if not isinstance(text, str):
    raise TypeError(f"text must be str, got {type(text).__name__}")
  found, box = last_box(text)
  if found:
    return box or None
  k = text.rfind("####")
  if k >= 0:
    return _clip_value(text[k + 4 :])
  phrases = list(_PHRASE_RE.finditer(text))
  if phrases:
    val = _clip_value(text[phrases[-1].end() :])
    if val:
      return val
  if last_number:
    nums = _NUM_RE.findall(text)
    if nums:
      return nums[-1]
  return None


# ----------------------------------------------------------------------------------------------- normalisation
def normalize_answer(ans: str) -> str:
  """Light, meaning-preserving clean-up before parsing (see module docstring)."""
  s = ans.strip()
  s = re.sub(r"^\$+|\$+$", "", s).strip()
  s = re.sub(r"^\\\(|\\\)$", "", s).strip()
  s = _UNIT_RE.sub("", s)  # a trailing unit after a value: "12 \\text{ ft}", "2\\sqrt3\\text{ cm}^2" (B40)
  s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
  s = re.sub(r"(?<=\d),\\!\s*(?=\d)", ",", s)  # LaTeX's thousands separator: 11,\! 111 (Math-Verify's tests)
  s = s.replace("\\!", "").replace("\\left", "").replace("\\right", "")
  s = re.sub(r"(?<=\d)\{,\}(?=\d)", ",", s)
  s = re.sub(r"(?<=\d)\\,(?=\d)", ",", s)
  s = re.sub(r"\\(?:dfrac|tfrac)", r"\\frac", s)
  s = s.rstrip(".").strip()
  if _THOUSANDS_RE.match(s):
    s = s.replace(",", "")
  return s


# ----------------------------------------------------------------------------------------------- cost guard
_HUGE = 1e6  # bits; a number above ~300k decimal digits is refused


def _log2_size(e) -> float:
  """Upper bound on log2 of the magnitude of an exact numeric sympy subtree (inf if unbounded/too big)."""
  if isinstance(e, sympy.Integer):
    return float(max(abs(int(e)).bit_length(), 1))
  if isinstance(e, sympy.Rational):
    return float(max(abs(e.p).bit_length(), abs(e.q).bit_length(), 1))
  if isinstance(e, sympy.Float) or e.is_NumberSymbol or isinstance(e, sympy.Symbol):
    return 64.0
  if isinstance(e, sympy.Pow):
    b, x = _log2_size(e.base), _log2_size(e.exp)
    if x > 40:
      return math.inf
    try:
      xv = abs(float(e.exp.evalf(20))) if e.exp.is_number else 2.0**x
    except Exception:  # noqa: BLE001
      xv = 2.0**x
    return b * max(xv, 1.0)
  if isinstance(e, sympy.factorial):
    n = _log2_size(e.args[0])
    return math.inf if n > 30 else (2.0**n) * n
  if not e.args:
    return 64.0
  return sum(_log2_size(a) for a in e.args) + len(e.args)


def _too_expensive(obj) -> bool:
  if isinstance(obj, (sympy.Basic, sympy.MatrixBase)):
    try:
      exprs = [obj] if isinstance(obj, sympy.Basic) else list(obj)
      for ex in exprs:
        for node in sympy.preorder_traversal(ex):
          if isinstance(node, (sympy.Pow, sympy.factorial)) and _log2_size(node) > _HUGE:
            return True
    except RecursionError:
      return True
  return False


@contextlib.contextmanager
def _time_limit(seconds: float | None):
  if not seconds or threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    raise VerifyTimeout(f"verification exceeded {seconds} s")

  old = signal.signal(signal.SIGALRM, handler)
  # The handler runs in whichever Python frame is current; when that is a gc callback (JAX registers one), the
  # exception is swallowed as "unraisable". The interval re-raises every 50 ms until one reaches the caller.
  signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------------------------- grading
def _mv_parse(s: str) -> list:
  return parse(
      f"${s}$",
      extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
      parsing_timeout=None,
      raise_on_error=True,
  )


def _exact_rational(x) -> Fraction | None:
  """Exact value of a float-free numeric sympy expression that is rational (after ``doit``), else None."""
  if isinstance(x, sympy.Basic) and x.is_number and not x.atoms(sympy.Float):
    try:
      v = x.doit()
    except Exception:  # noqa: BLE001
      return None
    if isinstance(v, sympy.Rational):
      return Fraction(int(v.p), int(v.q))
  return None


def _literal_fraction(s: str) -> Fraction | None:
  if _INT_RE.match(s) or _DEC_RE.match(s):
    return Fraction(s)
  return None


def _equivalent(pred: str, gold: str, mode: str) -> bool:
  """Compare normalised strings; may raise VerifyTimeout / _Refused."""
  if pred == gold:
    return True
  mp, mg = _PERCENT_RE.match(pred), _PERCENT_RE.match(gold)
  if (mp or mg) and _equivalent(mp.group(1) if mp else pred, mg.group(1) if mg else gold, mode):
    return True  # a percent sign is optional on either side: 25\% = 25 (and = 0.25 by math-verify below), B40
  fp, fg = _literal_fraction(pred), _literal_fraction(gold)
  if mode == "integer":
    if fp is not None:
      return fp == fg
  elif fp is not None and fg is not None and ("." not in pred and "." not in gold):
    return fp == fg
  p_parsed, g_parsed = _mv_parse(pred), _mv_parse(gold)
  if not p_parsed or not g_parsed:
    return False
  if any(_too_expensive(x) for x in (p_parsed[0], g_parsed[0])):
    raise _Refused()
  rp, rg = _exact_rational(p_parsed[0]), _exact_rational(g_parsed[0])
  if mode == "integer":
    return rp is not None and rp == fg
  if rp is not None and rg is not None:
    return rp == rg
  return bool(verify(g_parsed, p_parsed, timeout_seconds=None, raise_on_error=False))


class _Refused(Exception):
  pass


def math_reward(
    response: str,
    ground_truth: str | int | float,
    *,
    mode: str = "math",
    format_reward: float = 0.0,
    last_number: bool = False,
    truncated: bool = False,
    timeout_s: float | None = 5.0,
    max_answer_chars: int = 512,
    stats: collections.Counter | None = None,
) -> float:
  """Verifiable reward: 1.0 if the response's final answer equals ``ground_truth``, else ``format_reward`` if an
  answer was extracted but is wrong, else 0.0.

  Args:
    response: model output text.
    ground_truth: gold answer (LaTeX/plain string, or int/float).
    mode: ``"math"`` (symbolic equivalence via math-verify, exact for rationals) or ``"integer"`` (exact integer).
    format_reward: opt-in partial credit for a well-formed but wrong answer (default 0.0, i.e. binary 1/0).
    last_number: final-number mode (see ``extract_answer``); ignored when ``truncated``.
    truncated: the response hit the length limit (finish_reason == "length"); disables the last-number fallback,
      so an intermediate number is never taken as the answer (B19).
    timeout_s: wall-clock bound on parsing + verification (SIGALRM; main thread only). None disables.
    max_answer_chars: longer extracted answers are refused (score 0, counted as "refused").
    stats: Counter to update (defaults to the module-level ``STATS``).

  Returns:
    float reward in {0.0, format_reward, 1.0}.

  Raises:
    ValueError: unknown ``mode``, or ``mode="integer"`` with a non-integer ground truth.
  """
  if mode not in ("math", "integer"):
    raise ValueError(f"mode={mode!r}; expected 'math' or 'integer'")
  if mode == "integer":
    g = normalize_answer(str(ground_truth))
    if not _INT_RE.match(g):
      raise ValueError(f"mode='integer' needs an integer ground_truth, got {ground_truth!r}")
  st = STATS if stats is None else stats
  st["graded"] += 1
  ans = extract_answer(response, last_number=last_number and not truncated)
  if ans is None:
    st["no_answer"] += 1
    return 0.0
  if len(ans) > max_answer_chars:
    st["refused"] += 1
    return float(format_reward)
  pred, gold = normalize_answer(ans), normalize_answer(str(ground_truth))
  try:
    with _time_limit(timeout_s):
      ok = _equivalent(pred, gold, mode)
  except VerifyTimeout:
    st["timeout"] += 1
    logger.warning("math_reward: verification timed out after %s s on answer %.80r", timeout_s, ans)
    return 0.0
  except _Refused:
    st["refused"] += 1
    return float(format_reward)
  except Exception:  # noqa: BLE001  (sympy raises many types on odd input; an unparsable answer is just wrong)
    st["error"] += 1
    logger.debug("math_reward: error grading %.80r", ans, exc_info=True)
    return float(format_reward)
  if ok:
    st["correct"] += 1
    return 1.0
  return float(format_reward)


def grade(responses: Sequence[str], ground_truths: Sequence[Any], **kwargs: Any) -> tuple[list[float], dict[str, int]]:
  """Batched ``math_reward``.

  Args:
    responses: N response strings.
    ground_truths: N gold answers (same order), or one gold per response.
    **kwargs: forwarded to ``math_reward`` (mode, format_reward, last_number, timeout_s, ...). ``truncated`` may be
      a sequence of N bools.

  Returns:
    (rewards: list of N floats, stats: dict with counts graded/correct/no_answer/timeout/refused/error).

  Raises:
    ValueError: length mismatch.
  """
  if len(responses) != len(ground_truths):
    raise ValueError(f"len(responses)={len(responses)} != len(ground_truths)={len(ground_truths)}")
  truncated = kwargs.pop("truncated", False)
  if isinstance(truncated, bool):
    truncated = [truncated] * len(responses)
  if len(truncated) != len(responses):
    raise ValueError(f"len(truncated)={len(truncated)} != len(responses)={len(responses)}")
  st: collections.Counter = collections.Counter()
  rewards = [
      math_reward(r, g, truncated=bool(t), stats=st, **kwargs) for r, g, t in zip(responses, ground_truths, truncated)
  ]
  STATS.update(st)
  out = {k: int(st.get(k, 0)) for k in ("graded", "correct", "no_answer", "timeout", "refused", "error")}
  return rewards, out


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
  """DAPO's soft overlong penalty (Yu et al. 2025, arXiv 2503.14476, eq. 13), capped at -factor (case B32).

  With L_max = `max_length` and L_cache = `buffer`: 0 for `length <= L_max - L_cache`, then
  -(length - (L_max - L_cache)) / L_cache * factor, and at most -factor in magnitude (lengths past L_max, e.g. a
  stop token counted after the budget, cannot push it below -factor). The trainer adds it to the grader's reward of
  every response; `length` counts response tokens only, the stop token included.

  Args:
    length: response tokens (>= 0).
    max_length: the response budget L_max (`sampling.max_new_tokens`).
    buffer: L_cache, 0 < buffer <= max_length.
    factor: the penalty at and past L_max (>= 0).

  Raises:
    ValueError: buffer outside (0, max_length] or a negative factor.
  """
  if not 0 < buffer <= max_length:
    raise ValueError(f"overlong buffer={buffer} must lie in (0, max_length={max_length}]")
  if factor < 0:
    raise ValueError(f"overlong factor={factor} must be >= 0")
  over = length - (max_length - buffer)
  return -factor * min(max(over, 0), buffer) / buffer
