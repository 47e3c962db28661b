"""Short end-to-end run of the default config (reduced sizes): outputs, counters, SFT cache reuse; SmolLM2 one step."""

import json
import os

import pytest
from train_helpers import REPO, make_config, tiny_overrides

from minpro_jax.errors import ConfigError


def test_default_config_end_to_end(tmp_path, monkeypatch):
  from minpro_jax.run.trainer import Trainer

  ov = tiny_overrides(
      tmp_path,
      total_steps=4,
      delay=1,
      num_updates_per_step=2,
      **{"eval.every": 2, "checkpoint.every": 2, "log.plots": True, "log.tensorboard": True},
  )
  tr = Trainer.from_config(make_config(ov))
  assert tr.sft_info["enabled"] and tr.sft_info["cached"] is False
  summary = tr.run()
  run = tmp_path / "run"
  for name in ("summary.json", "metrics.jsonl", "reward.png", "staleness.png"):
    assert (run / name).is_file() and (run / name).stat().st_size > 0, name
  assert os.listdir(run / "eval"), "no evaluation files"
  assert any(f.startswith("step_000000_initial") for f in os.listdir(run / "eval"))
  assert any(f.startswith("final") for f in os.listdir(run / "eval"))
  assert tr.ckpt.best_step() is not None and os.listdir(run / "best")
  assert tr.ckpt.latest_step() == 3
  # delay 1: no update in step 0, then 2 updates in each of steps 1..3
  assert summary["policy_version"] == (4 - 1) * 2
  on_disk = json.loads((run / "summary.json").read_text())
  assert on_disk["policy_version"] == 6 and on_disk["best"]["step"] in (0, 2, 4)
  assert set(on_disk["eval_after_sft"]) >= {"pass@1", "pass@2"} and set(on_disk["eval_final"]) >= {"pass@1"}
  recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [-1, 0, 1, 2, 3, 4]
  assert [r.get("policy_version") for r in recs[1:5]] == [0, 2, 4, 6]
  assert "eval/avg_score" in recs[2]  # periodic eval after step 2
  # "best" is the first evaluation with the highest pass@1, the one after SFT (policy step 0) included
  scores = [(r["eval/avg_score"], r["step"] + 1 if r["step"] < 4 else 4) for r in recs if "eval/avg_score" in r]
  assert [s for _, s in scores] == [0, 2, 4]
  top = max(v for v, _ in scores)
  assert on_disk["best"] == {"score": top, "step": next(s for v, s in scores if v == top)}
  assert all(r["learn/skipped_updates"] == 0 for r in recs[2:5])
  # re-running the finished run's command resumes after its last step, repeats only the final evaluation and keeps
  # the best checkpoint it already has (orbax raised StepAlreadyExistsError before)
  best_before = sorted(os.listdir(run / "best"))
  again = Trainer.from_config(make_config(ov)).run()
  assert again["policy_version"] == 6 and again["eval_final"] == on_disk["eval_final"]
  assert sorted(os.listdir(run / "best")) == best_before
  # re-running it with a smaller total_steps is refused (its final evaluation would be logged at the wrong step)
  with pytest.raises(ConfigError, match=r"config\.total_steps: the run in .* has already done 4 global steps"):
    Trainer.from_config(make_config({**ov, "total_steps": 2})).run()
  assert json.loads((run / "config.json").read_text())["total_steps"] == 4  # a refused resume writes nothing
  # the run leaves what `export` and `evaluate` read: its config and trained tokenizer; the export loads in
  # transformers; the best checkpoint, evaluated on its own, scores what the run logged for it
  _check_export(run, tmp_path / "hf")
  _check_evaluate(run, on_disk["best"])
  # continuing the finished run to 5 steps keeps its final evaluation (of policy step 4, after its last checkpoint)
  # as the evaluation of step 3's record, and that evaluation counts for "best" (it was dropped before)
  more = Trainer.from_config(make_config({**ov, "total_steps": 5})).run()
  recs5 = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs5] == [-1, 0, 1, 2, 3, 4, 5] and recs5[:4] == recs[:4]
  assert recs5[4] == {**recs[4], **{k: v for k, v in recs[5].items() if k != "step"}}
  scores5 = [(r["eval/avg_score"], min(r["step"] + 1, 5)) for r in recs5 if "eval/avg_score" in r]
  assert [s for _, s in scores5] == [0, 2, 4, 5]
  top5 = max(v for v, _ in scores5)
  assert more["best"] == {"score": top5, "step": next(s for v, s in scores5 if v == top5)}
  assert os.listdir(run / "best") == [str(more["best"]["step"])]  # the parameters of the summary's best
  # a second run with the same SFT settings reuses the cached warm start (and tokenizer)
  ov2 = dict(ov, workdir=str(tmp_path / "run2"))
  tr2 = Trainer.from_config(make_config(ov2))
  assert tr2.sft_info["cached"] is True and tr2.sft_info["path"] == tr.sft_info["path"]
  # a disk without room for the checkpoints fails before any evaluation or step, not at the first save
  import collections
  import shutil

  monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("u", "total used free")(1, 1, 0))
  with pytest.raises(OSError, match=r"config\.workdir: .*run2 has 0\.00 GB free"):
    tr2.run()
  assert not (tmp_path / "run2" / "metrics.jsonl").exists() and not (tmp_path / "run2" / "eval").exists()


