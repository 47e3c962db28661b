"""`python -m minpro_jax.export`: a run's checkpoint as a Hugging Face folder (`minpro_jax.run.run_load`, `export`).

A run directory is written here without training (config.json, tokenizer.model, a best-parameter and a run
checkpoint of a tiny scanned MoE), so every path is exercised in seconds; `test_train_e2e` exports a trained run too.
The weights' layout conversion itself is `save_hf_checkpoint`'s, tested against transformers in
`test_model_hf_parity`.
"""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import make_config, tiny_overrides

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from minpro_jax import export  # noqa: E402
from minpro_jax.data.spm import train_sentencepiece  # noqa: E402
from minpro_jax.data.tokenizers import load_hf_tokenizer, load_sentencepiece  # noqa: E402
from minpro_jax.errors import CheckpointError, ConfigError  # noqa: E402
from minpro_jax.models import init_model  # noqa: E402
from minpro_jax.models.hf_io import hf_state_dict, load_hf_checkpoint  # noqa: E402
from minpro_jax.rl.learner import TrainState  # noqa: E402
from minpro_jax.run import run_config, run_load  # noqa: E402
from minpro_jax.run.checkpoint import RunCheckpointer  # noqa: E402

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "num_layers": 2}
CORPUS = [f"Compute {a} + {b}.\nAnswer: \\boxed{{{a + b}}}" for a in range(40) for b in range(0, 40, 7)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run's workdir as the trainer leaves it: config.json, tokenizer.model, best step 4, run checkpoints 5, 6."""
  tmp = tmp_path_factory.mktemp("export")
  c = make_config(tiny_overrides(tmp, **{"tokenizer.vocab_size": 320, "model.scan_layers": True}), model=MOE)
  tokenizer = load_sentencepiece(train_sentencepiece(CORPUS, 320, str(tmp / "spm.model")))
  cfg = run_load.model_config(c, tokenizer)
  assert cfg.is_moe and cfg.scan_layers
  workdir = str(tmp / "run")
  os.makedirs(workdir)
  run_load.save_run_files(workdir, c, tokenizer)
  ckpt = RunCheckpointer(workdir, keep=2)
  models = {}
  for seed, (kind, step) in enumerate((("best", 4), ("step", 5), ("final", 6))):
    model = init_model(cfg, seed=seed)
    params = jax.tree.map(lambda p: 3 * p, nnx.state(model, nnx.Param))  # HF's 0.02 init gives flat logits
    nnx.update(model, params)
    if kind == "best":
      ckpt.save_best(step, params, {"score": 0.5, "step": step})
    else:
      state = TrainState(params, optax.adam(1e-3).init(params), jnp.int32(step), jnp.int32(0))
      buffer = {"steps": np.zeros(0, np.int64), "batches": {}}  # an empty delay buffer
      ckpt.save(step, state, buffer, {"global_step": step})
    models[kind] = model
  ckpt.close()
  return workdir, tokenizer, models


def _logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens)).out)


def _tokens(tokenizer):
  return np.array([tokenizer.encode("Compute 12 + 7.\nAnswer: \\boxed{19}")], np.int32)


@pytest.mark.parametrize("which", ["best", "final", "5"])
def test_export_loads_in_transformers_with_the_runs_logits(run_dir, which, tmp_path):
  workdir, tokenizer, models = run_dir
  out = str(tmp_path / "hf")
  info = export.export(workdir, out, which)
  want_kind, want_step = {"best": ("best", 4), "final": ("final", 6), "5": ("step", 5)}[which]
  assert (info["which"], info["step"]) == (want_kind, want_step)
  tokens = _tokens(tokenizer)
  ours = _logits(models[want_kind], tokens)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert float(np.abs(ref).std()) > 0.3, "logits too flat for a meaningful comparison"
  assert float(np.abs(ours - ref).max()) <= 1e-4
  # each checkpoint is its own (the three were drawn with different seeds)
  for other, m in models.items():
    if other != want_kind:
      assert float(np.abs(_logits(m, tokens) - ref).max()) > 1e-2
  # re-imported as model.source=hf: the same parameters, bit for bit
  reloaded, cfg = load_hf_checkpoint(out)
  assert cfg.is_moe and cfg.num_experts == 4 and cfg.architecture == "qwen3_moe"
  want = dict(hf_state_dict(models[want_kind]))
  got = dict(hf_state_dict(reloaded))
  assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
  # the tokenizer, as transformers loads it, gives the run's ids; the generation config its sampling settings
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  ours_tok = load_hf_tokenizer(out)  # what a run with model.source=hf, tokenizer.kind=model reads
  assert (ours_tok.bos_id, ours_tok.eos_id, ours_tok.pad_id) == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
  for text in CORPUS[:50:7] + list(export.CHECK_TEXTS):
    assert hf_tok.encode(text, add_special_tokens=False) == tokenizer.encode(text) == ours_tok.encode(text)
  gen = json.load(open(os.path.join(out, "generation_config.json")))
  assert gen["eos_token_id"] == [tokenizer.eos_id] and gen["temperature"] == 1.0 and gen["max_new_tokens"] == 6
  hf_cfg = json.load(open(os.path.join(out, "config.json")))
  assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (2, 3, 0)
  # every file readable by others, as a plain write gives it (safetensors alone writes 0600)
  umask = os.umask(0)
  os.umask(umask)
  modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)}
  assert modes["model.safetensors"] == 0o666 & ~umask and all(m == 0o666 & ~umask for m in modes.values()), modes


