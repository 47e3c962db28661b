"""validate_config names the offending field; the CLI fails fast on bad overrides."""

import json
import os
import subprocess

import pytest
from train_helpers import cli_args, cli_env, make_config, tiny_overrides

from minpro_jax.run.run_config import ConfigError, validate_config


@pytest.fixture
def ok(tmp_path):
  return tiny_overrides(tmp_path)


def test_tiny_and_default_configs_are_valid(ok):
  validate_config(make_config(ok), num_devices=1)
  from train_helpers import load_default_config

  validate_config(load_default_config(), num_devices=1)


BAD = [
    ({"mesh.shape": "data=2,fsdp=2"}, 8, "mesh.shape"),
    ({"mesh.shape": "data=3"}, 1, "mesh.shape"),
    ({"mesh.shape": "rows=8"}, 8, "mesh.shape"),
    ({"mesh.shape": "data=2,data=4"}, 4, "mesh.shape"),  # once a silent data=4
    ({"mesh.shape": "data=--1"}, 1, "mesh.shape"),  # int() raised ValueError once
    ({"sft.row_tokens": 5}, 1, "sft.row_tokens"),  # below sft.max_len
    ({"sampling.kv_cache": "dense", "sampling.num_pages": 8}, 1, "sampling.num_pages"),  # no pool: once ignored
    ({"learner.row_tokens": 10**6}, 1, "learner.row_tokens"),  # wider than a mini-batch: once out of memory
    ({"prompts_per_step": 5, "group_size": 2, "num_updates_per_step": 2}, 1, "num_updates_per_step"),  # 10 / 2 = 5 odd
    ({"prompts_per_step": 4, "group_size": 2, "num_updates_per_step": 3}, 1, "num_updates_per_step"),
    ({"prompts_per_step": 4, "group_size": 4, "num_updates_per_step": 2, "micro_batch_size": 3}, 1, "micro_batch_size"),
    ({"delay": -1}, 1, "delay"),
    ({"loss.method": "ppo2"}, 1, "loss.method"),
    ({"model.source": "hf", "model.path": "/nonexistent/ckpt"}, 1, "model.path"),
    ({"model.source": "gguf", "model.path": "/nonexistent/model.gguf"}, 1, "model.path"),
    ({"sampling.max_new_tokens": 0}, 1, "sampling.max_new_tokens"),
    ({"sampling.max_new_tokens": -3}, 1, "sampling.max_new_tokens"),
    ({"eval.n": 2, "eval.ks": (1, 4)}, 1, "eval.ks"),
    ({"total_steps": 0}, 1, "total_steps"),
    ({"sampling.temperature": 0.0}, 1, "sampling.temperature"),
    ({"loss.prefix_statistic": "median"}, 1, "loss.prefix_statistic"),
    ({"loss.loss_agg_mode": "token-sum"}, 1, "loss.loss_agg_mode"),
    ({"loss.rollout_is": "tok"}, 1, "loss.rollout_is"),
    ({"loss.eps_low": 1.5}, 1, "loss.eps_low"),
    ({"loss.dual_clip_c": 0.5}, 1, "loss.dual_clip_c"),
    ({"optimizer.schedule": "cosin"}, 1, "optimizer.schedule"),
    ({"micro_batch_size": 0}, 1, "micro_batch_size: must be >= 1"),  # once "... not divisible by micro_batch_size=0"
    ({"optimizer.schedule": "cosine"}, 1, "optimizer.decay_steps"),  # 0: once the rate at its floor from update 1 on
    ({"optimizer.schedule": "linear", "optimizer.decay_steps": 0}, 1, "optimizer.decay_steps"),
    ({"optimizer.learning_rate": -1.0}, 1, "optimizer.learning_rate"),
    ({"advantage_mode": "ppo"}, 1, "advantage_mode"),
    ({"reward.mode": "float"}, 1, "reward.mode"),
    ({"model.preset": "nope"}, 1, "model.preset"),
    ({"tokenizer.kind": "model"}, 1, "tokenizer.kind"),
    ({"data.template": "chatml"}, 1, "data.template"),
    ({"sampling.top_p": 1.5}, 1, "sampling.top_p"),
    ({"sampling.top_k": -3}, 1, "sampling.top_k"),
    ({"eval.path": "aime=aime:/nonexistent.jsonl"}, 1, "eval.path"),
    ({"workdir": ""}, 1, "workdir"),
    ({"workdir": "/etc/hostname"}, 1, "workdir"),  # a file
    ({"workdir": os.path.join(os.path.dirname(__file__), "..", "results", "mipu")}, 1, "workdir"),  # a study's
    ({"data.source": "file", "data.path": "/"}, 1, "data.path"),  # a directory
    ({"eval.num_problems": 0}, 1, "eval.num_problems"),
    ({"data.format": "jsonl"}, 1, "data.format"),
    ({"mesh.rules": "fsdp_only"}, 1, "mesh.rules: rule set 'fsdp_only' is unknown"),
    ({"mesh.rules": "default:mlps=fsdp"}, 1, "mesh.rules: 'mlps' is no logical axis"),
    ({"mesh.rules": "mlp=fsdp+fsdp"}, 1, "mesh.rules: mlp=fsdp+fsdp names a mesh axis twice"),
    ({"sampling.rules": "vocab=model"}, 1, "sampling.rules: vocab=model: 'model' is no mesh axis"),
    ({"sampling.engine": "vllm"}, 1, "sampling.engine: 'vllm'; choose one of"),
    ({"sampling.engine": "static", "sampling.kv_cache": "dense"}, 1, "sampling.engine: 'static' names the engine"),
]


