"""Evaluation: unbiased pass@k, avg@n, maj@k, per-benchmark and macro-average tables (JSON + Markdown).

``evaluate`` is sampler-agnostic: it takes ``generate_fn(prompts, n, seed) -> list[list[str]]`` (n response texts
per prompt), grades every response with ``rewards.math_reward`` and aggregates. The trainer wires its JAX sampler
into ``generate_fn``. In a multi-process run every process holds every response and grades its share of them
(``grade_split``); the tables are computed over all of them, on every process.

Estimators (per problem with n samples, c of them correct; the benchmark value is the mean over problems):
  * pass@k = 1 - C(n-c, k) / C(n, k)  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1),
    computed as the stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i). Requires k <= n; k > n is **rejected**
    (``ValueError``; ``evaluate`` omits such k) because no unbiased estimate exists -- never 1.0 (case B22). A
    with-replacement bootstrap "best@k" (1 - (1 - c/n)^k) is *not* pass@k and is not used.
  * avg@n = c / n (mean accuracy of the n samples; its expectation equals pass@1).
  * maj@k = correctness of the most frequent extracted answer among the first k samples (answers compared after
    ``rewards.normalize_answer``; ties go to the answer seen first; responses without an answer do not vote).
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from minpro_jax.data.prompts import format_prompt
from minpro_jax.data.records import MathProblem
from minpro_jax.data.rewards import extract_answer, grade, normalize_answer
from minpro_jax.runtime import multihost

GenerateFn = Callable[[list[str], int, int], list[list[str]]]


def grade_split(
    responses: Sequence[str | None], ground_truths: Sequence[Any], **kwargs: Any
) -> tuple[list[float], dict[str, int]]:
  """``rewards.grade`` with the rows split over the run's processes (`multihost.process_rows`).

  Every process passes N responses, of which it reads only its share (the others may be None: a process need not
  decode them); each grades its share, and the N rewards and the summed statistics come back on every process (the
  same values ``grade`` gives in one process). Every process must call it at the same point. Arguments, returns
  and errors as ``rewards.grade``.
  """
  n = len(responses)
  if len(ground_truths) != n:
    raise ValueError(f"len(responses)={n} != len(ground_truths)={len(ground_truths)}")
  if multihost.process_count() == 1:
    return grade(responses, ground_truths, **kwargs)
  rows = multihost.process_rows(n)
  truncated = kwargs.pop("truncated", False)
  if not isinstance(truncated, bool):
    truncated = list(truncated)[rows]
  rewards, stats = grade(list(responses)[rows], list(ground_truths)[rows], truncated=truncated, **kwargs)
  rewards = multihost.gather_rows(np.asarray(rewards, np.float64), n)
  keys = sorted(stats)
  totals = multihost.sum_over_processes(np.asarray([stats[k] for k in keys], np.int64))
  return [float(r) for r in rewards], {k: int(v) for k, v in zip(keys, totals)}


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one problem (Chen et al. 2021, eq. 1).

  Args:
    n: samples drawn (int >= 1). c: correct samples (0 <= c <= n). k: budget (1 <= k <= n).

  Raises:
    ValueError: ``k > n`` (no unbiased estimate; case B22 of tests/CASES.md), or out-of-range or non-int arguments.
  """
  for name, v in (("n", n), ("c", c), ("k", k)):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
      raise ValueError(f"{name}={v!r} must be an int")
  if n < 1 or k < 1 or not 0 <= c <= n:
    raise ValueError(f"need n >= 1, k >= 1, 0 <= c <= n; got n={n}, c={c}, k={k}")
  if k > n:
    raise ValueError(f"pass@{k} needs at least k samples per problem; got n={n} (draw more samples or lower k)")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def avg_at_n(correct: Sequence[bool | float]) -> float:
  """Mean correctness of the samples of one problem (avg@n).

  Raises:
    ValueError: no samples.
  """
  if len(correct) == 0:
    raise ValueError("avg_at_n of zero samples")
  return float(np.mean(np.asarray(correct, dtype=np.float64)))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | float], k: int) -> float:
  """Majority-vote correctness over the first ``k`` samples.

  Args:
    answers: extracted answers per sample (None = no answer; does not vote).
    correct: per-sample correctness (truthy = correct), aligned with ``answers``.
    k: votes used (<= len(answers)).

  Raises:
    ValueError: ``k`` out of range or misaligned inputs.
  """
  if len(answers) != len(correct):
    raise ValueError(f"len(answers)={len(answers)} != len(correct)={len(correct)}")
  if not 1 <= k <= len(answers):
    raise ValueError(f"maj@{k} needs 1 <= k <= {len(answers)} samples")
  counts: collections.OrderedDict[str, int] = collections.OrderedDict()
  first: dict[str, int] = {}
  for i in range(k):
    if answers[i] is None:
      continue
    key = normalize_answer(answers[i])
    counts[key] = counts.get(key, 0) + 1
    first.setdefault(key, i)
  if not counts:
    return 0.0
  best = max(counts, key=lambda a: (counts[a], -first[a]))
  return float(bool(correct[first[best]]))