def test_partial_restore_reads_only_the_parameters(run_dir):
  workdir, _, models = run_dir
  run = run_load.load_run(workdir, "final")
  want = nnx.state(models["final"], nnx.Param)
  got = nnx.state(run.model, nnx.Param)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), want, got))
  assert run.config.model.scan_layers is True and run.step == 6
  # the seed offset of the run's evaluation of these parameters: global steps done (step 6 is the 7th), not the
  # checkpoint's optimizer-update count (a standalone --which=final once sampled with eval.seed + updates)
  assert run.eval_step == 7 and run_load.load_run(workdir, "best").eval_step == 4


def test_final_of_a_stopped_run_says_it_is_the_newest_checkpoint(run_dir, tmp_path, caplog):
  workdir, _, _ = run_dir
  stopped = str(tmp_path / "stopped")
  shutil.copytree(workdir, stopped)
  cfg_path = os.path.join(stopped, "config.json")
  cfg = json.load(open(cfg_path))
  cfg["total_steps"] = 20  # the newest checkpoint is after global step 7 of 20
  json.dump(cfg, open(cfg_path, "w"))
  with caplog.at_level(logging.WARNING, logger="minpro_jax.run.run_load"):
    run_load.load_run(workdir, "final")  # finished (total_steps 4 <= 7): nothing to say
    assert not caplog.records
    assert run_load.load_run(stopped, "final").step == 6
  assert "stopped after global step 7 of 20 (total_steps)" in caplog.text


def test_a_resume_that_changes_fields_names_them(tmp_path, caplog):
  c = make_config(tiny_overrides(tmp_path))
  c.tokenizer.kind = "path"  # a tokenizer read from where the config points: only config.json is written
  run_load.save_run_files(str(tmp_path), c, None)
  with caplog.at_level(logging.WARNING, logger="minpro_jax.run.run_load"):
    run_load.save_run_files(str(tmp_path), c, None)  # the same config: nothing to say
    assert not caplog.records
    c.optimizer.learning_rate, c.total_steps = 1e-5, 9
    run_load.save_run_files(str(tmp_path), c, None)
  (rec,) = caplog.records
  assert "changes 2 config field(s)" in rec.getMessage() and "optimizer.learning_rate (" in rec.getMessage()
  assert "-> 1e-05)" in rec.getMessage() and "total_steps (4 -> 9)" in rec.getMessage()
  assert run_load.load_run_config(str(tmp_path)).total_steps == 9