@pytest.mark.parametrize("bad,devices,field", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_validate_config_names_the_field(ok, bad, devices, field):
  c = make_config({**ok, **bad})
  with pytest.raises(ConfigError) as e:
    validate_config(c, num_devices=devices)
  assert f"config.{field}" in str(e.value)


def test_mesh_that_divides_the_devices_is_accepted(ok):
  # (a micro-batch of 8 splits over data x fsdp = 8: tests/test_micro_batch_split.py)
  validate_config(make_config({**ok, "mesh.shape": "data=2,fsdp=4", "prompts_per_step": 8, "micro_batch_size": 8}), 8)


def test_mesh_error_says_whether_the_sizes_divide_or_multiply_to_the_devices(ok):
  with pytest.raises(ConfigError, match=r"^config\.mesh\.shape: 'data=2,fsdp=2': the sizes multiply to 4, not the 5 "):
    validate_config(make_config({**ok, "mesh.shape": "data=2,fsdp=2"}), 5)
  with pytest.raises(
      ConfigError, match=r"^config\.mesh\.shape: 'data=2,fsdp=-1': the sizes other than -1 \(2\) do not"
  ):
    validate_config(make_config({**ok, "mesh.shape": "data=2,fsdp=-1"}), 5)


def _run_cli(args, timeout=120):
  return subprocess.run(args, capture_output=True, text=True, env=cli_env(), timeout=timeout)


def test_cli_negative_delay_fails_naming_the_field(tmp_path, ok):
  r = _run_cli(cli_args({**ok, "delay": -1}))
  assert r.returncode != 0
  assert "config.delay" in r.stderr + r.stdout
  assert not (tmp_path / "cache").exists()  # failed before any expensive work (tokenizer / SFT)


def test_cli_unknown_field_fails(tmp_path, ok):
  r = _run_cli(cli_args(ok) + ["--config.no_such_field=3"])
  assert r.returncode != 0
  assert "no_such_field" in r.stderr + r.stdout


def test_resume_refuses_a_checkpoint_of_another_experiment(ok):
  from minpro_jax.run.resume_check import check_resume, resume_fingerprint

  stored = resume_fingerprint(make_config(ok))
  check_resume(make_config(ok), stored, "runs/x")  # same config: fine
  with pytest.raises(ConfigError) as e:
    check_resume(make_config({**ok, "loss.method": "grpo", "delay": 4}), stored, "runs/x")
  assert "config.workdir" in str(e.value) and "delay" in str(e.value) and "loss" in str(e.value)
  assert "loss.method" in str(e.value)  # dict-valued keys name the field inside them
  # mipu settings matter only with rollback on
  check_resume(make_config({**ok, "mipu.val_prompts": 16}), stored, "runs/x")
  with pytest.raises(ConfigError, match="mipu.rollback"):
    check_resume(make_config({**ok, "mipu.rollback": True}), stored, "runs/x")
  # the response length is part of the experiment
  with pytest.raises(ConfigError, match="sampling.max_new_tokens"):
    check_resume(make_config({**ok, "sampling.max_new_tokens": 4}), stored, "runs/x")
  # the fp8 options change mu: part of it; a checkpoint from before they existed ran with their defaults
  fp8 = {**ok, "sampling.precision": "fp8"}
  stored8 = resume_fingerprint(make_config(fp8))
  with pytest.raises(ConfigError, match=r"sampling\.fp8_format"):
    check_resume(make_config({**fp8, "sampling.fp8_format": "e5m2"}), stored8, "runs/x")
  old = {k: v for k, v in stored8.items() if not k.startswith("sampling.fp8_")}
  check_resume(make_config(fp8), old, "runs/x")
  with pytest.raises(ConfigError, match=r"sampling\.fp8_activations"):
    check_resume(make_config({**fp8, "sampling.fp8_activations": "none"}), old, "runs/x")


def test_a_checkpoint_from_before_inflight_checkpoint_kv_resumes(ok):
  """Every run checkpoint stores `staleness` whole; one written before `staleness.inflight_checkpoint_kv` existed
  (delay-mode runs included) ran with its default "save" and resumes under a config that leaves it at the default.
  The in-flight fields are compared only in the in-flight mode, and `inflight_checkpoint_kv` never."""
  from minpro_jax.run.resume_check import check_resume, resume_fingerprint

  stored = resume_fingerprint(make_config(ok))
  old = {**stored, "staleness": {k: v for k, v in stored["staleness"].items() if k != "inflight_checkpoint_kv"}}
  assert old["staleness"] == {"mode": "delay", "inflight_every": 16, "inflight_kv": "keep"}
  check_resume(make_config(ok), old, "runs/x")
  # the in-flight fields are read only in the in-flight mode: part of its experiment, not of a delay-mode run's
  check_resume(make_config({**ok, "staleness.inflight_kv": "recompute"}), old, "runs/x")
  inflight = {**ok, "staleness.mode": "inflight", "sampling.kv_cache": "dense"}
  stored = resume_fingerprint(make_config(inflight))
  with pytest.raises(ConfigError, match=r"staleness\.inflight_kv \('keep' in the checkpoint, 'recompute' now\)"):
    check_resume(make_config({**inflight, "staleness.inflight_kv": "recompute"}), stored, "runs/x")
  with pytest.raises(ConfigError, match=r"staleness\.mode \('inflight' in the checkpoint, 'delay' now\)"):
    check_resume(make_config(ok), stored, "runs/x")
  # how checkpoints are written is not the experiment: save <-> rebuild may change on resume
  check_resume(make_config({**inflight, "staleness.inflight_checkpoint_kv": "rebuild"}), stored, "runs/x")


def test_trainer_refuses_an_unwritable_workdir_and_a_data_file_without_problems(tmp_path, ok):
  from minpro_jax.run.trainer import Trainer

  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match=r"config\.workdir: cannot write to .*a_file/run"):
    Trainer.from_config(make_config({**ok, "workdir": str(blocker / "run")}))
  with pytest.raises(ConfigError, match=r"config\.data\.task / config\.data\.task_config: .*'no_such_task'"):
    Trainer.from_config(make_config({**ok, "data.task": "no_such_task"}))
  with pytest.raises(ConfigError, match=r"config\.data\.task / config\.data\.task_config: .*max_terms must be >="):
    Trainer.from_config(make_config({**ok, "data.task_config.min_terms": 5}))  # reasoning-gym asserts: a traceback
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ConfigError, match=r"config\.data\.path: .*empty\.jsonl' holds no usable problem"):
    Trainer.from_config(make_config({**ok, "data.source": "file", "data.path": str(empty)}))


