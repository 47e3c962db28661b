"""tests/durations.py: the time report that survives a killed run, on hand-made phase records."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import durations  # noqa: E402


def test_summary_sums_phases_per_test_file_and_worker(tmp_path):
  rows = [
      ("tests/test_a.py::test_x", "setup", 2.0, "passed", "gw0", 102.0),
      ("tests/test_a.py::test_x", "call", 10.0, "passed", "gw0", 112.0),
      ("tests/test_b.py::test_y", "call", 30.0, "failed", "gw1", 130.0),
      ("tests/test_a.py::test_z", "call", 1.5, "passed", "gw0", 113.5),
  ]
  path = tmp_path / "times.jsonl"
  path.write_text(
      "".join(json.dumps(dict(zip(("test", "when", "s", "outcome", "worker", "end"), r))) + "\n" for r in rows)
  )
  text = durations.summarize(str(path), top=2)
  lines = text.splitlines()
  # span: from the first phase's start (112 - 10 = 102 - 2 = 100) to the last end (130)
  assert lines[0] == "3 tests, 1 failed, span 30 s; busy s per worker: gw0 14, gw1 30"
  assert lines[1] == "  failed: tests/test_b.py::test_y"
  assert lines[3:5] == ["      30.0  tests/test_b.py::test_y", "      12.0  tests/test_a.py::test_x"]
  assert lines[6:8] == ["      30.0  tests/test_b.py", "      13.5  tests/test_a.py"]
  assert durations.main([str(tmp_path / "missing.jsonl")]) == 1
