"""A user's mistake ends in one clear message naming the field or file, exit status 2, and no traceback; checks run
before expensive work; nothing fails silently during a run (docs/errors.md lists every case)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import cli_args, cli_env, make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.models import get_preset
from minpro_jax.models.hf_io import config_to_hf
from minpro_jax.run.resume_check import check_resume, resume_fingerprint
from minpro_jax.run.run_setup import lock_workdir, writable_workdir

_TINY_PRESET = {
    k: getattr(get_preset("tiny"), k)
    for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
}


def _cli(args, timeout=180):
  return subprocess.run(args, capture_output=True, text=True, env=cli_env(), timeout=timeout)


def _hf_folder(tmp_path, safetensors: bytes | None = None, config: str | None = None):
  d = tmp_path / "hf"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(config if config is not None else json.dumps(config_to_hf(get_preset("tiny"))))
  if safetensors is not None:
    (d / "model.safetensors").write_bytes(safetensors)
  return d


def _file(tmp_path, name, rows):
  p = tmp_path / name
  p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return p


def _cases(tmp_path):
  """(id, extra overrides or raw argv, text the message must contain)."""
  fractions = _file(
      tmp_path, "fractions.jsonl", [{"problem": f"What is 1/{i}?", "answer": f"1/{i}"} for i in range(2, 40)]
  )
  junk = _file(tmp_path, "junk.jsonl", [{"nothing": i} for i in range(3)])
  not_tok = tmp_path / "not_a_tokenizer.txt"
  not_tok.write_text("hello")
  bad_gguf = tmp_path / "model.gguf"
  bad_gguf.write_bytes(b"GGUF" + b"\0" * 20)
  return [
      ("config file", ["--config=/nonexistent/cfg.py"], "--config=/nonexistent/cfg.py: cannot load"),
      ("unknown field", ["--config.no_such_field=3"], "config.no_such_field: the config has no such field"),
      ("unparsable value", ["--config.delay=abc"], "--config.delay=abc"),
      ("lr inf", {"optimizer.learning_rate": float("inf")}, "config.optimizer.learning_rate"),
      ("lr huge", {"optimizer.learning_rate": 1e3}, "config.optimizer.learning_rate: 1000.0 is above 1.0"),
      ("b2", {"optimizer.b2": 1.5}, "config.optimizer.b2"),
      ("warmup", {"optimizer.warmup_steps": -1}, "config.optimizer.warmup_steps"),
      ("data runs out", {"total_steps": 1000, "data.num_epochs": 1}, "config.data.num_epochs: "),
      ("answers not integer", {"data.source": "file", "data.path": str(fractions)}, "config.reward.mode: "),
      ("chat format", {"tokenizer.chat_format": "llama3"}, "config.tokenizer.chat_format: 'llama3'"),
      ("tokenizer file", {"tokenizer.kind": "path", "tokenizer.path": str(not_tok)}, f"{not_tok}: cannot read a token"),
      ("eval file unusable", {"eval.path": f"junk=auto:{junk}"}, "config.eval.path: held-out set 'junk'"),
      ("empty data.path", {"data.source": "file", "data.path": ""}, "config.data.path: empty"),
      ("bad override", {"model.overrides.num_kv_heads": 3}, "config.model.overrides.num_heads"),
      ("moe_impl", {"model.moe_impl": "megablox"}, "config.model.moe_impl: ModelConfig.moe_impl='megablox'"),
      (
          "in-flight on the paged cache",
          {"staleness.mode": "inflight", "sampling.kv_cache": "paged"},
          "config.sampling.kv_cache: 'paged': staleness.mode='inflight' streams",
      ),
      (
          "hf moe_impl",
          {"model.source": "hf", "model.path": str(_hf_folder(tmp_path)), "model.moe_impl": "x"},
          "config.model.moe_impl",
      ),
      (
          "hf config.json",
          {"model.source": "hf", "model.path": str(_hf_folder(tmp_path / "a", config="{not json"))},
          "config.json: not a usable Hugging Face config.json",
      ),
      (
          "overrides vs checkpoint",
          {"model.source": "hf", "model.path": str(_hf_folder(tmp_path / "b"))},
          "config.model.overrides.hidden_size: 32 contradicts the checkpoint's hidden_size=64",
      ),
      (
          "truncated safetensors",
          {"model.source": "hf", "model.path": str(_hf_folder(tmp_path / "c", safetensors=b"\x10\0\0\0"))}
          | {f"model.overrides.{k}": v for k, v in _TINY_PRESET.items()},
          "cannot load a hf checkpoint (config.model.path",
      ),
      (
          "truncated gguf",
          {"model.source": "gguf", "model.path": str(bad_gguf)},
          f"{bad_gguf}: cannot load a gguf checkpoint",
      ),
  ]


def test_each_user_mistake_prints_one_message_naming_the_field_and_no_traceback(tmp_path):
  for sub in ("a", "b", "c"):
    (tmp_path / sub).mkdir()
  failures = []
  for name, extra, expected in _cases(tmp_path):
    ov = tiny_overrides(tmp_path, workdir=str(tmp_path / "run"))
    if isinstance(extra, list):
      args = cli_args(ov) + extra
    else:
      model = {k.split(".")[-1]: v for k, v in extra.items() if k.startswith("model.overrides.")}
      ov.update({k: v for k, v in extra.items() if not k.startswith("model.overrides.")})
      args = cli_args(ov, model)
    r = _cli(args)
    out = r.stdout + r.stderr
    if r.returncode != 2 or expected not in out or "Traceback" in out:
      failures.append(f"{name}: rc={r.returncode}, expected {expected!r}, got ...{out[-600:]}")
  assert not failures, "\n\n".join(failures)
  cache = tmp_path / "cache"
  assert not [f for f in (os.listdir(cache) if cache.exists() else []) if f.startswith("sft")]  # no warm start ran


def test_a_study_grid_given_as_the_config_says_how_to_run_it():
  r = _cli([sys.executable, "-m", "minpro_jax.train", "--config=configs/studies/smoke.py"])
  want = "error: --config=configs/studies/smoke.py: the file has no get_config(); it is a study grid: run .venv/bin/python -m "
  assert r.returncode == 2 and want + "minpro_jax.study --grid=configs/studies/smoke.py" in r.stderr, r.stderr[-800:]


def test_debug_flag_shows_the_traceback(tmp_path):
  r = _cli(cli_args(tiny_overrides(tmp_path, delay=-1)) + ["--debug"])
  assert r.returncode != 0 and "Traceback" in r.stderr and "config.delay" in r.stderr


def test_one_run_per_workdir(tmp_path):
  lock = lock_workdir(str(tmp_path))
  with pytest.raises(ConfigError, match=rf"config\.workdir: .* is in use by another run \(pid {os.getpid()}\)"):
    lock_workdir(str(tmp_path))
  lock.close()  # released with the file (and by the kernel when a process dies, SIGKILL included)
  lock_workdir(str(tmp_path)).close()
  holder = subprocess.Popen(
      [
          "python3",
          "-c",
          "import fcntl,time,sys; f=open(sys.argv[1],'a+'); "
          "fcntl.flock(f, fcntl.LOCK_EX); f.write('4242'); f.flush(); time.sleep(60)",
          str(tmp_path / ".lock"),
      ]
  )
  try:
    for _ in range(100):
      if (tmp_path / ".lock").read_text().strip().endswith("4242"):
        break
      time.sleep(0.05)
    with pytest.raises(ConfigError, match=r"in use by another run \(pid .*4242\)"):
      lock_workdir(str(tmp_path))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock_workdir(str(tmp_path)).close()  # a killed holder leaves no stale lock


def test_a_url_workdir_is_refused_not_made_a_local_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=r"config\.workdir='gs://bucket/run': URLs are not supported"):
    writable_workdir("gs://bucket/run")
  assert not (tmp_path / "gs:").exists()


def test_resume_sees_an_edited_data_file(tmp_path):
  path = _file(tmp_path, "data.jsonl", [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(30)])
  c = make_config(tiny_overrides(tmp_path, **{"data.source": "file", "data.path": str(path)}))
  stored = resume_fingerprint(c)
  check_resume(c, stored, "runs/x")
  path.write_text(path.read_text().replace('"answer": "5"', '"answer": "6"'))  # same rows, one answer changed
  with pytest.raises(ConfigError, match=r"config\.workdir: .* different files\."):
    check_resume(c, stored, "runs/x")


def test_an_update_that_makes_the_parameters_non_finite_is_skipped():
  from test_learner import _batch, _model

  from minpro_jax.rl.learner import Learner, LossConfig
  from minpro_jax.rl.optimizer import OptimizerConfig

  model = _model()
  batch = _batch(model)
  learner = Learner(model, LossConfig(method="grpo"), OptimizerConfig(learning_rate=1e-2), micro_batch_size=4)
  learner.optimizer = optax.sgd(float("inf"))  # loss and gradient stay finite; the updated parameters do not
  state = learner.init_state(nnx.split(model)[1])
  before = jax.tree.map(np.asarray, state.params)
  state, m = learner.update(state, batch)
  assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and bool(m["update_skipped"])
  assert int(state.step) == 0 and int(state.skipped) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_a_run_whose_updates_keep_being_skipped_stops_on_its_last_good_state(tmp_path, monkeypatch):
  from minpro_jax.errors import TrainingError
  from minpro_jax.rl import learner as learner_mod
  from minpro_jax.run.run_watch import MAX_ALL_SKIPPED_STEPS
  from minpro_jax.run.trainer import Trainer

  monkeypatch.setattr(learner_mod, "_all_finite", lambda tree: jnp.asarray(False))  # every update is non-finite
  tr = Trainer.from_config(make_config(tiny_overrides(tmp_path, total_steps=8, delay=0)))
  with pytest.raises(TrainingError, match=r"every optimizer update of global steps 0\.\.2 was non-finite .* at step 2"):
    tr.run()
  recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in recs if r["step"] >= 0]
  assert len(steps) == MAX_ALL_SKIPPED_STEPS and all(r["learn/skipped_updates"] == 2 for r in steps)
  assert tr.ckpt.latest_step() == 2  # the last good state (here: the warm start) is checkpointed
  _, state, _, _ = tr.ckpt.restore_latest(tr.learner.init_state(nnx.split(tr.model)[1]))
  assert int(state.step) == 0 and int(state.skipped) == 2 * MAX_ALL_SKIPPED_STEPS


def test_sigterm_during_setup_says_what_is_lost(tmp_path):
  ov = tiny_overrides(tmp_path, **{"sft.steps": 100000})
  proc = subprocess.Popen(cli_args(ov), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "trained sentencepiece tokenizer" in line:
      break
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  out = "".join(seen) + out
  assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
  assert "error: stopped by signal 15 during setup" in out and "Traceback" not in out


def test_a_tuple_field_given_twice_is_refused_not_joined():
  from minpro_jax.config_lib.parse import parse_config
  from minpro_jax.errors import UserError

  with pytest.raises(
      UserError, match=r"--config\.eval\.ks: given 2 times, so its values were joined into \(1, 2, 1, 8\)"
  ):
    parse_config(["train", "--config.eval.ks=1,2", "--config.eval.ks=1,8"])
  c = parse_config(["train", "--config.eval.ks=1,8", "--config.delay=1", "--config.delay=3"])
  assert c.eval.ks == (1, 8) and c.delay == 3  # once: as given; a scalar given twice: the last value


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--port=99999", "--port=99999: must be a TCP port in [1, 65535], or 0 for a free one"),
        ("--port=-1", "--port=-1: must be a TCP port"),
        ("--grace_s=-5", "--grace_s=-5.0: must be a finite number of seconds >= 0"),
        ("--grace_s=nan", "--grace_s=nan: must be a finite number"),
    ],
)
def test_launch_local_refuses_a_bad_port_or_grace_before_starting_anything(flag, message, capsys, monkeypatch):
  from minpro_jax import launch_local

  monkeypatch.setattr(launch_local, "spawn", lambda *a, **k: pytest.fail("started processes"))
  with pytest.raises(SystemExit) as e:
    launch_local.main([flag, "--num_processes=1", "--", "--config.total_steps=1"])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_evaluate_names_a_value_of_the_wrong_type_with_its_type():
  from minpro_jax.config_lib.defaults import get_config
  from minpro_jax.evaluate import apply_overrides

  with pytest.raises(ConfigError, match=r"^--eval\.n='abc': not an int \(invalid literal"):
    apply_overrides(get_config(), {"eval.n": "abc"})
  with pytest.raises(ConfigError, match=r"^--eval\.top_p='x': not a float \("):
    apply_overrides(get_config(), {"eval.top_p": "x"})


def test_a_signal_during_the_exit_of_a_finished_run_keeps_its_status():
  """After main returned, a SIGTERM in the interpreter's teardown (orbax / JAX exit handlers) exits with the run's
  status and one line, not 143 and silence."""
  code = (
      "import atexit, os, signal, time\n"
      "from minpro_jax import train\n"
      "train.exit_quietly_on_signal(0)\n"
      "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))  # a slow exit handler\n"
  )
  r = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert r.returncode == 0, (r.returncode, r.stderr[-800:])
  assert r.stderr == (
      "stopped by signal 15 while exiting: the command had already finished (exit status 0) and written its results; "
      "nothing is lost\n"
  )