def test_mipu_validation_batch_must_split_into_scoring_micro_batches(ok):
  c = make_config({**ok, "mipu.rollback": True, "mipu.val_prompts": 3, "mipu.val_group_size": 3})
  with pytest.raises(ConfigError, match=r"mipu.val_prompts: .* 9 validation samples .* micro-batch"):
    validate_config(c)
  from minpro_jax.run.run_config import check_mipu_problem_count

  c = make_config({**ok, "mipu.rollback": True, "mipu.val_prompts": 8})
  check_mipu_problem_count(c, 8)
  with pytest.raises(ConfigError, match="mipu.val_prompts: 8 validation prompts .* only 7 are available"):
    check_mipu_problem_count(c, 7)


def test_a_data_file_without_eval_path_splits_off_a_seeded_heldout_set(tmp_path, ok):
  from minpro_jax.run.run_setup import train_and_eval_problems

  path = tmp_path / "mine.jsonl"
  rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(30)]
  rows.append(dict(rows[3]))  # a duplicated prompt goes to one side only
  path.write_text("\n".join(json.dumps(r) for r in rows))
  cfg = {**ok, "data.source": "file", "data.path": str(path), "eval.num_problems": 100}
  train, evals = train_and_eval_problems(make_config(cfg))
  assert list(evals) == ["mine_heldout"]
  held = {p.prompt for p in evals["mine_heldout"]}
  assert len(held) == len(evals["mine_heldout"]) == 6  # 20 % of 30 distinct prompts, below eval.num_problems
  assert not held & {p.prompt for p in train} and len(train) + 6 + ("What is 3 + 3?" in held) == 31
  again, evals2 = train_and_eval_problems(make_config(cfg))
  assert [p.prompt for p in evals2["mine_heldout"]] == [p.prompt for p in evals["mine_heldout"]]  # eval.seed fixes it
  _, other = train_and_eval_problems(make_config({**cfg, "eval.seed": 7}))
  assert {p.prompt for p in other["mine_heldout"]} != held
  _, few = train_and_eval_problems(make_config({**cfg, "eval.num_problems": 2}))
  assert len(few["mine_heldout"]) == 2
  # with eval.path the file is the held-out set and nothing is split off
  extra = tmp_path / "extra.jsonl"
  extra.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}))
  train3, evals3 = train_and_eval_problems(make_config({**cfg, "eval.path": f"extra=auto:{extra}"}))
  assert list(evals3) == ["extra"] and len(train3) == 30  # "What is 1 + 1?" removed from training
  one = tmp_path / "one.jsonl"
  one.write_text(json.dumps(rows[0]))
  with pytest.raises(ConfigError, match=r"config\.data: 1 distinct problem\(s\), too few .* eval\.path"):
    train_and_eval_problems(make_config({**cfg, "data.path": str(one)}))