def test_bad_input_names_the_flag(run_dir, tmp_path, capsys):
  workdir, _, _ = run_dir
  with pytest.raises(CheckpointError, match=r"--which=9: no run checkpoint of that step .* keeps steps \[5, 6\]"):
    run_load.load_run(workdir, 9)
  with pytest.raises(ConfigError, match=r"--which='latest': use best, final or a global step"):
    run_load.load_run(workdir, "latest")
  with pytest.raises(ConfigError, match=r"--workdir: .* is not a directory"):
    run_load.load_run(str(tmp_path / "nope"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ConfigError, match=r"has no config.json .* and no summary.json"):
    run_load.load_run(str(tmp_path / "empty"))
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("mine")
  with pytest.raises(ConfigError, match=r"--out: .*busy is a non-empty folder that holds no export"):
    export.export(workdir, str(tmp_path / "busy"))
  # only a new folder, an empty one or an earlier export is written; never the run's workdir or a file
  with pytest.raises(ConfigError, match=r"--out: .* is the run's workdir"):
    export.export(workdir, workdir)
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ConfigError, match=r"--out: .*afile is a file"):
    export.export(workdir, str(tmp_path / "afile"))
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text("{}")  # somebody's model folder, not an export
  with pytest.raises(ConfigError, match=r"--out: .*model is a non-empty folder that holds no export"):
    export.export(workdir, str(tmp_path / "model"))
  # an export of another checkpoint is replaced only with overwrite; the same checkpoint's is rewritten
  export.export(workdir, str(tmp_path / "hf"), "best")
  export.export(workdir, str(tmp_path / "hf"), "best")
  with pytest.raises(ConfigError, match=r"--out: .*hf holds the best checkpoint \(step 4\) of .*; this is the final "):
    export.export(workdir, str(tmp_path / "hf"), "final")
  assert json.load(open(tmp_path / "hf" / export.MARKER))["which"] == "best"  # untouched
  assert export.export(workdir, str(tmp_path / "hf"), "final", overwrite=True)["step"] == 6
  # an --out that cannot be created: one line naming the flag
  for bad, why in ((tmp_path / "afile" / "sub", "is a file"), ("/proc/minpro_export", "")):
    assert export.main(["--workdir", workdir, "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out: {bad} cannot be created (") and why in err and err.count("\n") == 1, err
  # a damaged config.json names the file
  bad = tmp_path / "bad"
  bad.mkdir()
  for text in ("{", "[1, 2]", '{"model": {}}'):
    (bad / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"--workdir: .*config.json does not hold a run's config"):
      run_load.load_run_config(str(bad))
  # the command line: one line, exit status 2
  assert export.main(["--workdir", workdir, "--which", "3", "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --which=3: no run checkpoint") and err.count("\n") == 1


def test_a_config_of_another_model_size_is_one_line(run_dir, tmp_path, capsys):
  """evaluate / export of a workdir whose config.json describes another model size: one error line naming the
  parameter and both shapes, before orbax restores (whose failed restore left asyncio tracebacks at exit, and whose
  partial restore of a run checkpoint read the stored shapes into the wrong model)."""
  import subprocess
  import sys

  from minpro_jax import evaluate

  workdir = str(tmp_path / "run")
  shutil.copytree(run_dir[0], workdir)
  cfg = json.load(open(os.path.join(workdir, "config.json")))
  cfg["model"]["overrides"]["hidden_size"] *= 2
  json.dump(cfg, open(os.path.join(workdir, "config.json"), "w"))
  want = "the run's config.json describes a model with"
  r = subprocess.run(
      [sys.executable, "-m", "minpro_jax.export", f"--workdir={workdir}", f"--out={tmp_path / 'hf'}"],
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert (
      r.returncode == 2 and r.stderr.startswith("error: --which=best: the checkpoint ") and want in r.stderr
  ), r.stderr
  assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
  for which in ("final", "5"):
    assert evaluate.main(["--workdir", workdir, "--which", which, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --which={which}: the checkpoint ") and " holds embed of shape (" in err, err
    assert want in err and err.count("\n") == 1, err


def test_summary_config_of_an_older_run(run_dir, tmp_path):
  """A run from before config.json existed is read from its summary.json's config."""
  workdir, _, _ = run_dir
  c = run_load.load_run_config(workdir)
  old = tmp_path / "old"
  old.mkdir()
  (old / "summary.json").write_text(json.dumps({"config": c.to_dict()}))
  got = run_load.load_run_config(str(old))
  assert got.model.overrides.num_experts == 4 and run_config.model_overrides(got) == run_config.model_overrides(c)


def test_evaluate_an_export_and_bad_flags(run_dir, tmp_path, capsys):
  from minpro_jax import evaluate

  workdir, _, _ = run_dir
  out = str(tmp_path / "hf")
  export.export(workdir, out, "best")
  small = [
      "--data.max_prompt_tokens=512",
      "--eval.num_problems=3",
      "--eval.n=2",
      "--eval.ks=1,2",
      "--sampling.max_new_tokens=4",
      "--no-progress",
  ]
  assert evaluate.main(["--hf", out, "--out", str(tmp_path / "ev"), *small]) == 0
  got = json.load(open(tmp_path / "ev" / "eval.json"))
  (bench,) = got["benchmarks"]
  assert got["benchmarks"][bench]["num_problems"] == 3 and 0.0 <= got["macro"]["pass@1"] <= 1.0
  assert got["config"]["n"] == 2 and got["config"]["max_new_tokens"] == 4
  capsys.readouterr()
  fewer = [a if not a.startswith("--eval.num_problems") else "--eval.num_problems=2" for a in small]
  assert evaluate.main(["--hf", out, "--out", str(tmp_path / "ev"), *fewer]) == 2  # its tables are of 3 problems
  assert "holds tables evaluated with other settings {'num_problems': (3, 2)}" in capsys.readouterr().err
  (tmp_path / "afile").write_text("x")
  for argv, want in (
      (["--hf", out], "error: --out: give the folder"),
      (["--hf", out, "--out", str(tmp_path / "o"), "--which", "final"], "error: --which: chooses a checkpoint"),
      (["--workdir", workdir, "--out", str(tmp_path / "afile")], "error: --out: "),
      (["--workdir", workdir, "--eval.n=0"], "error: config.eval.n: must be >= 1"),
      (["--workdir", workdir, "--eval.n=2", "--eval.ks=3"], "error: config.eval.ks: every k must lie in [1, eval.n=2]"),
      (
          ["--workdir", workdir, "--eval.path=x=nosuch:/etc/hosts"],
          "error: config.eval.path: x=nosuch:/etc/hosts: unknown",
      ),
      (["--workdir", workdir, "--eval.path=/tmp/a.jsonl"], "error: config.eval.path: cannot parse an item"),
      (["--workdir", workdir, "--model.preset=qwen3_8b"], "error: --model.preset: cannot be set when evaluating"),
      (["--workdir", workdir, "--eval.n=two"], "error: --eval.n='two': not an int"),
      (["--workdir", workdir, "--eval.nn=2"], "error: --eval.nn: no such config field"),
      (["--workdir", workdir, "stray"], "error: stray: give fields as --FIELD=VALUE"),
      (["--workdir", workdir, "--mesh.shape=data=3"], "error: --mesh.shape='data=3': mesh shape {'data': 3"),
      (["--workdir", workdir, "--mesh.shape=data"], "error: config.mesh.shape: cannot parse 'data'"),
  ):
    assert evaluate.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith(want) and err.count("\n") == 1, (argv, err)


def test_a_checkpoint_reads_back_sharded_on_a_mesh(run_dir):
  """`load_run(mesh=...)` (a multi-host `evaluate`) reads each checkpoint onto the mesh, sharded by the default rules,
  with the parameters of the one-device read bit for bit."""
  from minpro_jax.runtime.sharding import make_mesh

  workdir, _, _ = run_dir
  mesh = make_mesh({"data": 2, "fsdp": 4})
  for which in ("best", "final"):
    one = nnx.state(run_load.load_run(workdir, which).model, nnx.Param)
    on_mesh = nnx.state(run_load.load_run(workdir, which, mesh=mesh).model, nnx.Param)
    leaves = jax.tree.leaves(on_mesh)
    assert all(x.sharding.mesh == mesh for x in leaves)
    assert any(not x.sharding.is_fully_replicated for x in leaves)
    for a, b in zip(jax.tree.leaves(one), leaves):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a process start and a model load: ~30 s at load 10
def test_evaluate_stopped_by_sigterm_says_what_is_kept(run_dir, tmp_path):
  import signal
  import subprocess
  import sys

  from train_helpers import cli_env

  workdir, _, _ = run_dir
  cmd = [sys.executable, "-m", "minpro_jax.evaluate", "--workdir", workdir, "--out", str(tmp_path / "ev")]
  cmd += ["--data.max_prompt_tokens=512", "--eval.num_problems=3", "--eval.n=2", "--eval.ks=1,2"]
  p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=cli_env())
  seen = ""
  while "batch" not in seen:  # the progress bar: the model is loaded and sampling
    seen += p.stderr.read(1) or pytest.fail(f"ended before sampling: {seen[-2000:]}")
  p.send_signal(signal.SIGTERM)
  err = seen + p.communicate(timeout=120)[1]
  assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
  assert "stopped by signal 15: the finished benchmarks are kept; re-run the same command to go on" in err
  assert "Traceback" not in err
