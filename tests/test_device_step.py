"""`benchmarks/device_step.py --tiny` on the CPU: it times the budget's own compiled programs and writes every part."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_device_step_tiny_writes_every_part(tmp_path):
  out = tmp_path / "device_step.json"
  proc = subprocess.run([sys.executable, "benchmarks/device_step.py", "--tiny", f"--out={out}"], capture_output=True,
                        text=True, timeout=900)  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["device"]["platform"] == "cpu" and report["device"]["slice"].startswith("cpu:")
  parts = {p["part"]: p for p in report["parts"]}
  assert set(parts) == {"sampling", "sampling: decode step", "update"}
  keys = {"measured_seconds", "roofline_seconds", "forecast_seconds", "bound_seconds", "measured_over_forecast"}
  for p in parts.values():
    assert keys <= set(p)
    assert p["forecast_seconds"] is None and p["bound_seconds"] is None  # the CPU has no chip figures
  assert parts["sampling"]["measured_seconds"] > 0 and parts["update"]["measured_seconds"] > 0
  # 8 requests of 8 tokens on 8 rows: 7 decode steps after the prefill, as the budget's schedule replays them
  assert parts["sampling: decode step"]["iterations"] == 7
  assert report["response_lengths"] == {"min": 8, "mean": 8.0, "max": 8}