def test_heldout_prompts_longer_than_max_prompt_tokens_are_skipped_not_fed_to_the_sampler(ok):
  from minpro_jax.data.records import MathProblem
  from minpro_jax.run.run_setup import fit_eval_sets

  class WordTokenizer:  # one token per word

    def encode(self, text, add_bos=False):
      return [0] * (len(text.split()) + add_bos)

  c = make_config({**ok, "data.template": "plain", "data.max_prompt_tokens": 12})
  short = MathProblem(id="s", prompt="What is 1 + 1?", answer="2", source="t")
  long = MathProblem(id="l", prompt="What is " + " + ".join(["1"] * 20) + "?", answer="20", source="t")
  assert fit_eval_sets(c, WordTokenizer(), {"a": [short, long], "b": [short]}) == {"a": [short], "b": [short]}
  with pytest.raises(ConfigError, match=r"config\.data\.max_prompt_tokens: no prompt of held-out set 'c' fits"):
    fit_eval_sets(c, WordTokenizer(), {"a": [short], "c": [long]})


def test_the_eval_fields_that_choose_the_heldout_prompts_are_part_of_the_resume_check(ok):
  from minpro_jax.run.resume_check import check_resume, resume_fingerprint

  stored = resume_fingerprint(make_config(ok))
  for field, value in (("eval.seed", 1), ("eval.num_problems", 3), ("eval.path", "x=auto:/y.jsonl")):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      check_resume(make_config({**ok, field: value}), stored, "runs/x")


def test_a_field_every_source_takes_is_refused_in_model_overrides(ok):
  """model.remat (and the other every-source fields) set in a config file's model.overrides would be ambiguous."""
  c = make_config(ok)
  with c.model.overrides.unlocked():
    c.model.overrides.remat = "block"
  with pytest.raises(ConfigError, match="config.model.overrides.remat: set config.model.remat instead"):
    validate_config(c, num_devices=1)
