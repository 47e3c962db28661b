"""Bad input to the newer features ends in one `error: ...` line naming the file or field and the fix, exit status
2, no traceback (`--debug` shows it), before expensive work: data files (a `.parquet` that is not one, a truncated
one, a parquet file under another name), the study runner (a grid whose `derived` raises, an unknown grid argument,
`seeds` as an int, a truncated or hand-edited study.json, which `--aggregate-only` still reports around), and the
compile-only tool (`--out` a directory or a corrupt report; a micro-batch that does not split over the mesh's batch
axes is a warning on the row)."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from train_helpers import REPO, cli_args, cli_env, make_config, tiny_overrides

from minpro_jax.data.records import DataError
from minpro_jax.data.sources import check_data_file, load_file
from minpro_jax.errors import ConfigError
from minpro_jax.run.run_config import validate_config
from minpro_jax.study import __main__ as study_cli
from minpro_jax.study import grid, runner

SMOKE = os.path.join(REPO, "configs", "studies", "smoke.py")
ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(30)]


def _one_error(text: str) -> str:
  lines = [ln for ln in text.splitlines() if ln.startswith("error: ")]
  assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
  return lines[0]


# ------------------------------------------------------------------------------------------------ data files
@pytest.fixture
def files(tmp_path):
  good = tmp_path / "good.parquet"
  pq.write_table(pa.Table.from_pylist(ROWS), good)
  raw = good.read_bytes()
  truncated = tmp_path / "truncated.parquet"
  truncated.write_bytes(raw[: len(raw) // 2])
  jsonl = tmp_path / "rows.parquet"  # JSON lines under a parquet name
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  unnamed = tmp_path / "rows.jsonl"  # a parquet file under a JSON-lines name
  unnamed.write_bytes(raw)
  damaged = tmp_path / "damaged.parquet"  # magic bytes at both ends, garbage between: only pyarrow can tell
  damaged.write_bytes(raw[:4] + b"\0" * (len(raw) - 8) + raw[-4:])
  return {"good": good, "truncated": truncated, "jsonl": jsonl, "unnamed": unnamed, "damaged": damaged}


@pytest.mark.parametrize(
    "name, words",
    [
        ("truncated", "is a truncated parquet file"),
        ("jsonl", "is not a parquet file (it starts with b'{\"pr'"),
        ("unnamed", "is a parquet file but not named .parquet"),
    ],
)
@pytest.mark.parametrize("field", ["data.path", "eval.path"])
def test_a_data_file_that_is_not_what_its_name_says_is_refused_up_front(tmp_path, files, name, words, field):
  path = str(files[name])
  if field == "data.path":
    ov = {"data.source": "file", "data.path": path, "reward.mode": "integer"}
  else:
    ov = {"eval.path": f"held=auto:{path}"}
  with pytest.raises(ConfigError) as e:
    validate_config(make_config(tiny_overrides(tmp_path, **ov)), num_devices=1)
  msg = str(e.value)
  assert msg.startswith(f"config.{field}: {path} ") and words in msg, msg
  if name != "unnamed":
    assert f"pq.read_metadata('{path}')" in msg  # how to check it


def test_a_good_parquet_file_passes_and_loads(files):
  check_data_file(str(files["good"]), "data.path")
  assert [p.answer for p in load_file(str(files["good"]))] == [r["answer"] for r in ROWS]


def test_a_parquet_file_pyarrow_cannot_read_names_the_file(files):
  path = str(files["damaged"])
  check_data_file(path, "data.path")  # its ends look right
  with pytest.raises(DataError, match=rf"^{path}: cannot read it as parquet \(.*pq.read_metadata"):
    load_file(path)


def test_the_train_command_refuses_a_truncated_parquet_in_one_line(tmp_path, files):
  ov = tiny_overrides(tmp_path, **{"data.source": "file", "data.path": str(files["truncated"])})
  r = subprocess.run(cli_args(ov), capture_output=True, text=True, env=cli_env(), timeout=180)
  assert r.returncode == 2
  assert _one_error(r.stderr).startswith(f"error: config.data.path: {files['truncated']} is a truncated parquet")
  assert not (tmp_path / "cache").exists()  # before the tokenizer


# ------------------------------------------------------------------------------------------------ study runner
def _grid_file(tmp_path, body: str) -> str:
  p = tmp_path / "g.py"
  p.write_text(
      "from minpro_jax.study.grid import Grid\n"
      f"import importlib.util\nspec = importlib.util.spec_from_file_location('smoke', {SMOKE!r})\n"
      "smoke = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(smoke)\n" + body
  )
  return str(p)


def _study(argv, capsys):
  code = study_cli.main(argv)
  return code, capsys.readouterr()


@pytest.mark.parametrize(
    "body, arg, words",
    [
        (
            "def get_grid(arg=None):\n  return Grid(base='configs/default.py', fixed=smoke.TINY,\n"
            "      axes={'delay': [0, 1]}, derived=lambda cell: {'total_steps': 3 + cell['loss.method']})\n",
            "",
            "grid.derived: raised KeyError: 'loss.method' for the cell {'delay': 0} at seed 0; it gets only the cell's",
        ),
        (
            "def get_grid(arg=None):\n  '''arg: small | large.'''\n  return {'small': 1, 'large': 2}[arg]\n",
            ":huge",
            "get_grid('huge') failed (KeyError: 'huge'); pass an argument the grid file takes after the ':' (arg: small",
        ),
        (
            "def get_grid(arg=None):\n  return Grid(base='configs/default.py', fixed=smoke.TINY,\n"
            "      axes={'delay': [0, 1]}, seeds=3)\n",
            "",
            "grid.seeds: must be a tuple of ints, got the int 3; write e.g. seeds=(0,) for one seed",
        ),
    ],
)
def test_grid_mistakes_name_the_grid_file_and_the_field(tmp_path, capsys, body, arg, words):
  spec = _grid_file(tmp_path, body) + arg
  code, out = _study([f"--grid={spec}", f"--workdir={tmp_path / 'study'}", "--dry-run"], capsys)
  assert code == 2
  line = _one_error(out.err)
  assert line.startswith(f"error: --grid={spec}: ") and words in line, line
  with pytest.raises(grid.GridError):  # --debug: the exception itself
    study_cli.main([f"--grid={spec}", f"--workdir={tmp_path / 'study'}", "--dry-run", "--debug"])


def _stored_smoke_study(study_dir: str) -> list:
  g = grid.load_grid(SMOKE)
  runs = grid.expand(g)
  runner.write_study(study_dir, runner.study_record(SMOKE, g, runs))
  return runs


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda text: text[: len(text) // 2], "study.json: not a readable study file (JSONDecodeError"),
        (lambda text: "[1, 2]", 'study.json: holds no list "runs" (got list)'),
        (lambda text: text.replace('"seed": 0', '"sede": 0', 1), "study.json: runs[0].seed: missing"),
    ],
)
def test_a_damaged_study_json_is_named_with_the_fix(tmp_path, capsys, damage, words):
  study = tmp_path / "study"
  _stored_smoke_study(str(study))
  path = study / runner.STUDY_FILE
  path.write_text(damage(path.read_text()))
  code, out = _study([f"--grid={SMOKE}", f"--workdir={study}", "--dry-run"], capsys)
  assert code == 2
  line = _one_error(out.err)
  assert words in line and "restore it (e.g. from git), or run the study command with its --grid and --force" in line
  code, out = _study([f"--grid={SMOKE}", f"--workdir={study}", "--dry-run", "--force"], capsys)
  assert code == 0, out.err  # --force replaces it


def test_aggregate_only_reports_around_a_damaged_study_json(tmp_path, capsys):
  study = tmp_path / "study"
  runs = _stored_smoke_study(str(study))
  path = study / runner.STUDY_FILE
  record = json.loads(path.read_text())
  del record["runs"][1]["seed"]  # a hand edit that lost one run's seed
  path.write_text(json.dumps(record))
  code, out = _study([f"--workdir={study}", "--aggregate-only"], capsys)
  assert code == 0, out.err
  assert f"warning: {path}: runs[1].seed: missing; that run is left out of the aggregation" in out.err
  summary = json.loads((study / "summary.json").read_text())
  assert sorted(summary["unfinished"]) == sorted(r.name for i, r in enumerate(runs) if i != 1)
  path.write_text(path.read_text()[:50])  # truncated: the grid still gives the run list
  code, out = _study([f"--grid={SMOKE}", f"--workdir={study}", "--aggregate-only"], capsys)
  assert code == 0, out.err
  assert "not a readable study file" in out.err and f"aggregating the runs of --grid={SMOKE}" in out.err
  code, out = _study([f"--workdir={study}", "--aggregate-only"], capsys)  # no grid, nothing to go on
  assert code == 2 and "not a readable study file" in _one_error(out.err)


# ------------------------------------------------------------------------------------------------ compile-only tool
def _aot(args, tmp_path):
  config = os.path.join(REPO, "configs", "default.py")
  cmd = [sys.executable, "-m", "minpro_jax.aot", "--topology=cpu:2", f"--config={config}", *args]
  return subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=300)


def test_aot_out_mistakes_give_one_line_before_compiling(tmp_path):
  (tmp_path / "reports").mkdir()
  r = _aot(["--out=reports"], tmp_path)
  assert r.returncode == 2
  assert (
      _one_error(r.stderr) == "error: --out=reports: is a directory; pass a file path, e.g. --out=reports/report.json"
  )
  (tmp_path / "corrupt.json").write_text('{"slice": "cpu:2", "rows": [')
  r = _aot(["--out=corrupt.json"], tmp_path)
  assert r.returncode == 2
  line = _one_error(r.stderr)
  assert line.startswith("error: --out=corrupt.json: not a readable report of this tool (JSONDecodeError")
  assert "pass --fresh to overwrite it, or another --out" in line
  r = _aot(["--out=corrupt.json", "--debug"], tmp_path)
  assert r.returncode != 0 and "Traceback" in r.stderr


def test_aot_warns_on_a_row_whose_micro_batch_does_not_split_over_the_batch_axes(tmp_path):
  from minpro_jax.aot.__main__ import batch_split_warning

  c = make_config(tiny_overrides(tmp_path, prompts_per_step=3, group_size=2, num_updates_per_step=1))
  c.micro_batch_size = 3  # mini-batch 6, micro-batch 3
  assert batch_split_warning(c, {"program": "update", "mesh": "data=1,fsdp=3"}) is None
  assert batch_split_warning(c, {"program": "decode", "mesh": "data=2,fsdp=2"}) is None  # no micro-batch
  w = batch_split_warning(c, {"program": "update", "mesh": "data=2,fsdp=2,tensor=2"})
  assert w == (
      "the learner's micro-batch of 3 samples (micro_batch_size) does not split over the mesh's batch axes "
      "(data x fsdp x expert = 4); a run on this mesh needs a micro-batch that is a multiple of 4"
  )
  assert "x expert = 2" in batch_split_warning(c, {"program": "score", "mesh": "tensor=4,expert=2"})


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--workdir=", "--dry-run"], "error: --workdir: empty; give the study's own directory"),
        (
            ["--workdir={run}", "--dry-run"],
            "is the workdir of a training run (config.json, checkpoints/), not a study's",
        ),
        (["--workdir={tmp}/study", "--jobs=0", "--dry-run"], "error: --jobs=0: must be >= 1"),
        (["--workdir={run}/config.json"], "config.json: is a file, not a directory"),  # was a FileExistsError
    ],
)
def test_study_workdir_and_jobs_mistakes_are_named_before_anything_runs(tmp_path, capsys, flags, words):
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  argv = [f"--grid={SMOKE}", *(f.format(run=run, tmp=tmp_path) for f in flags)]
  code, out = _study(argv, capsys)
  assert code == 2 and words in _one_error(out.err), out.err
  assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(run)) == ["checkpoints", "config.json"]
