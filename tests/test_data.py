"""Data: fixture files of every format, malformed rows, reasoning-gym/champ sources, grain loader (B23), prompts,
reproducible sentencepiece training."""

import hashlib
import json
import logging
import os

import pytest

from minpro_jax.data import (
    DataError,
    LoadReport,
    MathProblem,
    ProblemLoader,
    encode_prompts,
    format_prompt,
    load_file,
    reasoning_gym_problems,
    train_sentencepiece,
)
from minpro_jax.data.rewards import math_reward
from minpro_jax.data.tokenizers import load_sentencepiece

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def fx(name):
  return os.path.join(FIX, name)


# ------------------------------------------------------------------------------------------- file formats
@pytest.mark.parametrize(
    "name,fmt,expected",
    [
        (
            "dapo_math_17k.jsonl",
            "dapo",
            [
                ("a1f3-0001", "Find the remainder when $7^{100}$ is divided by $5$.", "1"),
                ("a1f3-0002", "How many positive divisors does $360$ have?", "24"),
                ("a1f3-0003", "If $x+y=10$ and $xy=21$, what is $x^2+y^2$?", "58"),
            ],
        ),
        (
            "math500.jsonl",
            "math500",
            [
                ("test/prealgebra/1.json", "Simplify $\\frac{6}{8}$.", "\\frac{3}{4}"),
                ("test/algebra/2.json", "What is $\\sqrt{50}$ in simplest radical form?", "5\\sqrt{2}"),
                ("test/algebra/3.json", "Solve $2x-3=7$.", "5"),
            ],
        ),
        (
            "aime.jsonl",
            "aime",
            [
                ("60", "Find the number of ordered pairs $(a,b)$ of positive integers with $a+b=20$.", "19"),
                ("61", "Find the last three digits of $2^{10}\\cdot 3$.", "072"),
            ],
        ),
        ("aime_2024.jsonl", "aime", [("2024-I-1", "What is $12\\cdot 13$?", "156")]),
        ("amc.jsonl", "amc", [("0", "What is $1+2+\\cdots+10$?", "55"), ("1", "What is half of $3$?", "1.5")]),
        (
            "minerva.jsonl",
            "minerva",
            [
                ("0", "A car travels $120$ km in $2$ h. What is its mean speed in km/h?", "60"),
                (
                    "1",
                    "Compute the wavelength in nm of a photon with energy equal to that of $500$ " "nm light.",
                    "500",
                ),
            ],
        ),
        (
            "olympiadbench.jsonl",
            "olympiadbench",
            [("2001", "Find all real $x$ with $x^2=4$.", "-2, 2"), ("2002", "Compute $\\binom{6}{2}$.", "15")],
        ),
        (
            "gsm8k.jsonl",
            "gsm8k",
            [
                ("gsm8k:1", "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples " "are left?", "10"),
                ("gsm8k:2", "A shop sells 1,250 pens a day. How many pens in 8 days?", "10000"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("explicit", [True, False])
def test_fixture_formats(name, fmt, expected, explicit):
  rep = LoadReport()
  probs = load_file(fx(name), fmt if explicit else "auto", report=rep)
  assert [(p.id, p.prompt, p.answer) for p in probs] == expected
  assert rep.loaded == len(expected) and rep.num_skipped == 0
  assert all(isinstance(p, MathProblem) for p in probs)
  if explicit:
    assert {p.source for p in probs} == {fmt}


def test_dapo_keeps_raw_prompt_and_answers_grade():
  p = load_file(fx("dapo_math_17k.jsonl"), "dapo")[0]
  assert p.metadata["raw_prompt"].startswith("Solve the following math problem step by step.")
  assert math_reward("so \\boxed{1}", p.answer, mode="integer") == 1.0
  m = load_file(fx("minerva.jsonl"))[0]
  assert m.metadata["answer_from"] == "solution"


def test_malformed_rows_reported_and_skipped(caplog):
  rep = LoadReport()
  with caplog.at_level(logging.WARNING):
    probs = load_file(fx("malformed.jsonl"), "math500", report=rep)
  assert [p.id for p in probs] == ["ok/1", "ok/10"]
  assert [p.answer for p in probs] == ["2", "4"]
  lines = [line for _, line, _ in rep.skipped]
  assert lines == [2, 3, 4, 5, 6, 7, 8, 11, 12]
  reasons = dict((line, reason) for _, line, reason in rep.skipped)
  assert "invalid JSON" in reasons[2] and "UTF-8" in reasons[3] and "missing answer" in reasons[4]
  assert reasons[5] == "empty prompt" and "dict" in reasons[6]
  assert "expected a JSON object" in reasons[7] and "int" in reasons[8] and "duplicate" in reasons[11]
  assert "bool" in reasons[12]
  assert all(f.endswith("malformed.jsonl") for f, _, _ in rep.skipped)
  assert "malformed.jsonl:3" in caplog.text


def test_strict_raises_with_file_and_line():
  with pytest.raises(DataError, match=r"malformed\.jsonl:2: invalid JSON"):
    load_file(fx("malformed.jsonl"), strict=True)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="fmt"):
    load_file(fx("gsm8k.jsonl"), "csv")
  with pytest.raises(FileNotFoundError):
    load_file(str(tmp_path / "nope.jsonl"))
  bad = tmp_path / "x.json"
  bad.write_text('{"problem": "a", "answer": "1"}')
  with pytest.raises(DataError, match="list of objects"):
    load_file(str(bad))
  good = tmp_path / "y.json"
  good.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": 2}]))
  assert [p.answer for p in load_file(str(good))] == ["1", "2"]
  with pytest.raises(ValueError, match="empty answer"):
    MathProblem(id="x", prompt="p", answer=" ", source="s")


def test_parquet_dapo(tmp_path):
  """DAPO-Math-17K's published parquet layout (BytedTsinghua-SIA/DAPO-Math-17k, data/dapo-math-17k.parquet): `prompt`
  a list<struct<content, role>>, `reward_model` a struct<ground_truth, style>, `extra_info` a struct<index>."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  schema = pa.schema(
      [
          ("data_source", pa.string()),
          ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
          ("ability", pa.string()),
          ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
          ("extra_info", pa.struct([("index", pa.string())])),
      ]
  )
  rows = [json.loads(line) for line in open(fx("dapo_math_17k.jsonl"))]
  path = str(tmp_path / "dapo-math-17k.parquet")
  pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
  assert pq.read_schema(path).field("prompt").type == schema.field("prompt").type
  probs = load_file(path, "dapo")
  assert [p.answer for p in probs] == ["1", "24", "58"]
  assert [p.id for p in probs] == ["a1f3-0001", "a1f3-0002", "a1f3-0003"]
  assert probs[0].prompt == "Find the remainder when $7^{100}$ is divided by $5$."
  assert probs[0].metadata["raw_prompt"].startswith("Solve the following math problem step by step.")
  # the same problems as the JSONL copy, and "auto" infers the layout from the parquet rows too
  assert probs == load_file(fx("dapo_math_17k.jsonl"), "dapo", source="dapo")
  assert [p.answer for p in load_file(path)] == ["1", "24", "58"]


# ------------------------------------------------------------------------------------------- generators
@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "simple_equations", "gsm_symbolic"])
def test_reasoning_gym_deterministic_and_verifiers_agree(task):
  import reasoning_gym

  a = reasoning_gym_problems(task, size=12, seed=7)
  b = reasoning_gym_problems(task, size=12, seed=7)
  c = reasoning_gym_problems(task, size=12, seed=8)
  assert [(p.prompt, p.answer) for p in a] == [(p.prompt, p.answer) for p in b]
  assert [p.prompt for p in a] != [p.prompt for p in c]
  assert len({p.id for p in a}) == 12 and a[0].source == f"reasoning_gym/{task}"
  ds = reasoning_gym.create_dataset(task, size=12, seed=7)
  for i, p in enumerate(a):
    is_int = p.answer.lstrip("-").isdigit()  # gsm_symbolic has a few non-integer answers (e.g. 1687.5)
    wrong = str(int(p.answer) + 1) if is_int else str(float(p.answer) + 1)
    for pred in (p.answer, wrong):
      theirs = ds.score_answer(pred, ds[i]) == 1.0
      ours = math_reward(f"The result is \\boxed{{{pred}}}.", p.answer, mode="integer" if is_int else "math") == 1.0
      assert theirs == ours == (pred == p.answer), (task, p.prompt, pred)


def test_reasoning_gym_difficulty_config():
  easy = reasoning_gym_problems("chain_sum", 20, 0, min_digits=1, max_digits=1, min_terms=2, max_terms=2)
  hard = reasoning_gym_problems("chain_sum", 20, 0, min_digits=4, max_digits=4, min_terms=5, max_terms=5)
  assert max(abs(int(p.answer)) for p in easy) <= 18
  assert all(p.prompt.count("+") + p.prompt.count("-") >= 4 for p in hard)


def test_champ():
  pytest.importorskip("champ_dataset")
  from minpro_jax.data import champ_problems

  probs = champ_problems()
  assert len(probs) == 270 and len({p.id for p in probs}) == 270
  assert probs == sorted(probs, key=lambda p: p.id) and all(p.answer for p in probs)


# ------------------------------------------------------------------------------------------- loader (B23)
def _problems(n):
  return [MathProblem(id=f"p{i}", prompt=f"q{i}", answer=str(i), source="t") for i in range(n)]


def _ids(batch):
  return [p.id for p in batch]


def test_b23_resume_exactly_remaining_order():
  probs = _problems(6)
  full = [_ids(b) for b in ProblemLoader(probs, 2, seed=3, num_epochs=2, shard_index=0, shard_count=1)]
  assert len(full) == 6
  for epoch in (full[:3], full[3:]):
    seen = [i for b in epoch for i in b]
    assert sorted(seen) == sorted(p.id for p in probs)  # no repeats within an epoch
  assert full[:3] != full[3:]  # reshuffled per epoch
  for stop in (3, 4):
    ld = ProblemLoader(probs, 2, seed=3, num_epochs=2, shard_index=0, shard_count=1)
    for _ in range(stop):
      next(ld)
    state = json.loads(json.dumps(ld.get_state()))
    resumed = ProblemLoader(probs, 2, seed=3, num_epochs=2, shard_index=0, shard_count=1)
    resumed.set_state(state)
    rest = [_ids(b) for b in resumed]
    assert len(rest) == 6 - stop and rest == full[stop:]


def test_loader_determinism_sharding_and_state_checks():
  probs = _problems(11)
  a = [_ids(b) for b in ProblemLoader(probs, 2, seed=1, num_epochs=1, shard_index=0, shard_count=1)]
  b = [_ids(b) for b in ProblemLoader(probs, 2, seed=1, num_epochs=1, shard_index=0, shard_count=1)]
  assert a == b and len(a) == 5  # 11 // 2, remainder dropped
  shards = [
      [i for bt in ProblemLoader(probs, 1, seed=1, num_epochs=1, shard_index=s, shard_count=3) for i in _ids(bt)]
      for s in range(3)
  ]
  assert [len(s) for s in shards] == [3, 3, 3]
  flat = [i for s in shards for i in s]
  assert len(set(flat)) == 9  # disjoint
  default = ProblemLoader(probs, 2)  # one JAX process here
  assert (default.shard_index, default.shard_count) == (0, 1)
  inf = ProblemLoader(probs, 2, num_epochs=None)
  assert len([next(inf) for _ in range(20)]) == 20
  other = ProblemLoader(probs, 2, seed=2)
  with pytest.raises(ValueError, match="seed"):
    other.set_state(default.get_state())
  with pytest.raises(ValueError, match="batch_size"):
    ProblemLoader(probs, 12)


# ------------------------------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
  texts = [f"Question: what is {i} + {2 * i}?\nAnswer: \\boxed{{{3 * i}}}" for i in range(200)]
  path = train_sentencepiece(texts, 300, str(tmp_path_factory.mktemp("spm") / "m.model"), seed=0)
  return load_sentencepiece(path)


def test_prompt_templates(spm_tok):
  p = MathProblem(id="a", prompt="What is 2+2?", answer="4", source="t")
  assert format_prompt(p, template="plain") == "Question: What is 2+2?\nAnswer:"

  class _Qwen:  # minimal stand-in with the Qwen3 chat format
    chat_format = "qwen3"

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
      from minpro_jax.data.tokenizers import qwen3_chat

      return qwen3_chat(messages, add_generation_prompt, **kw)

  assert format_prompt(p, _Qwen()) == (
      "<|im_start|>user\nWhat is 2+2?\nPlease reason step by step, and put your "
      "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
  )
  with pytest.raises(ValueError, match="tokenizer"):
    format_prompt(p, None, "chat")
  with pytest.raises(ValueError, match="template"):
    format_prompt(p, spm_tok, "fancy")


def test_long_prompts_skipped_and_counted(spm_tok, caplog):
  probs = [
      MathProblem(id="short", prompt="1+1?", answer="2", source="t"),
      MathProblem(id="long", prompt="1+1? " * 200, answer="2", source="t"),
  ]
  with caplog.at_level(logging.WARNING):
    enc = encode_prompts(probs, spm_tok, max_prompt_tokens=64, template="plain")
  assert [p.id for p in enc.problems] == ["short"] and enc.skipped == ["long"]
  assert enc.token_ids[0][0] == spm_tok.bos_id and len(enc.token_ids[0]) <= 64
  assert spm_tok.decode(enc.token_ids[0]) == enc.texts[0] == "Question: 1+1?\nAnswer:"
  assert "skipping prompt long" in caplog.text
  assert encode_prompts(probs[1:], spm_tok, max_prompt_tokens=8, template="plain").problems == []
  caplog.clear()  # many long prompts: five named, then one line for all (19,736 lines once)
  many = [MathProblem(id=f"long{i}", prompt="1+1? " * 20, answer="2", source="t") for i in range(12)]
  with caplog.at_level(logging.WARNING):
    assert len(encode_prompts(many, spm_tok, max_prompt_tokens=8, template="plain").skipped) == 12
  assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"skipping prompt long{i}" for i in range(5)] + [
      "skipped 12 prompts in all (5 named above) longer than max_prompt_tokens=8"
  ]


# ------------------------------------------------------------------------------------------- sentencepiece
def test_sentencepiece_is_reproducible(tmp_path):
  texts = [f"Question: {i} * {i + 1} = ? Answer: \\boxed{{{i * (i + 1)}}}" for i in range(400)]
  a = train_sentencepiece(texts, 320, None, seed=0)
  b = train_sentencepiece(texts, 320, None, seed=0)
  assert isinstance(a, bytes) and a == b
  tok = load_sentencepiece(a)
  assert tok.vocab_size == 320 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert tok.sp.id_to_piece(1) == "<unk>"
  assert len(tok.encode("\\boxed")) == 1 and tok.encode("12") == tok.encode("1") + tok.encode("2")
  with pytest.raises(ValueError, match="empty"):
    train_sentencepiece([], 320)
  with pytest.raises(ValueError, match="texts\\[1\\]"):
    train_sentencepiece(["a", 3], 320)
  with pytest.raises(ValueError, match="does not fit this corpus"):
    train_sentencepiece(["1+1=2"] * 10, 2000)


def test_train_spm_script_reproducible(tmp_path, capsys):
  from minpro_jax.data.train_spm import main

  args = ["--vocab_size", "400", "--jsonl", fx("gsm8k.jsonl"), "--jsonl", fx("math500.jsonl")]
  main(["--out", str(tmp_path / "a.model")] + args)
  main(["--out", str(tmp_path / "b.model")] + args)
  a, b = (tmp_path / "a.model").read_bytes(), (tmp_path / "b.model").read_bytes()
  assert a == b
  assert f"sha256={hashlib.sha256(a).hexdigest()}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- TFDS datasets
_TFDS_SPLITS = {  # split -> (fmt, fixture): every layout the loaders know
    "dapo": ("dapo", "dapo_math_17k.jsonl"),
    "math500": ("math500", "math500.jsonl"),
    "aime": ("aime", "aime.jsonl"),
    "amc": ("amc", "amc.jsonl"),
    "minerva": ("minerva", "minerva.jsonl"),
    "olympiadbench": ("olympiadbench", "olympiadbench.jsonl"),
    "gsm8k": ("gsm8k", "gsm8k.jsonl"),
}

_READ_BACK = """
import json, sys
from minpro_jax.data.tfds_source import load_tfds
out = {s: [p.to_dict() for p in load_tfds("fixture_math", s, sys.argv[1])] for s in sys.argv[2:]}
assert "tensorflow" not in sys.modules and "minpro_jax.data.build_tfds" not in sys.modules
print(json.dumps(out))
"""


def _run_py(args, **kw):
  import subprocess
  import sys

  from train_helpers import cli_env

  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=cli_env(), timeout=300, **kw)


def test_tfds_build_and_read_in_fresh_process(tmp_path):
  """build_tfds writes array_record splits of every fixture layout; a fresh process reads them back with
  tfds.data_source only (no builder class, no TensorFlow) into exactly the problems load_file gives, in order."""
  data_dir = str(tmp_path / "tfds")
  argv = ["-m", "minpro_jax.data.build_tfds", "--name=fixture_math", f"--data_dir={data_dir}"]
  argv += [f"--split={s}={f}:{fx(name)}" for s, (f, name) in _TFDS_SPLITS.items()]
  r = _run_py(argv)
  assert r.returncode == 0, r.stderr[-3000:]
  vdir = os.path.join(data_dir, "fixture_math", "1.0.0")
  files = sorted(os.listdir(vdir))
  assert "dataset_info.json" in files and "features.json" in files
  assert any(f.startswith("fixture_math-gsm8k.array_record") for f in files)
  r = _run_py(["-c", _READ_BACK, data_dir, *_TFDS_SPLITS])
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  for split, (fmt, name) in _TFDS_SPLITS.items():
    want = [p.to_dict() for p in load_file(fx(name), fmt)]
    assert got[split] == want, split
  assert [p["answer"] for p in got["dapo"]] == ["1", "24", "58"]


def test_tfds_source_errors(tmp_path):
  from minpro_jax.data.build_tfds import build_dataset, parse_split
  from minpro_jax.data.tfds_source import load_tfds, parse_tfds_ref
  from minpro_jax.errors import ConfigError

  assert parse_split("train=dapo:/d/x.parquet") == ("train", ("dapo", "/d/x.parquet"))
  assert parse_split("test=/d/x.jsonl") == ("test", ("auto", "/d/x.jsonl"))
  assert parse_tfds_ref("my_math/test@gs://bucket/tfds") == ("my_math", "test", "gs://bucket/tfds")
  with pytest.raises(ConfigError, match="DATASET/SPLIT@DATA_DIR"):
    parse_tfds_ref("my_math@/data")
  with pytest.raises(ValueError, match="snake case"):
    build_dataset("MyMath", {"train": ("auto", fx("aime.jsonl"))}, str(tmp_path))
  with pytest.raises(DataError, match="cannot be opened"):
    load_tfds("no_such_math", "train", str(tmp_path))


@pytest.mark.slow
def test_tfds_source_trains_and_evaluates_in_fresh_process(tmp_path):
  """`data.source=tfds` and an `eval.path` TFDS split, in a fresh `python -m minpro_jax.train` process that never
  imports the builder."""
  from train_helpers import cli_args, tiny_overrides

  probs = reasoning_gym_problems("chain_sum", size=72, seed=3, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
  with open(tmp_path / "train.jsonl", "w") as f:
    for p in probs[:60]:
      f.write(json.dumps({"problem": p.prompt, "answer": p.answer, "unique_id": p.id}) + "\n")
  with open(tmp_path / "test.jsonl", "w") as f:
    for p in probs[60:]:
      f.write(json.dumps({"problem": p.prompt, "answer": p.answer, "unique_id": p.id}) + "\n")
  data_dir = str(tmp_path / "tfds")
  from minpro_jax.data.build_tfds import build_dataset

  build_dataset(
      "chain_math",
      {"train": ("math500", str(tmp_path / "train.jsonl")), "test": ("math500", str(tmp_path / "test.jsonl"))},
      data_dir,
  )
  ov = tiny_overrides(
      tmp_path,
      **{
          "data.source": "tfds",
          "data.tfds_name": "chain_math",
          "data.tfds_split": "train",
          "data.tfds_data_dir": data_dir,
          "eval.path": f"chain_test=tfds:chain_math/test@{data_dir}",
          "total_steps": 2,
      },
  )
  r = _run_py(cli_args(ov)[1:])
  assert r.returncode == 0, r.stderr[-4000:]
  summary = json.load(open(os.path.join(ov["workdir"], "summary.json")))
  text = json.dumps(summary)
  assert "chain_test" in text
  recs = [json.loads(line) for line in open(os.path.join(ov["workdir"], "metrics.jsonl"))]
  assert [r["step"] for r in recs][:3] == [-1, 0, 1]
  assert 0.0 <= recs[-1]["eval/pass@1"] <= 1.0  # the final evaluation, on the TFDS held-out split


def test_tfds_config_checks_name_the_field(tmp_path):
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.errors import ConfigError
  from minpro_jax.run.run_config import validate_config

  ov = tiny_overrides(tmp_path, **{"data.source": "tfds", "data.tfds_name": "my_math"})
  with pytest.raises(ConfigError, match="tfds_name / tfds_split / tfds_data_dir"):
    validate_config(make_config(ov))
  ov["data.tfds_data_dir"] = str(tmp_path)
  with pytest.raises(ConfigError, match=r"config.data.tfds_data_dir: no dataset 'my_math'"):
    validate_config(make_config(ov))
  ov.update({"data.source": "reasoning_gym", "eval.path": f"t=tfds:my_math/test@{tmp_path}"})
  with pytest.raises(ConfigError, match=r"config.eval.path: t=tfds:my_math/test@.*no dataset 'my_math'"):
    validate_config(make_config(ov))
  (tmp_path / "my_math").mkdir()
  validate_config(make_config(ov))  # a dataset folder is there: the check passes
