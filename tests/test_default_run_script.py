"""benchmarks/default_run.py: the README's result table read back, a run's figures from its metrics.jsonl, and the
comparison flagged (no run is made here)."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("default_run", ROOT / "benchmarks" / "default_run.py")
default_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(default_run)


def test_the_readme_table_reads_back():
  rows = default_run.readme_rows((ROOT / "README.md").read_text())
  amd = default_run.matching_row(rows, "AMD EPYC 7B13")
  intel = default_run.matching_row(rows, "Intel(R) Xeon(R) Platinum 8481C")
  assert "9fe40a0" in amd and "2026-12-07" in amd and "2026-11-30" in intel
  assert rows[amd] == {"after SFT": 14.4, "final": 26.7, "best": 27.3}
  assert rows[intel] == {"after SFT": 11.3, "final": 26.4, "best": 26.4}  # "= final"
  assert default_run.matching_row(rows, "Apple M2") is None


def test_a_runs_figures_and_the_flag(tmp_path, capsys):
  recs = [{"step": -1, "eval/avg_score": 0.144}, {"step": 9, "reward/mean": 0.2, "eval/avg_score": 0.25}]
  recs += [{"step": 19, "eval/avg_score": 0.273}, {"step": 39, "reward/mean": 0.3}, {"step": 40, "eval/avg_score": 0.2}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  ours = default_run.run_figures(default_run._records(str(tmp_path)))
  assert {k: round(v, 6) for k, v in ours.items()} == {"after SFT": 14.4, "final": 20.0, "best": 27.3}
  rows = {"AMD EPYC, 2026-12-07": {"after SFT": 14.4, "final": 26.8, "best": 27.3}}
  text, differs = default_run.table(ours, rows, "AMD EPYC, 2026-12-07", 1.5)
  assert differs and "| final | 20.0 % | 26.8 % | DIFFERS by -6.8 points |" in text
  assert "| after SFT | 14.4 % | 14.4 % | ok (+0.0) |" in text
  assert not default_run.table(ours | {"final": 26.0}, rows, "AMD EPYC, 2026-12-07", 1.5)[1]
