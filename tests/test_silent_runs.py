"""Runs that used to end wrong but quietly (issue 43): each now stops with a message naming the field or file and
the fix, or does what its message says. Most cases stop before any training (docs/errors.md)."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from train_helpers import REPO, cli_args, cli_env, make_config, tiny_overrides

from minpro_jax import train
from minpro_jax.config_lib.parse import parse_config
from minpro_jax.errors import ConfigError, DiskFullError, UserError
from minpro_jax.models import get_preset
from minpro_jax.models.hf_io import config_to_hf
from minpro_jax.run import resume_check, run_config, run_setup
from minpro_jax.run.metrics_log import MetricsWriter, read_metrics


def _no_sft_ran(tmp_path) -> bool:
  cache = tmp_path / "cache"
  return not [f for f in (os.listdir(cache) if cache.exists() else []) if f.startswith("sft")]


# ------------------------------------------------------------------------------------------------ config
def test_a_config_argument_typo_names_the_reason():
  with pytest.raises(UserError) as e:
    parse_config(["x", "--config=configs/paper/qwen3_8b.py:minpro,3"])
  msg = str(e.value)
  assert msg.startswith("--config=configs/paper/qwen3_8b.py:minpro,3: ")
  assert "config arg delay 3; the paper's settings are" in msg and "Traceback" not in msg
  c = parse_config(["x", "--config=configs/paper/qwen3_8b.py:ppo,2"])  # the method: checked with the config
  with pytest.raises(ConfigError, match=r"^config.loss.method: Unknown method 'ppo'; valid choices: minpro, grpo"):
    run_config.validate_config(c)


def test_an_override_before_the_config_file_says_to_put_the_file_first():
  with pytest.raises(UserError) as e:
    parse_config(["x", "--config.total_steps=3", "--config=configs/default.py"])
  assert str(e.value) == (
      "--config.total_steps=3: comes before --config=FILE; put --config=FILE first (the overrides apply to that file)"
  )


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.samplng.x=1", "config.samplng.x: the config has no such field; did you mean config.sampling.x?"),
        (
            "--config.sampling.tempreature=0.5",
            "config.sampling.tempreature: the config has no such field; did you mean config.sampling.temperature?",
        ),
        ("--config.no_such_field=3", "config.no_such_field: the config has no such field; see"),
        (  # a top-level field put in a section
            "--config.learner.micro_batch_size=4",
            "config.learner.micro_batch_size: the config has no such field; did you mean config.micro_batch_size?",
        ),
    ],
)
def test_a_field_typo_names_the_whole_flag_and_the_suggestion(flag, expected):
  with pytest.raises(UserError) as e:
    parse_config(["x", "--config=configs/default.py", flag])
  assert str(e.value).startswith(expected) and "\\n" not in str(e.value) and "\\'" not in str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [("mode", "random"), ("random_rate", 0.3), ("match_rate_of", "runs/x"), ("ground_truth", True)],
)
def test_mipu_step2_settings_without_rollback_are_refused(tmp_path, field, value):
  extra = {f"mipu.{field}": value, **({"mipu.mode": "random"} if field in ("random_rate", "match_rate_of") else {})}
  c = make_config(tiny_overrides(tmp_path, **extra))
  with pytest.raises(ConfigError, match=r"config\.mipu\.\w+: .* needs mipu\.rollback=True"):
    run_config.validate_config(c)
  c = make_config(tiny_overrides(tmp_path, **{"mipu.mode": "random", "mipu.random_rate": 0.3, "mipu.rollback": True}))
  run_config.validate_config(c)  # with rollback it is the random-rollback ablation


def test_router_replay_on_a_dense_model_is_refused_by_the_config_check(tmp_path):
  for field in ("loss.router_replay", "sampling.record_routes"):
    c = make_config(tiny_overrides(tmp_path, **{field: True}))
    with pytest.raises(ConfigError) as e:
      run_config.validate_config(c)  # no tokenizer, no model: before any work
    assert str(e.value).startswith(f"config.{field}: routes exist only in MoE models"), str(e.value)


def test_a_missing_match_rate_of_run_is_refused_before_the_tokenizer(tmp_path):
  ov = {"mipu.rollback": True, "mipu.mode": "random", "mipu.match_rate_of": str(tmp_path / "nope")}
  with pytest.raises(ConfigError, match="match_rate_of"):
    run_setup.setup_run(make_config(tiny_overrides(tmp_path, **ov)))
  assert not (tmp_path / "cache").exists()  # no tokenizer trained, no SFT


def test_a_full_disk_is_found_before_the_warm_start(tmp_path, monkeypatch):
  import shutil

  monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
  with pytest.raises(DiskFullError, match=r"config\.workdir: .* has 0\.00 GB free"):
    run_setup.setup_run(make_config(tiny_overrides(tmp_path)))
  assert _no_sft_ran(tmp_path)


def test_enospc_during_a_run_is_one_line_naming_the_file(monkeypatch, capsys, tmp_path):
  def full(config):
    try:
      open(os.devnull).close()
      raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))
    except OSError as e:
      raise RuntimeError("while writing the metrics") from e

  monkeypatch.setattr(train, "_run", full)
  rc = train.main(["x", f"--config.workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert rc == train.EXIT_USER_ERROR and "Traceback" not in err
  assert err.startswith("error: config.workdir: no space left on the device writing ") and "metrics.jsonl" in err
  assert "free space on that disk" in err and "no run checkpoint was written" in err


# ------------------------------------------------------------------------------------------------ resume
def test_resume_refuses_another_grader_or_eval_sampling(tmp_path):
  c = make_config(tiny_overrides(tmp_path))
  stored = resume_check.resume_fingerprint(c)
  for field, value in (("n", 4), ("reward_mode", "math"), ("temperature", 0.6), ("top_p", 0.95)):
    other = make_config(tiny_overrides(tmp_path, **{f"eval.{field}": value}))
    with pytest.raises(
        ConfigError,
        match=rf"config\.workdir: .* different eval\.{field} \(.* in the checkpoint, .* now\); resuming would mix",
    ):
      resume_check.check_resume(other, stored, "runs/x")
  old = {k: v for k, v in stored.items() if k not in resume_check.UNRECORDED_KEYS}  # a checkpoint from before
  resume_check.check_resume(make_config(tiny_overrides(tmp_path, **{"eval.n": 4})), old, "runs/x")


def test_resume_sees_a_tfds_dataset_rebuilt_under_the_same_name(tmp_path):
  shard = tmp_path / "tfds" / "my_math" / "1.0.0" / "my_math-test.array_record-00000-of-00001"
  shard.parent.mkdir(parents=True)
  shard.write_bytes(b"first build")
  ov = {"eval.path": f"test=tfds:my_math/test@{tmp_path / 'tfds'}"}
  c = make_config(tiny_overrides(tmp_path, **ov))
  stored = resume_check.resume_fingerprint(c)
  resume_check.check_resume(c, stored, "runs/x")
  time.sleep(0.01)
  shard.write_bytes(b"second build")  # rebuilt: its held-out rows differ
  with pytest.raises(
      ConfigError,
      match=r"different tfds\.my_math@.*tfds \(.* in the checkpoint, .* now\); resuming would mix two experiments",
  ):
    resume_check.check_resume(c, stored, "runs/x")
  train_c = make_config(
      tiny_overrides(
          tmp_path,
          **{"data.source": "tfds", "data.tfds_name": "my_math", "data.tfds_data_dir": str(tmp_path / "tfds")},
      )
  )
  assert list(resume_check.resume_fingerprint(train_c)["tfds"]) == [f"my_math@{tmp_path / 'tfds'}"]


def test_a_damaged_metrics_line_is_set_aside_and_named(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "reward/mean": 0.5}).encode() for s in range(-1, 4)]
  lines[2] = lines[2].replace(b"0.5", b"0.\xff5")  # one bad byte in step 1
  path.write_bytes(b"\n".join(lines) + b"\n" + b'{"step": 4, "rew')  # and a line cut by a kill
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [-1, 0, 2, 3]
  with caplog.at_level("WARNING"):
    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False)
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [-1, 0, 2]
  assert "line(s) 3, 6 are not JSON records" in caplog.text
  assert (tmp_path / "metrics.jsonl.unreadable").read_bytes().count(b"\n") == 2


# ------------------------------------------------------------------------------------------------ tokenizer
def _unrelated_tokenizer(folder, words: int = 40, swap: tuple[int, int] | None = None):
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(words)}}
  if swap:  # the same words, two of them at each other's ids (as two tokenizers trained on other text)
    a, b = (f"w{i}" for i in swap)
    vocab[a], vocab[b] = vocab[b], vocab[a]
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def test_an_unrelated_tokenizer_in_an_hf_folder_is_refused_before_the_weights_load(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  cfg = config_to_hf(get_preset("tiny"))
  (hf / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 1}))  # no safetensors: never read
  _unrelated_tokenizer(hf)
  ov = {"model.source": "hf", "model.path": str(hf), "tokenizer.kind": "model"}
  c = make_config(tiny_overrides(tmp_path, **ov))
  c.model.overrides = {}
  with pytest.raises(
      ConfigError,
      match=rf"config\.tokenizer: the tokenizer has 42 token ids, the model's embedding "
      rf"{cfg['vocab_size']} rows; the tokenizer at .* is not the one of the model",
  ):
    run_setup.setup_run(c)
  tok = run_setup.build_tokenizer(c, [])
  tok.vocab_size = cfg["vocab_size"]  # the right size, the wrong end-of-sequence id
  with pytest.raises(ConfigError, match=r"eos_token_id \[7\] \(config.json\), but the tokenizer stops at ids \[1\]"):
    run_setup.check_tokenizer_matches(c, tok, cfg["vocab_size"], (7,))
  run_setup.check_tokenizer_matches(c, tok, cfg["vocab_size"], (1,))


def test_a_same_size_tokenizer_that_is_not_the_models_own_is_refused(tmp_path):
  """tokenizer.kind=path next to an hf model folder with its own tokenizer: equal size and eos are not enough, every
  id must be the same token string."""
  from minpro_jax.data.tokenizers import load_hf_tokenizer

  (tmp_path / "hf").mkdir()
  (tmp_path / "other").mkdir()
  _unrelated_tokenizer(tmp_path / "hf")
  _unrelated_tokenizer(tmp_path / "other", swap=(1, 2))
  ov = {"model.source": "hf", "model.path": str(tmp_path / "hf"), "tokenizer.kind": "path"}
  c = make_config(tiny_overrides(tmp_path, **{**ov, "tokenizer.path": str(tmp_path / "other")}))
  other = load_hf_tokenizer(str(tmp_path / "other"))
  assert other.vocab_size == 42 and other.stop_ids == (1,)  # passes the size and eos checks
  with pytest.raises(
      ConfigError,
      match=r"config\.tokenizer\.path: 2 of 42 token ids are other token strings than in the model's own tokenizer "
      r"\(id 3: 'w2' vs 'w1', id 4: 'w1' vs 'w2'\); the tokenizer at .*other is not the one of the model",
  ):
    run_setup.check_tokenizer_matches(c, other, 42, (1,))
  run_setup.check_tokenizer_matches(c, load_hf_tokenizer(str(tmp_path / "hf")), 42, (1,))  # its own: accepted


def test_sft_that_fits_nothing_blames_the_tokenizer_only_when_it_is_at_fault(tmp_path):
  from minpro_jax.data import format_prompt
  from minpro_jax.data.records import MathProblem

  class CharTokenizer:  # a tokenizer that knows nothing: one token per character
    vocab_size, eos_id, chat_format = 300, 1, "plain"

    def encode(self, text, add_bos=False):
      return [ord(ch) % 256 for ch in text]

  problems = [MathProblem(id=str(i), prompt=f"What is {i} + {i}?", answer=str(2 * i), source="t") for i in range(4)]
  tok = CharTokenizer()
  ids = [tok.encode(format_prompt(p, tok, "plain")) for p in problems]
  e = ValueError("SFT: no example fits max_len=8; the shortest takes 31 tokens")
  c = make_config(tiny_overrides(tmp_path, **{"tokenizer.kind": "path"}))
  assert str(run_setup._sft_fit_error(c, tok, problems, ids, e)).startswith(
      "config.tokenizer.path: SFT: no example fits max_len=8; the shortest takes 31 tokens, because the tokenizer "
      "splits the prompts into 1.00 tokens per character"
  )
  short = [i[: len(i) // 4] for i in ids]  # a tokenizer that knows the text
  assert str(run_setup._sft_fit_error(c, tok, problems, short, e)).startswith("config.sft.max_len: SFT: no example")


# ------------------------------------------------------------------------------------------------ study reuse
@pytest.mark.parametrize("study", ["minpro_staleness", "mipu"])
def test_the_committed_studies_still_aggregate(tmp_path, study):
  import shutil

  from minpro_jax.study.results import committed_root

  src = os.path.join(committed_root(REPO), study)
  dst = tmp_path / study
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.png", "study.log", "tb", "eval"))
  r = subprocess.run(
      [sys.executable, "-m", "minpro_jax.study", f"--workdir={dst}", "--aggregate-only"],
      capture_output=True,
      text=True,
      env=cli_env(),
      timeout=300,
      cwd=REPO,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  want = json.load(open(os.path.join(src, "summary.json")))
  got = json.load(open(dst / "summary.json"))
  assert got["runs"] == want["runs"]


# ------------------------------------------------------------------------------------------------ signals
def test_sigint_during_the_final_evaluation_exits_at_once_with_every_step_checkpointed(tmp_path):
  ov = tiny_overrides(tmp_path, total_steps=1, delay=0, **{"eval.num_problems": 16, "eval.n": 4, "eval.ks": (1,)})
  proc = subprocess.Popen(cli_args(ov), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "final evaluation" in line:
      break
  t0 = time.time()
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  out = "".join(seen) + out
  assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
  assert "error: stopped by signal 2 during the final evaluation; every step is checkpointed" in out
  assert time.time() - t0 < 30 and "Traceback" not in out
  run = tmp_path / "run"
  assert os.listdir(run / "checkpoints") == ["0"] and not (run / "summary.json").exists()


def test_sigterm_stops_a_process_waiting_for_the_others_of_its_run(tmp_path):
  env = {
      **cli_env(),
      "JAX_COORDINATOR_ADDRESS": "127.0.0.1:47613",
      "JAX_NUM_PROCESSES": "2",
      "JAX_PROCESS_ID": "0",  # process 1 never comes: it waits in jax.distributed.initialize
  }
  proc = subprocess.Popen(
      cli_args(tiny_overrides(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
  )
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "calling jax.distributed.initialize" in line:
      break
  time.sleep(1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + out
  assert "error: stopped by signal 15 during setup" in out


def test_metrics_rows_kept_with_the_checkpoint_are_put_back_on_resume(tmp_path, caplog):
  """metrics.jsonl deleted or cut between a checkpoint and its resume: the rows the checkpoint holds come back."""
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  for step in (-1, 0, 1, 2, 3):
    w.write(step, {"eval/avg_score": 0.25} if step == -1 else {"reward/mean": step / 10})
  kept = w.rows_upto(2)  # what the checkpoint of step 2 holds
  assert [r["step"] for r in kept] == [-1, 0, 1, 2] and kept[0] == {"step": -1, "eval/avg_score": 0.25}
  want = read_metrics(str(tmp_path))[:4]
  (tmp_path / "metrics.jsonl").unlink()
  with caplog.at_level(logging.WARNING, logger="minpro_jax"):
    w2 = MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False, restored_rows=kept)
  assert read_metrics(str(tmp_path)) == want and w2.rows_upto(2) == want
  assert "lacked the rows of 4 step(s) up to the checkpoint of step 2" in caplog.text
  # cut: only the after-SFT row is left; the others come back in step order, the row of step 3 is dropped
  (tmp_path / "metrics.jsonl").write_text(json.dumps(want[0]) + "\n")
  MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False, restored_rows=kept)
  assert read_metrics(str(tmp_path)) == want
  # a file that has them all is left as it is, and a checkpoint without rows (older) with no file says so
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="minpro_jax"):
    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False, restored_rows=kept)
    assert "lacked" not in caplog.text
    (tmp_path / "metrics.jsonl").unlink()
    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False, restored_rows=None)
  assert "holds no metrics rows" in caplog.text
