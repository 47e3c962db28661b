"""Where a test run's time went, from the phases tests/conftest.py appends to .pytest_cache/test_times.jsonl.

Works on a finished run and on one that was killed or timed out (every finished phase is on file).

  python tests/durations.py [FILE] [--top N]

Prints the run's span (first to last phase end), each xdist worker's busy seconds, the N slowest tests
(setup + call + teardown) and the N slowest files.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "test_times.jsonl")


def summarize(path: str, top: int = 15) -> str:
  """The report as text; raises FileNotFoundError naming `path` when there is no such file."""
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  if not rows:
    return f"{path}: no test phase recorded"
  tests, files, workers = collections.Counter(), collections.Counter(), collections.Counter()
  failed = sorted({r["test"] for r in rows if r["outcome"] == "failed"})
  for r in rows:
    tests[r["test"]] += r["s"]
    files[r["test"].split("::")[0]] += r["s"]
    workers[r["worker"]] += r["s"]
  span = max(r["end"] for r in rows) - min(r["end"] - r["s"] for r in rows)
  out = [
      f"{len(tests)} tests, {len(failed)} failed, span {span:.0f} s; busy s per worker: "
      + ", ".join(f"{w} {s:.0f}" for w, s in sorted(workers.items()))
  ]
  out += [f"  failed: {t}" for t in failed]
  out.append(f"slowest {top} tests (s):")
  out += [f"  {s:8.1f}  {t}" for t, s in tests.most_common(top)]
  out.append(f"slowest {top} files (s):")
  out += [f"  {s:8.1f}  {t}" for t, s in files.most_common(top)]
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("path", nargs="?", default=DEFAULT)
  p.add_argument("--top", type=int, default=15)
  args = p.parse_args(argv)
  if not os.path.isfile(args.path):
    print(f"durations: no {args.path}; run the tests first (tests/conftest.py writes it)")
    return 1
  print(summarize(args.path, args.top))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
