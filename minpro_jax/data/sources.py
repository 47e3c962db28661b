"""Problem sources: local files in the published schemas, reasoning-gym generators, champ-dataset.

File formats (``fmt``), with the fields read (as distributed on the Hugging Face hub / in the papers' repos):

============== ========================================================== =============================================
fmt            prompt field                                               answer field
============== ========================================================== =============================================
dapo           ``prompt`` (chat list; the user turn's content, with the   ``reward_model.ground_truth``
               DAPO "Solve the following..." instruction stripped)
math500        ``problem``                                                ``answer`` (id: ``unique_id``)
aime           ``problem`` | ``Problem`` | ``question``                   ``answer`` | ``Answer`` (int/str)
amc            ``problem`` | ``question``                                 ``answer`` (AI-MO stores floats: 142.0 -> 142)
minerva        ``problem`` | ``question``                                 ``answer``, else last ``\\boxed`` of ``solution``
olympiadbench  ``question``                                               ``final_answer`` (list; ``$..$`` stripped, joined ", ")
gsm8k          ``question``                                               text after ``####`` in ``answer``
auto           inferred from the keys of each row
============== ========================================================== =============================================

Files: ``.jsonl`` (one object per line), ``.json`` (a list of objects), ``.parquet`` (read with ``pyarrow``, a
dependency of this project; nested columns such as DAPO's ``prompt`` list and ``reward_model`` struct come back as
lists/dicts).
Malformed rows are skipped and reported per ``LoadReport`` (``strict=True`` raises ``DataError``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from minpro_jax.data.records import DataError, LoadReport, MathProblem
from minpro_jax.data.rewards import last_box
from minpro_jax.errors import ConfigError

FORMATS = ("auto", "dapo", "math500", "aime", "amc", "minerva", "olympiadbench", "gsm8k")

_DAPO_PREFIX = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$")
_PROMPT_KEYS = ("problem", "question", "Problem", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "expected_answer", "ground_truth")
_ID_KEYS = ("unique_id", "id", "ID", "idx", "problem_id")


class _RowError(Exception):
  pass


def _as_answer(v: Any, key: str) -> str:
  if isinstance(v, bool) or v is None:
    raise _RowError(f"field {key!r} has type {type(v).__name__}, expected str or number")
  if isinstance(v, float):
    if v != v or v in (float("inf"), float("-inf")):
      raise _RowError(f"field {key!r} is {v}")
    return str(int(v)) if v.is_integer() else repr(v)
  if isinstance(v, int):
    return str(v)
  if isinstance(v, list):
    if not v or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v):
      raise _RowError(f"field {key!r} must be a non-empty list of str/number")
    return ", ".join(_as_answer(x, key) for x in v)
  if not isinstance(v, str):
    raise _RowError(f"field {key!r} has type {type(v).__name__}, expected str or number")
  v = v.strip()
  if len(v) >= 2 and v[0] == "$" and v[-1] == "$" and "$" not in v[1:-1].strip("$"):
    v = v.strip("$").strip()  # "$15$" -> "15" (OlympiadBench stores final answers in math mode)
  return v


def _as_prompt(v: Any, key: str) -> str:
  if isinstance(v, list):  # chat format: take the last user turn
    users = [m for m in v if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
      raise _RowError(f"field {key!r} is a list without a user message with str content")
    v = users[-1]["content"]
  if not isinstance(v, str):
    raise _RowError(f"field {key!r} has type {type(v).__name__}, expected str or chat list")
  return v.strip()


def _first(row: dict, keys: Sequence[str]) -> tuple[str | None, Any]:
  for k in keys:
    if k in row:
      return k, row[k]
  return None, None


def _last_boxed(text: str) -> str | None:
  return last_box(text)[1]


def row_to_problem(row: Any, fmt: str, *, default_id: str, source: str) -> MathProblem:
  """Map one decoded row of ``fmt`` to a MathProblem. Raises ``_RowError`` with a reason on malformed rows."""
  if not isinstance(row, dict):
    raise _RowError(f"row is {type(row).__name__}, expected a JSON object")
  meta: dict[str, Any] = {}
  if fmt == "auto":
    fmt = (
        "dapo"
        if "reward_model" in row
        else "olympiadbench"
        if "final_answer" in row
        else "gsm8k"
        if isinstance(row.get("answer"), str) and "####" in row["answer"]
        else "generic"
    )
  if fmt == "dapo":
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
      raise _RowError("missing reward_model.ground_truth")
    answer = _as_answer(rm["ground_truth"], "reward_model.ground_truth")
    if "prompt" not in row:
      raise _RowError("missing field 'prompt'")
    raw = _as_prompt(row["prompt"], "prompt")
    prompt = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", raw)).strip()
    if prompt != raw:
      meta["raw_prompt"] = raw
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    pid = extra.get("index")
  elif fmt == "gsm8k":
    if not isinstance(row.get("question"), str):
      raise _RowError("missing or non-str field 'question'")
    prompt = row["question"].strip()
    a = row.get("answer")
    if not isinstance(a, str) or "####" not in a:
      raise _RowError("field 'answer' must be a str containing '#### <answer>'")
    answer = a.rsplit("####", 1)[1].strip().replace(",", "")
    meta["solution"] = a.rsplit("####", 1)[0].strip()
    pid = None
  else:
    pk, pv = _first(row, _PROMPT_KEYS)
    if pk is None:
      raise _RowError(f"missing prompt field (one of {list(_PROMPT_KEYS)})")
    prompt = _as_prompt(pv, pk)
    ak, av = _first(row, _ANSWER_KEYS)
    if ak is None or av is None or av == "":
      sol = row.get("solution")
      if isinstance(sol, list):
        sol = sol[-1] if sol and isinstance(sol[-1], str) else None
      boxed = _last_boxed(sol) if isinstance(sol, str) else None
      if not boxed:
        raise _RowError(f"missing answer field (one of {list(_ANSWER_KEYS)}) and no \\boxed answer in 'solution'")
      answer, meta["answer_from"] = boxed, "solution"
    else:
      answer = _as_answer(av, ak)
    for k in ("level", "subject", "type", "unit", "answer_type", "url"):
      if isinstance(row.get(k), (str, int, float)) and not isinstance(row.get(k), bool):
        meta[k] = row[k]
    _, pid = _first(row, _ID_KEYS)
  if not prompt:
    raise _RowError("empty prompt")
  if not answer:
    raise _RowError("empty answer")
  pid = str(pid) if isinstance(pid, (str, int)) and not isinstance(pid, bool) and str(pid) else default_id
  return MathProblem(id=pid, prompt=prompt, answer=answer, source=source, metadata=meta)


def _iter_rows(path: str) -> Iterator[tuple[int, Any, str | None]]:
  """Yield (line_number, decoded_row_or_None, error_reason_or_None)."""
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError as e:
      raise ImportError(
          f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the file to "
          "JSONL first (e.g. pandas.read_parquet(p).to_json(out, orient='records', lines=True))"
      ) from e
    try:
      rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid / OSError: the file is not what it says
      why = " ".join(str(e).split())  # pyarrow's messages span lines
      check = _PARQUET_CHECK.replace("FILE", path)
      raise DataError(f"{path}: cannot read it as parquet ({type(e).__name__}: {why}); {check}") from e
    for i, row in enumerate(rows):
      yield i + 1, row, None
    return
  if path.endswith(".json"):
    with open(path, "rb") as f:
      try:
        data = json.loads(f.read().decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a valid UTF-8 JSON file: {e}") from e
    if not isinstance(data, list):
      raise DataError(f"{path}: a .json file must hold a list of objects (use .jsonl for one object per line)")
    for i, row in enumerate(data):
      yield i + 1, row, None
    return
  with open(path, "rb") as f:
    for i, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        yield i, None, f"invalid UTF-8 ({e.reason} at byte {e.start})"
        continue
      if not line.strip():
        continue
      try:
        yield i, json.loads(line), None
      except json.JSONDecodeError as e:
        yield i, None, f"invalid JSON ({e.msg})"


def load_file(
    path: str,
    fmt: str = "auto",
    *,
    source: str | None = None,
    strict: bool = False,
    report: LoadReport | None = None,
    limit: int | None = None,
) -> list[MathProblem]:
  """Load problems from a local ``.jsonl`` / ``.json`` / ``.parquet`` file.

  Args:
    path: file path.
    fmt: one of ``FORMATS`` (see module docstring).
    source: ``MathProblem.source`` (default: ``fmt`` if given, else the file stem).
    strict: raise ``DataError`` on the first malformed row instead of skipping it.
    report: a ``LoadReport`` to fill (skips are also logged at WARNING).
    limit: stop after this many loaded problems.

  Returns:
    Problems in file order.

  Raises:
    ValueError: unknown ``fmt``. FileNotFoundError. ImportError: parquet without pyarrow. DataError: strict mode,
      or a ``.parquet`` file pyarrow cannot read (naming the file).
  """
  if fmt not in FORMATS:
    raise ValueError(f"fmt={fmt!r}; expected one of {FORMATS}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no data file at {path!r}")
  report = LoadReport() if report is None else report
  stem = os.path.basename(path).split(".")[0]
  source = source or (fmt if fmt != "auto" else stem)
  out: list[MathProblem] = []
  seen: set[str] = set()
  for line, row, err in _iter_rows(path):
    if err is None:
      try:
        p = row_to_problem(row, fmt, default_id=f"{stem}:{line}", source=source)
        if p.id in seen:
          raise _RowError(f"duplicate id {p.id!r}")
      except _RowError as e:
        err = str(e)
    if err is not None:
      report.skip(path, line, err, strict)
      continue
    seen.add(p.id)
    out.append(p)
    report.loaded += 1
    if limit is not None and len(out) >= limit:
      break
  return out


# ----------------------------------------------------------------------------------------------- generators
def reasoning_gym_problems(task: str, size: int, seed: int, **config: Any) -> list[MathProblem]:
  """Problems from a reasoning-gym generator (deterministic for ``(task, size, seed, config)``).

  Args:
    task: reasoning-gym dataset name, e.g. ``basic_arithmetic``, ``chain_sum``, ``simple_equations``,
      ``gsm_symbolic`` (integer answers).
    size, seed: number of problems and generator seed.
    **config: the task's config fields, which set its difficulty (e.g. ``min_digits``, ``max_terms`` for
      ``chain_sum``; see ``reasoning_gym.create_dataset``).

  Note: ``gsm_symbolic`` templates derive from the GSM8K *test* split; do not report GSM8K-test scores for a model
  trained on them.
  """
  import reasoning_gym

  ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
  out = []
  for i in range(size):
    e = ds[i]
    meta = {"task": task, "seed": seed, "index": i}
    for k, v in (e.get("metadata") or {}).items():
      if isinstance(v, (str, int, float, bool)) or v is None:
        meta[k] = v
    out.append(
        MathProblem(
            id=f"{task}/{seed}/{i}",
            prompt=e["question"],
            answer=str(e["answer"]),
            source=f"reasoning_gym/{task}",
            metadata=meta,
        )
    )
  return out


def champ_problems(version: str = "v0") -> list[MathProblem]:
  """The 270 CHAMP competition problems (champ-dataset, MIT), sorted by id. Answers are often expressions."""
  import champ_dataset

  probs = champ_dataset.load(version).problems
  return [
      MathProblem(
          id=k, prompt=p.text, answer=str(p.answer), source="champ", metadata={"category": getattr(p, "category", None)}
      )
      for k, p in sorted(probs.items())
  ]


# ----------------------------------------------------------------------------------------------- the registry
@dataclasses.dataclass(frozen=True)
class Source:
  """One data source a run can train on (`config.data.source`).

  Attributes:
    name: the value of `config.data.source`.
    load: `load(data_config, *, seed, size) -> list[MathProblem]`, the problems of `config.data`. A generator
      draws `size` problems from generator seed `seed`; a fixed set ignores both and returns all of its problems.
      Raises `ConfigError` naming the `config.data` field at fault.
    generator: True when `load` draws a fresh set from any seed (reasoning-gym): the run's held-out problems are
      then a draw with `eval.seed`. False for a fixed set (a file, CHAMP): a held-out share is split off it.
    heldout_name: `heldout_name(data_config) -> str`, the stem of the held-out benchmark's name
      ("<stem>_heldout").
    validate: `validate(data_config)` checks the source's own fields before any expensive work (raises
      `ConfigError`), or None.
  """

  name: str
  load: Callable[..., list[MathProblem]]
  generator: bool
  heldout_name: Callable[[Any], str]
  validate: Callable[[Any], None] | None = None


SOURCES: dict[str, Source] = {}


def register_source(
    name: str,
    *,
    generator: bool,
    heldout_name: Callable[[Any], str] | None = None,
    validate: Callable[[Any], None] | None = None,
):
  """Decorator adding a `load(data_config, *, seed, size)` function to `SOURCES` under `name` (see `Source`).

  Raises:
    ValueError: `name` is already registered.
  """

  def add(load):
    if name in SOURCES:
      raise ValueError(f"data source {name!r} is already registered")
    SOURCES[name] = Source(name, load, generator, heldout_name or (lambda d: name), validate)
    return load

  return add


def get_source(name: str) -> Source:
  """The registered source `name`. Raises `ConfigError` naming `config.data.source` and the choices."""
  if name not in SOURCES:
    raise ConfigError(f"config.data.source: {name!r} is not a data source; choose one of {sorted(SOURCES)}")
  return SOURCES[name]


@register_source("reasoning_gym", generator=True, heldout_name=lambda d: d.task)
def _reasoning_gym(d, *, seed: int, size: int) -> list[MathProblem]:
  try:
    return reasoning_gym_problems(d.task, size, seed, **dict(d.task_config))
  except (ValueError, TypeError, AssertionError) as e:  # an unknown task / key; a value its config asserts against
    raise ConfigError(
        f"config.data.task / config.data.task_config: reasoning-gym refused task {d.task!r} with "
        f"task_config={dict(d.task_config)} ({e}); configs/default.py sets chain_sum's fields, so "
        "for another task set data.task_config to that task's fields in your config file"
    ) from e


PARQUET_MAGIC = b"PAR1"  # a parquet file starts and ends with it (the footer holds the schema)
_PARQUET_CHECK = "check it with: python -c \"import pyarrow.parquet as pq; print(pq.read_metadata('FILE'))\""


def check_data_file(path: str, field: str) -> None:
  """Checks that the existing file `path` is what its name says, reading only its first and last bytes: a
  `.parquet` file starts and ends with `PAR1` (a truncated copy lacks the footer), and a file of another name is no
  parquet file (it would be read as JSON lines).

  Raises:
    ConfigError: naming `config.<field>`, the file, what was expected and how to check it.
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(len(PARQUET_MAGIC))
    f.seek(max(0, size - len(PARQUET_MAGIC)))
    tail = f.read()
  check = _PARQUET_CHECK.replace("FILE", path)
  if path.endswith(".parquet"):
    if head != PARQUET_MAGIC:
      raise ConfigError(
          f"config.{field}: {path} is not a parquet file (it starts with {head!r}, a parquet file with "
          f"{PARQUET_MAGIC!r}); give a parquet file, or name a JSON-lines file .jsonl ({check})"
      )
    if size < 3 * len(PARQUET_MAGIC) or tail != PARQUET_MAGIC:
      raise ConfigError(
          f"config.{field}: {path} is a truncated parquet file ({size} bytes, no {PARQUET_MAGIC!r} footer at its "
          f"end): an interrupted download or copy; fetch it again ({check})"
      )
  elif head == PARQUET_MAGIC:
    raise ConfigError(
        f"config.{field}: {path} is a parquet file but not named .parquet (it would be read as JSON lines); "
        "rename it to end in .parquet"
    )


