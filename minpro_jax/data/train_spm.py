"""Train the sentencepiece model of the tiny from-scratch configs, reproducibly.

Usage (the corpus is the task prompts + answers the model will see; fixed seeds give a byte-identical .model):

  python -m minpro_jax.data.train_spm --out runs/spm/tiny.model --vocab_size 512 \\
      --task chain_sum:2000 --task basic_arithmetic:2000 [--jsonl data/train.jsonl] [--seed 0]

Prints the sha256 of the written model.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

from minpro_jax.data.prompts import BOXED_INSTRUCTION, PLAIN_TEMPLATE
from minpro_jax.data.sources import load_file, reasoning_gym_problems
from minpro_jax.data.spm import train_sentencepiece


def corpus_from_problems(problems) -> list[str]:
  """Training sentences: the plain prompt, the chat instruction and a boxed answer line per problem (in order)."""
  texts = []
  for p in problems:
    texts.append(PLAIN_TEMPLATE.format(problem=p.prompt))
    texts.append(f"The answer is \\boxed{{{p.answer}}}.")
  texts.append(BOXED_INSTRUCTION)
  return texts


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--vocab_size", type=int, default=512)
  ap.add_argument("--seed", type=int, default=0, help="sentencepiece seed and reasoning-gym seed")
  ap.add_argument("--task", action="append", default=[], help="reasoning-gym task NAME:SIZE (repeatable)")
  ap.add_argument("--jsonl", action="append", default=[], help="local problem file (fmt auto; repeatable)")
  args = ap.parse_args(argv)
  problems = []
  for spec in args.task:
    name, _, size = spec.partition(":")
    problems += reasoning_gym_problems(name, int(size or 1000), args.seed)
  for path in args.jsonl:
    problems += load_file(path)
  if not problems:
    ap.error("give at least one --task or --jsonl")
  path = train_sentencepiece(corpus_from_problems(problems), args.vocab_size, args.out, seed=args.seed)
  with open(path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  print(f"wrote {path} ({len(problems)} problems, vocab {args.vocab_size}) sha256={digest}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
