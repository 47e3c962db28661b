"""The Tier B gradient-fidelity study (minpro_jax/study/fidelity_model.py) end to end at a toy size: it writes one
record per drift, on-policy every token-mean method has the same gradient, a rerun skips finished cells and reuses
the trajectory, and the report regenerates from the records."""

import json
import os

import numpy as np
import pytest
from test_mismatch_every import _coin_grade
from train_helpers import tiny_overrides

from minpro_jax.study import fidelity_model as fm
from minpro_jax.study import fidelity_model_report as fmr
from minpro_jax.study import fidelity_toy as ft

PLAN = fm.Plan(
    updates=4, drifts=("s0", "s2", "s4", "fp8"), prompts=2, batches=3, truth_prompts=4, chunk_prompts=2, seed=0
)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("fidelity_model")
  ov = {k: v for k, v in tiny_overrides(tmp).items() if k != "workdir"}
  out = str(tmp / "out")
  with pytest.MonkeyPatch.context() as mp:  # mixed rewards for the tiny model: nonzero advantages and truth
    mp.setattr("minpro_jax.trainer.grade_split", _coin_grade)
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
      assert len(v["weight_mean"]) == len(fm.POSITIONS)
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


def test_rerun_skips_finished_cells_and_reuses_the_trajectory(study, capsys, monkeypatch):
  out, ov = study
  monkeypatch.setattr("minpro_jax.trainer.grade_split", _coin_grade)
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
  assert fm.run(out, PLAN, ov) == 0
  assert "nothing to do" in capsys.readouterr().out


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


def test_bad_flags_exit_2(capsys):
  assert fm.main(["--drifts=x8"]) == 2
  assert fm.main(["--truth-prompts=10", "--chunk-prompts=4"]) == 2
  assert "error:" in capsys.readouterr().err