def score_samples(
    correct: Sequence[Sequence[bool | float]], answers: Sequence[Sequence[str | None]] | None, ks: Sequence[int]
) -> dict[str, Any]:
  """Aggregate per-problem sample correctness into ``{"avg@n", "pass@k": {k: v}, "maj@k": {k: v}}``.

  ``correct`` is [P][n] (every problem has the same n). k > n is omitted (reported under ``"omitted_k"``).
  ``answers`` (same [P][n] shape, None = no answer) adds ``"maj@k"``; None leaves it out.

  Raises:
    ValueError: no problems, or problems with different sample counts.
  """
  if not correct:
    raise ValueError("no problems to score")
  n = len(correct[0])
  if any(len(c) != n for c in correct):
    raise ValueError("every problem needs the same number of samples n")
  cs = [int(sum(bool(x) for x in row)) for row in correct]
  valid = [k for k in ks if k <= n]
  out: dict[str, Any] = {
      "num_problems": len(correct),
      "n": n,
      f"avg@{n}": float(np.mean([c / n for c in cs])),
      "pass@k": {str(k): float(np.mean([pass_at_k(n, c, k) for c in cs])) for k in valid},
  }
  if answers is not None:
    out["maj@k"] = {str(k): float(np.mean([maj_at_k(a, r, k) for a, r in zip(answers, correct)])) for k in valid}
  if len(valid) < len(ks):
    out["omitted_k"] = [k for k in ks if k > n]
  return out


