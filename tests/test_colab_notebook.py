"""colab/*.ipynb: in sync with colab/build_notebooks.py, outputs stripped, and every cell of both notebooks runs top
to bottom (shell cells included) on this checkout, as a Colab user runs them."""

import json
import os
import shutil
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "colab"))
import build_notebooks  # noqa: E402

CELL_TIMEOUT_S = 600


@pytest.mark.parametrize("name", sorted(build_notebooks.NOTEBOOKS))
def test_committed_notebook_equals_its_builder_and_has_no_outputs(name):
  with open(os.path.join(ROOT, "colab", name)) as f:
    text = f.read()
  assert text == build_notebooks.render(build_notebooks.NOTEBOOKS[name]), "stale: run colab/build_notebooks.py"
  nb = json.loads(text)
  assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
  assert "YOUR_ORG" not in text and "60-step" not in text


@pytest.mark.parametrize("name", sorted(build_notebooks.NOTEBOOKS))
def test_notebook_runs_top_to_bottom(name, monkeypatch):
  monkeypatch.setenv("MINPRO_REPO_DIR", ROOT)  # the checkout stands in for the clone of the setup cell
  shutil.rmtree(os.path.join(ROOT, "runs", "colab_quickstart"), ignore_errors=True)
  nb = nbformat.read(os.path.join(ROOT, "colab", name), as_version=4)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": ROOT}})
  client.execute()  # raises CellExecutionError naming the cell and its traceback
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "Traceback" not in outputs
  if name == "minpro_jax_quickstart.ipynb":
    assert "policy_version" in outputs and "reward" in outputs  # the run's summary and the graded responses
    assert "metrics.jsonl" in outputs  # the shell cell listed the workdir
  else:
    assert "update 2:" in outputs and "generate 1:" in outputs