def _check_export(run, out):
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from minpro_jax import export
  from minpro_jax.run import run_load

  assert (run / "config.json").is_file() and (run / "tokenizer.model").is_file()
  assert export.export(str(run), str(out), "final")["step"] == 3
  loaded = run_load.load_run(str(run), "final")
  tokens = np.array([loaded.tokenizer.encode("Compute 3 + 4.\nAnswer:")], np.int32)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert float(np.abs(np.asarray(loaded.model(jnp.asarray(tokens)).out) - ref).max()) <= 1e-4


def _check_evaluate(run, best):
  from minpro_jax import evaluate

  out = run / "eval" / "standalone" / f"best_{best['step']}"
  assert evaluate.main(["--workdir", str(run), "--no-progress"]) == 0
  got = json.loads((out / "eval.json").read_text())
  assert got["macro"]["pass@1"] == best["score"]
  logged = [json.loads(p.read_text()) for p in (run / "eval").glob("*.json")]
  logged = next(r for r in logged if r["config"]["seed"] == got["config"]["seed"])  # the run's evaluation of it
  assert got["benchmarks"] == logged["benchmarks"] and got["samples"] == logged["samples"]
  # resumable: a second call reads the benchmark's file back; other settings in the same folder are refused
  assert evaluate.main(["--workdir", str(run), "--no-progress"]) == 0
  assert evaluate.main(["--workdir", str(run), "--no-progress", "--eval.n=1", "--eval.ks=1"]) == 2
  # the final run checkpoint (step 3, after 6 updates) samples with the seed of the run's final evaluation
  assert evaluate.main(["--workdir", str(run), "--which=final", "--no-progress"]) == 0
  got = json.loads((run / "eval" / "standalone" / "final_3" / "eval.json").read_text())
  final = json.loads((run / "eval" / "final.json").read_text())
  assert got["config"]["seed"] == final["config"]["seed"] and got["samples"] == final["samples"]


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2_one_step")  # its own group: SmolLM2 weights and GB checkpoints
def test_smollm2_config_one_step(tmp_path):
  path = os.path.join(REPO, "configs", "smollm2_135m.py")
  if not os.path.exists(path):
    pytest.skip("configs/smollm2_135m.py does not exist yet")
  import importlib.util

  spec = importlib.util.spec_from_file_location("smollm2_cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.workdir = str(tmp_path / "run")
  c.total_steps = 1
  c.delay = 0
  c.eval.num_problems = 2
  c.eval.n = 1
  c.eval.ks = (1,)
  c.eval.every = 0
  c.checkpoint.every = 0
  c.checkpoint.keep = 1  # the disk check then asks for 2 run + 2 best checkpoints: about 4.3 GB
  c.log.plots = False
  c.log.progress = False
  c.log.tensorboard = False
  if "sft" in c:
    c.sft.enabled = False
  from minpro_jax.run.trainer import Trainer

  summary = Trainer.from_config(c).run()
  assert summary["policy_version"] == c.num_updates_per_step
