"""The Tier B gradient-fidelity study (minpro_jax/lab/fidelity_model.py) end to end at a toy size: it writes one
record per drift, on-policy every token-mean method has the same gradient, a rerun skips finished cells and reuses
the trajectory, a run killed in the truth or in a cell resumes to the same record, and the report regenerates from
the records, alone and side by side with another study."""

import functools
import json
import os
import tempfile

import numpy as np
import pytest
from train_helpers import coin_grade, kill_at_call, tiny_overrides

from minpro_jax.lab import fidelity_model as fm
from minpro_jax.lab import fidelity_model_report as fmr
from minpro_jax.lab import fidelity_toy as ft

PLAN = fm.Plan(
    updates=4, drifts=("s0", "s2", "s4", "fp8"), prompts=2, batches=3, truth_prompts=4, chunk_prompts=2, seed=0
)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("fidelity_model")
  ov = {k: v for k, v in tiny_overrides(tmp).items() if k != "workdir"}
  out = str(tmp / "out")
  with pytest.MonkeyPatch.context() as mp:  # mixed rewards for the tiny model: nonzero advantages and truth
    mp.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
    assert fm.run(out, PLAN, ov) == 0
    yield out, ov


def test_records_and_on_policy_agreement(study):
  out, _ = study
  cells = fmr.load(out)
  assert [r["drift"] for r in cells] == ["s0", "s2", "s4", "fp8"]
  for r in cells:
    assert set(r["methods"]) == set(ft.METHOD_NAMES)
    assert r["batches"] == 3 and r["num"] == 2 * 2
    for v in r["methods"].values():
      assert len(v["weight_mean"]) == len(r["positions"]) == len(fm.positions(r["max_new_tokens"]))
      assert all(e is None or 0.0 <= e <= 1.0 + 1e-9 for e in v["ess"])
  s0 = cells[0]["methods"]
  # on-policy (fp32 sampler, pi = mu) every ratio is 1 up to the sampler's numerics: the token-mean methods' and
  # the sequence-IS reference's estimates coincide (the projection is the same number per batch)
  ref = s0["cispo"]["projection"]
  assert ref is not None and ref != 0
  for m in ("minpro:min", "minpro:mean", "minpro:prod", "grpo", "m2po", "seq_is"):
    np.testing.assert_allclose(s0[m]["projection"], ref, rtol=1e-3, err_msg=m)
  # stale: the sequence log-ratio spreads, on-policy it is ~0
  assert abs(cells[0]["log_ratio_seq_sd"]) < 1e-3 < min(cells[2]["log_ratio_seq_sd"], cells[3]["log_ratio_seq_sd"])
  assert cells[0]["truth_samples_per_half"] == 4 * 2
  # issue 55: the intervals resample the truth's chunks too; the weights split by the response's reward
  assert all(set(r["truth_undefined"]) == {"euclid", "adam"} and "truth's chunks" in r["interval"] for r in cells)
  s2 = cells[2]["methods"]
  assert 0.0 < cells[2]["rewarded_token_share"] < 1.0 and s2["grpo"]["weight_rewarded"] > 0  # coin-flip rewards
  for m in ("cispo", "minpro:min"):  # clipped at 1 + eps_high = 1.28
    assert 0.0 < s2[m]["weight_unrewarded"] <= 1.28 + 1e-6 and 0.0 <= s2[m]["weight_rewarded"] <= 1.28 + 1e-6


def test_rerun_skips_finished_cells_and_reuses_the_trajectory(study, capsys, monkeypatch, tmp_path):
  out, ov = study
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's trainers get their workdirs
  before = {f: os.path.getmtime(os.path.join(out, f)) for f in ("s0.json", "s4.json", "fp8.json")}
  kept = json.load(open(os.path.join(out, "s0.json")))
  os.remove(os.path.join(out, "s2.json"))
  capsys.readouterr()
  assert fm.run(out, PLAN, ov) == 0
  log = capsys.readouterr().out
  assert "trajectory:" not in log and "truth half" not in log and log.count("eta min") == 1
  assert {f: os.path.getmtime(os.path.join(out, f)) for f in before} == before
  assert json.load(open(os.path.join(out, "s0.json"))) == kept
  assert os.path.exists(os.path.join(out, "s2.json"))
  assert os.listdir(tmp_path) == []  # the trainers' workdirs are removed
  assert fm.run(out, PLAN, ov) == 0
  assert "nothing to do" in capsys.readouterr().out


