"""The committed studies (results/): each one's finished runs stay done under today's defaults, a moved study keeps
its runs, and each one's `summary.json` and `summary.md` regenerate byte for byte from its committed per-run files
(`study.json`, each run's `summary.json` and `metrics.jsonl`), as docs/study.md promises."""

import filecmp
import json
import os
import re
import shutil
import subprocess

import pytest

from minpro_jax.study import __main__ as study_cli
from minpro_jax.study import results, runner

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDIES_ROOT = results.committed_root(REPO_ROOT)  # results/ (runs/ in a checkout from before the move)
COMMITTED_STUDIES = sorted(
    d for d in os.listdir(STUDIES_ROOT) if os.path.isfile(os.path.join(STUDIES_ROOT, d, "study.json"))
)


def test_a_study_of_record_is_found_under_either_root(tmp_path, monkeypatch, capsys):
  """Committed studies live in results/ (issue 39); a path under the old root runs/ finds a moved study, and one
  under results/ finds a study this checkout still keeps in runs/, each with a note; other paths are kept."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs" / "kept").mkdir(parents=True)
  (tmp_path / "results" / "moved").mkdir(parents=True)
  assert results.committed("moved") == os.path.join("results", "moved")
  assert results.resolve("runs/moved") == os.path.join("results", "moved")
  assert "note: --workdir=runs/moved: the committed studies moved to results/; using results/moved" in (
      capsys.readouterr().err
  )
  assert results.resolve("./runs/moved/", "--out") == os.path.join("results", "moved")
  assert results.resolve("results/kept", "--out") == os.path.join("runs", "kept")
  assert "(git mv runs/kept results/kept); using runs/kept" in capsys.readouterr().err
  for same in ("runs/kept", "results/moved", "runs/new", "results/new", str(tmp_path / "runs" / "moved"), "other/x"):
    assert results.resolve(same) == same
  assert capsys.readouterr().err == ""
  assert results.committed_root(str(tmp_path)) == str(tmp_path / "results")
  (tmp_path / "before" / "runs").mkdir(parents=True)  # a checkout from before the move
  assert results.committed_root(str(tmp_path / "before")) == str(tmp_path / "before" / "runs")


def test_a_moved_study_keeps_its_finished_runs(tmp_path, monkeypatch, capsys):
  """A committed study moved from runs/ to results/ (its runs' summary.json name the old workdirs) reads as before:
  every finished run is done, under its new path and under its old one (found in results/)."""
  import shutil

  from minpro_jax.study.__main__ import main

  src = os.path.join(STUDIES_ROOT, "mipu")
  dst = tmp_path / "results" / "mipu"
  shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.endswith((".png", ".log", ".md"))])
  with open(dst / "study.json") as f:
    spec = json.load(f)["grid"]
  monkeypatch.chdir(tmp_path)
  for workdir in ("results/mipu", "runs/mipu"):
    assert main([f"--grid={os.path.join(REPO_ROOT, spec)}", f"--workdir={workdir}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b24 done\b", out) and re.search(r"\b0 new\b", out), out[-500:]
    assert f"--config.workdir={tmp_path}/results/mipu/" in out


def _committed_files(study_dir: str) -> list[str]:
  """The study's files as committed: `git ls-files` in a git checkout (a run finishing in the background is not
  committed yet), else every file there."""
  try:
    out = subprocess.run(["git", "ls-files", "-z", "."], cwd=study_dir, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]
  except (OSError, subprocess.CalledProcessError):
    return [os.path.relpath(os.path.join(d, f), study_dir) for d, _, fs in os.walk(study_dir) for f in fs]


@pytest.mark.parametrize("study", COMMITTED_STUDIES)
def test_committed_summaries_regenerate_from_the_committed_runs(study, tmp_path):
  """`--aggregate-only` on a copy of the study's inputs alone writes its committed summary.json and summary.md
  again, byte for byte (the plots are PNGs and left out)."""
  src = os.path.join(STUDIES_ROOT, study)
  inputs = [
      f for f in _committed_files(src) if f == runner.STUDY_FILE or f.endswith(("/summary.json", "/metrics.jsonl"))
  ]
  assert runner.STUDY_FILE in inputs
  for f in inputs:
    os.makedirs(os.path.dirname(tmp_path / f), exist_ok=True)
    shutil.copyfile(os.path.join(src, f), tmp_path / f)
  record, skipped = runner.read_study_runs(str(tmp_path))
  assert skipped == []
  study_cli.write_aggregation(str(tmp_path), record, plots=False)
  for name in ("summary.json", "summary.md"):
    assert filecmp.cmp(os.path.join(src, name), tmp_path / name, shallow=False), (
        f"results/{study}/{name} does not regenerate from the committed runs: run "
        f"python -m minpro_jax.study --workdir=results/{study} --aggregate-only and commit what it writes"
    )