def _check_file(d) -> None:
  if not d.path:
    raise ConfigError("config.data.path: empty; with data.source=file point it at one .jsonl / .json / .parquet file")
  if os.path.isdir(d.path):
    raise ConfigError(f"config.data.path: {d.path!r} is a directory; point it at one .jsonl / .json / .parquet file")
  if not os.path.isfile(d.path):
    raise ConfigError(f"config.data.path: data file {d.path!r} does not exist")
  check_data_file(d.path, "data.path")


@register_source(
    "file", generator=False, heldout_name=lambda d: os.path.splitext(os.path.basename(d.path))[0], validate=_check_file
)
def _file(d, *, seed: int, size: int) -> list[MathProblem]:
  del seed, size
  problems = load_file(d.path, d.format)
  if not problems:
    raise ConfigError(
        f"config.data.path: {d.path!r} holds no usable problem (skipped rows are logged above); each row "
        f"needs a question and an answer in data.format={d.format!r}"
    )
  return problems


def _check_tfds(d) -> None:
  # optional dependency (tensorflow-datasets), imported only for a tfds source
  from minpro_jax.data.tfds_source import dataset_dir_exists

  if not d.tfds_name or not d.tfds_split or not d.tfds_data_dir:
    raise ConfigError(
        "config.data.tfds_name / tfds_split / tfds_data_dir: data.source=tfds needs all three (a dataset built "
        "with python -m minpro_jax.data.build_tfds)"
    )
  if not dataset_dir_exists(d.tfds_name, d.tfds_data_dir):
    raise ConfigError(
        f"config.data.tfds_data_dir: no dataset {d.tfds_name!r} in {d.tfds_data_dir!r} (expected the folder "
        f"{d.tfds_data_dir}/{d.tfds_name}/ written by python -m minpro_jax.data.build_tfds)"
    )


@register_source("tfds", generator=False, heldout_name=lambda d: d.tfds_name, validate=_check_tfds)
def _tfds(d, *, seed: int, size: int) -> list[MathProblem]:
  """A TFDS dataset prepared by `minpro_jax.data.build_tfds`, read with `tfds.data_source` (tfds_source.py)."""
  # optional dependency (tensorflow-datasets), imported only for a tfds source
  from minpro_jax.data.tfds_source import load_tfds

  del seed, size
  try:
    problems = load_tfds(d.tfds_name, d.tfds_split, d.tfds_data_dir)
  except DataError as e:
    raise ConfigError(f"config.data.tfds_name / tfds_split / tfds_data_dir: {e}") from e
  if not problems:
    raise ConfigError(f"config.data.tfds_split: split {d.tfds_split!r} of {d.tfds_name!r} holds no problem")
  return problems


@register_source("champ", generator=False)
def _champ(d, *, seed: int, size: int) -> list[MathProblem]:
  del d, seed, size
  return champ_problems()