def evaluate(
    generate_fn: GenerateFn,
    benchmarks: Mapping[str, Sequence[MathProblem]],
    n: int,
    ks: Sequence[int] = (1,),
    *,
    prompt_fn: Callable[[MathProblem], str] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    modes: Mapping[str, str] | str = "math",
    out_dir: str | None = None,
    name: str = "eval",
    **grade_kwargs: Any,
) -> dict[str, Any]:
  """Sample ``n`` responses per problem, grade them, and build per-benchmark + macro-average tables.

  Args:
    generate_fn: ``(prompts: list[str], n: int, seed: int) -> list[list[str]]``, n texts per prompt.
    benchmarks: name -> problems.
    n: samples per problem. ks: pass@k / maj@k budgets (k > n omitted).
    prompt_fn: problem -> prompt text (default: ``data.prompts.format_prompt(p, template="plain")``; for chat
      models pass ``lambda p: format_prompt(p, tokenizer, "chat")``).
    seed: base seed; batch b of benchmark j is sampled with ``seed + 1000003 * j + b``.
    batch_size: prompts per ``generate_fn`` call.
    modes: grading mode for every benchmark (str) or per benchmark name (default "math").
    out_dir: if given, write ``{name}.json`` and ``{name}.md`` there.
    **grade_kwargs: forwarded to ``rewards.grade`` (e.g. ``timeout_s``, ``last_number``).

  Returns:
    ``{"benchmarks": {name: {... scores ..., "grading": stats}}, "macro": {...}, "samples": {name: [...]}}``;
    ``"macro"`` averages each metric over benchmarks with equal weight.

  Raises:
    ValueError: empty benchmark, wrong number of responses from ``generate_fn``.
  """
  if n < 1:
    raise ValueError(f"n={n} must be >= 1")
  if prompt_fn is None:
    prompt_fn = lambda p: format_prompt(p, template="plain")  # noqa: E731
  results: dict[str, Any] = {
      "benchmarks": {},
      "macro": {},
      "samples": {},
      "config": {"n": n, "ks": list(ks), "seed": seed},
  }
  for j, (bench, problems) in enumerate(benchmarks.items()):
    if not problems:
      raise ValueError(f"benchmark {bench!r} has no problems")
    mode = modes if isinstance(modes, str) else modes.get(bench, "math")
    responses: list[list[str]] = []
    for b, start in enumerate(range(0, len(problems), batch_size)):
      chunk = problems[start : start + batch_size]
      out = generate_fn([prompt_fn(p) for p in chunk], n, seed + 1000003 * j + b)
      if len(out) != len(chunk) or any(len(r) != n for r in out):
        raise ValueError(f"generate_fn returned {[len(r) for r in out]} responses for {len(chunk)} prompts x n={n}")
      responses.extend(out)
    flat = [r for rs in responses for r in rs]
    golds = [p.answer for p in problems for _ in range(n)]
    rewards, stats = grade_split(flat, golds, mode=mode, **grade_kwargs)
    correct = [[rewards[i * n + s] >= 1.0 for s in range(n)] for i in range(len(problems))]
    answers = [[extract_answer(r) for r in rs] for rs in responses]
    scores = score_samples(correct, answers, ks)
    scores["grading"] = stats
    results["benchmarks"][bench] = scores
    results["samples"][bench] = [
        {"id": p.id, "answer": p.answer, "extracted": a, "correct": c} for p, a, c in zip(problems, answers, correct)
    ]
  results["macro"] = macro_average(results["benchmarks"])
  if out_dir is not None:
    write_report(results, out_dir, name)
  return results


def _metric_items(scores: Mapping[str, Any]) -> list[tuple[str, float]]:
  items = [(k, v) for k, v in scores.items() if k.startswith("avg@")]
  items += [(f"pass@{k}", v) for k, v in scores.get("pass@k", {}).items()]
  items += [(f"maj@{k}", v) for k, v in scores.get("maj@k", {}).items()]
  return items


def macro_average(bench_scores: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
  """Each metric's mean over benchmarks with equal weight (a metric some benchmark lacks is left out)."""
  per_metric: dict[str, list[float]] = collections.defaultdict(list)
  for scores in bench_scores.values():
    for metric, v in _metric_items(scores):
      per_metric[metric].append(v)
  nb = len(bench_scores)
  return {m: float(np.mean(v)) for m, v in per_metric.items() if len(v) == nb}


def to_markdown(results: Mapping[str, Any]) -> str:
  """Markdown table: one row per benchmark plus the macro average; values in percent with one decimal."""
  benches = results["benchmarks"]
  metrics: list[str] = []
  for scores in benches.values():
    for m, _ in _metric_items(scores):
      if m not in metrics:
        metrics.append(m)
  head = "| benchmark | problems | " + " | ".join(metrics) + " |"
  sep = "|---|---:|" + "---:|" * len(metrics)
  rows = [head, sep]

  def fmt(v):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}"

  for b, scores in benches.items():
    vals = dict(_metric_items(scores))
    rows.append(f"| {b} | {scores['num_problems']} | " + " | ".join(fmt(vals.get(m)) for m in metrics) + " |")
  macro = results.get("macro", {})
  rows.append("| **macro avg** | | " + " | ".join(fmt(macro.get(m)) for m in metrics) + " |")
  return "\n".join(rows) + "\n"


def write_report(results: Mapping[str, Any], out_dir: str, name: str = "eval") -> tuple[str, str]:
  """Write ``{out_dir}/{name}.json`` (everything) and ``{out_dir}/{name}.md`` (the table); returns both paths."""
  os.makedirs(out_dir, exist_ok=True)
  jp, mp = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.md")
  with open(jp, "w") as f:
    json.dump(results, f, indent=1)
  with open(mp, "w") as f:
    f.write(to_markdown(results))
  return jp, mp