@pytest.mark.slow  # three runs of the study (~4x the rerun test)
def test_a_killed_run_resumes_in_the_truth_and_in_a_cell(study, capsys, monkeypatch):
  out, ov = study
  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  kept = json.load(open(os.path.join(out, "s4.json")))
  os.remove(os.path.join(out, "s4.json"))
  os.remove(os.path.join(out, "trajectory", "truth.npz"))
  real_draw, calls = fm.draw, []
  draw_until = functools.partial(kill_at_call, real_draw, calls=calls)

  chunks = 2 * PLAN.truth_prompts // PLAN.chunk_prompts  # 4 truth chunks, then the cell's 3 batches
  monkeypatch.setattr(fm, "draw", draw_until(2))  # killed in the truth's second chunk
  with pytest.raises(RuntimeError, match="killed"):
    fm.run(out, PLAN, ov)
  assert os.path.exists(os.path.join(out, "trajectory", "truth.partial.npz"))
  calls.clear()
  monkeypatch.setattr(fm, "draw", draw_until(chunks - 1 + 3))  # the truth's last 3 chunks, 2 batches, killed
  capsys.readouterr()
  with pytest.raises(RuntimeError, match="killed"):
    fm.run(out, PLAN, ov)
  assert "truth: resuming after chunk 1 of 4" in capsys.readouterr().out
  assert not os.path.exists(os.path.join(out, "trajectory", "truth.partial.npz"))
  calls.clear()
  monkeypatch.setattr(fm, "draw", draw_until(0))  # never killed
  assert fm.run(out, PLAN, ov) == 0
  log = capsys.readouterr().out
  assert "s4: resuming after batch 2/3" in log and len(calls) == 1  # only the last batch was drawn again
  assert not os.path.exists(os.path.join(out, "trajectory", "s4.partial.npz"))
  got = json.load(open(os.path.join(out, "s4.json")))
  for k in ("seconds", "date"):
    got.pop(k), kept.pop(k)
  assert got.keys() == kept.keys() and got["methods"].keys() == kept["methods"].keys()
  for m, v in kept["methods"].items():
    for key, x in v.items():
      np.testing.assert_allclose(
          np.asarray(got["methods"][m][key], float), np.asarray(x, float), rtol=1e-9, err_msg=key
      )
  assert {k: v for k, v in got.items() if k != "methods"} == {k: v for k, v in kept.items() if k != "methods"}
  with pytest.raises(ValueError, match="made with the plan"):  # a partial file of another plan is refused
    fm._save_partial(os.path.join(out, "trajectory", "s4.partial.npz"), key="{}", done=1)
    fm._load_partial(os.path.join(out, "trajectory", "s4.partial.npz"), fm._partial_key(PLAN, "prompts"))
  os.remove(os.path.join(out, "trajectory", "s4.partial.npz"))


def test_positions_and_settings():
  assert fm.positions(16) == tuple(range(8)) and fm.positions(5) == tuple(range(5))
  assert fm.positions(128) == (0, 1, 3, 7, 15, 31, 63, 127) and fm.positions(100) == (0, 1, 3, 7, 15, 31, 63)
  assert fm.setting_overrides("short") == {}
  worked = fm.setting_overrides("worked")
  assert (worked["sft.target"], worked["sampling.max_new_tokens"], worked["data.task_config.max_terms"]) == (
      "worked",
      128,
      8,
  )
  assert worked["optimizer.learning_rate"] == 3e-5  # minpro_long.LEARNING_RATE, chosen by its stage 0
  with pytest.raises(ValueError, match="choose one of"):
    fm.setting_overrides("long")
  assert fmr.block_of("results/fidelity_model") == "tier-b" and fmr.block_of("results/fidelity_model_worked/") == (
      "tier-b-worked"
  )


def test_report_regenerates_tables(study, tmp_path):
  out, _ = study
  doc = tmp_path / "mechanism.md"
  doc.write_text(f"intro\n{fmr.BEGIN}\nold\n{fmr.END}\nrest\n")
  assert fmr.report(out, str(doc)) == 0
  text = doc.read_text()
  assert "old" not in text and "| minpro:min |" in text and text.endswith(f"{fmr.END}\nrest\n")
  assert os.path.exists(os.path.join(out, "summary.md")) and os.path.exists(os.path.join(out, "eta_by_drift.png"))
  with pytest.raises(SystemExit, match="no finished cells"):
    fmr.report(str(tmp_path / "empty"), str(doc))
  doc.write_text(f"a\n{fmr.BEGIN}\n{fmr.END}\n<!-- tier-b-worked:begin (cmd) -->\nold\n<!-- tier-b-worked:end -->\n")
  assert fmr.report(out, str(doc), block="tier-b-worked") == 0
  text = doc.read_text()
  assert "old" not in text and text.index("tier-b-worked:begin") < text.index("| minpro:min |")


def test_compare_puts_studies_side_by_side(study, tmp_path, capsys):
  out, _ = study
  other = tmp_path / "other"
  other.mkdir()
  s8 = json.load(open(os.path.join(out, "s2.json")))
  s8.update(drift="s8", seed=7)
  s8["methods"]["minpro:min"].update(eta=0.5, eta_diff_low=0.01, eta_diff_high=0.2)
  s8["methods"]["minpro:prod"]["eta"] = 0.25
  s8["methods"]["cispo"].update(eta=0.375, eta_low=0.25, eta_high=None)
  (other / "s8.json").write_text(json.dumps(s8))
  doc = tmp_path / "mechanism.md"
  doc.write_text(f"x\n<!-- {fmr.COMPARE}:begin (cmd) -->\n<!-- {fmr.COMPARE}:end -->\n")
  assert fmr.compare_report({"A": out, "B": str(other)}, str(doc)) == 0
  text = doc.read_text()
  assert "| s0 | s2 | s4 | s8 | fp8 |" in text and "| B (seed 7, 3 x 4" in text
  row = [line for line in text.splitlines() if line.startswith("|  | eta(min) - eta(none)")][-1]  # B's
  assert row.split("|")[-2].strip() == "—" and "+0.12 [+0.01, +0.2]" in row  # B has s8 only; 0.5 - 0.375
  assert any("+0.25" in line and "eta(min) - eta(prod)" in line for line in text.splitlines())
  b_first = next(line for line in text.splitlines() if line.startswith("| B (seed 7, 3 x 4, T "))
  assert b_first.endswith(") | eta(none = cispo) | — | — | — | 0.375 | — |")  # no interval: eta only
  assert fm.main(["--report", "--compare=A"]) == 2


def test_bad_flags_exit_2(capsys):
  assert fm.main(["--drifts=x8"]) == 2
  assert fm.main(["--truth-prompts=10", "--chunk-prompts=4"]) == 2
  assert "error:" in capsys.readouterr().err
