"""colab/minpro_jax_quickstart.ipynb: valid nbformat-4 JSON, in sync with colab/build_quickstart.py, and its
Python cells (everything not starting with "!" or "%") run: the objectives demo prints the V1 numbers of the
algorithms note, the plot cell draws a small metrics.jsonl, the device cell lists the devices."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "colab", "minpro_jax_quickstart.ipynb")


def _load():
  with open(NOTEBOOK) as f:
    return json.load(f)


def _source(cell):
  src = cell["source"]
  return "".join(src) if isinstance(src, list) else src


def _python_cells(nb):
  return [
      _source(c) for c in nb["cells"] if c["cell_type"] == "code" and not _source(c).lstrip().startswith(("!", "%"))
  ]


def test_notebook_structure():
  nb = _load()
  assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 4
  assert nb["metadata"]["kernelspec"]["language"] == "python"
  assert len(nb["cells"]) >= 8
  for cell in nb["cells"]:
    assert cell["cell_type"] in ("markdown", "code")
    assert isinstance(cell["metadata"], dict) and isinstance(_source(cell), str) and _source(cell).strip()
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None
  shell = "\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "code")
  assert "!pip install -q -r requirements.txt" in shell
  assert "!pip install -q --no-deps git+https://" in shell
  assert "--config=minpro_jax/configs/default.py --config.total_steps=6 --config.workdir=runs/colab" in shell
  assert "--config.mesh.shape=data=8" in shell
  # Shell cells hold only "!"/"%" lines, Python cells none: the split the test below relies on.
  for cell in nb["cells"]:
    src = _source(cell)
    if cell["cell_type"] == "code" and src.lstrip().startswith(("!", "%")):
      assert all(line.startswith(("!", "%")) for line in src.splitlines()), src
  try:
    import nbformat
  except ImportError:
    return
  nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))


def test_notebook_matches_generator():
  sys.path.insert(0, os.path.join(ROOT, "colab"))
  try:
    import build_quickstart
  finally:
    sys.path.pop(0)
  with open(NOTEBOOK) as f:
    assert f.read() == build_quickstart.render(), "notebook is stale: run .venv/bin/python colab/build_quickstart.py"


def test_python_cells_run_and_print_v1(tmp_path):
  cells = _python_cells(_load())
  assert len(cells) == 3 and "policy_loss" in cells[0]
  workdir = tmp_path / "runs" / "colab"
  workdir.mkdir(parents=True)
  records = [
      {"step": -1, "eval/avg_score": 0.1},
      {"step": 0, "reward/mean": 0.25, "reward/accuracy": 0.25},
      {"step": 1, "reward/mean": 0.5, "reward/accuracy": 0.375, "eval/avg_score": 0.3},
  ]
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  script = tmp_path / "cells.py"
  script.write_text("\n\n".join(cells))
  env = {**os.environ, "PYTHONPATH": ROOT, "MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "MinPRO weights [1.105171, 0.904837, 0.860708, 0.818731]" in out
  assert "MinPRO loss 0.888010" in out
  assert "MinPRO dL/dlogp [-0.276293, -0.226209, -0.215177, -0.204683]" in out
  # The ablation rows of V1 (algorithms note table): statistic -> (prefix factor, weights, loss).
  assert (
      "none     prefix factor [1.000000, 1.000000, 1.000000, 1.000000]  "
      "weights [1.105171, 0.818731, 1.051271, 1.000000]  loss 0.979436" in out
  )
  assert (
      "prod     prefix factor [1.000000, 1.105171, 0.904837, 0.951229]  "
      "weights [1.105171, 0.904837, 0.951229, 0.951229]  loss 0.942077" in out
  )
  assert "3 steps; last step 1: reward 0.5, accuracy 0.375" in out
  assert (workdir / "colab_reward.png").stat().st_size > 1000
  assert "devices:" in out


def test_plot_cell_without_metrics(tmp_path):
  plot = [c for c in _python_cells(_load()) if "metrics.jsonl" in c]
  assert len(plot) == 1
  env = {**os.environ, "MPLBACKEND": "Agg"}
  proc = subprocess.run(
      [sys.executable, "-c", plot[0]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "no records in runs/colab/metrics.jsonl yet" in proc.stdout
