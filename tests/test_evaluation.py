"""pass@k (B22), avg@n, maj@k against hand-computed values; evaluate() end to end with a scripted generate_fn."""

import json
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minpro_jax.data import MathProblem
from minpro_jax.run.heldout import avg_at_n, evaluate, maj_at_k, pass_at_k, score_samples, to_markdown


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 2, 0.7),
        (4, 1, 4, 1.0),
        (10, 3, 1, 0.3),
        (10, 3, 5, 0.916667),
        (4, 1, 1, 0.25),
        (10, 0, 3, 0.0),
        (10, 10, 3, 1.0),
    ],
)
def test_b22_pass_at_k_values(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-6)


def test_b22_k_greater_than_n_rejected_never_one():
  with pytest.raises(ValueError, match="n=2"):
    pass_at_k(2, 0, 5)
  with pytest.raises(ValueError):
    pass_at_k(3, 4, 1)
  # with-replacement bootstrap best@4 for 1 of 4 correct is 1-(3/4)^4 = 0.68359; pass@4 is exactly 1.0
  assert 1 - (3 / 4) ** 4 == pytest.approx(0.68359, abs=1e-5)
  assert pass_at_k(4, 1, 4) == 1.0
  assert avg_at_n([1, 0, 0, 0]) == 0.25 == pass_at_k(4, 1, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_binomial_formula(nck):
  n, c, k = nck
  assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_maj_at_k():
  answers = ["5", "\\frac{1}{2}", "5", None, "7"]
  correct = [0, 1, 0, 0, 0]
  assert maj_at_k(answers, correct, 5) == 0.0  # "5" wins 2 votes to 1
  assert maj_at_k(answers, correct, 2) == 0.0  # tie 1-1: first seen ("5") wins
  assert maj_at_k(["8,000", "8000", "3"], [1, 1, 0], 3) == 1.0  # normalised answers pool their votes
  assert maj_at_k([None, None], [0, 0], 2) == 0.0
  with pytest.raises(ValueError, match="maj@3"):
    maj_at_k(["1"], [1], 3)


def test_score_samples_omits_k_above_n():
  s = score_samples([[1, 0, 0, 0], [1, 1, 1, 1]], None, ks=(1, 4, 8))
  assert s["avg@4"] == pytest.approx((0.25 + 1.0) / 2)
  assert s["pass@k"] == {"1": pytest.approx(0.625), "4": 1.0}
  assert s["omitted_k"] == [8]


def test_evaluate_end_to_end(tmp_path):
  a = [MathProblem(id=f"a{i}", prompt=f"What is {i}+{i}?", answer=str(2 * i), source="a") for i in range(3)]
  b = [MathProblem(id="b0", prompt="What is half of 1?", answer="\\frac{1}{2}", source="b")]
  calls = []

  def generate_fn(prompts, n, seed):
    calls.append((tuple(prompts), n, seed))
    out = []
    for p in prompts:
      if "half" in p:
        out.append(["\\boxed{0.5}", "\\boxed{1}", "\\boxed{0.5}", "no idea"])
      else:
        i = int(p.split("What is ")[1].split("+")[0])
        # problem i: the first i samples are correct
        out.append([f"\\boxed{{{2 * i}}}" if s < i else "\\boxed{-1}" for s in range(n)])
    return out

  res = evaluate(
      generate_fn, {"arith": a, "half": b}, n=4, ks=(1, 2, 8), batch_size=2, seed=5, out_dir=str(tmp_path), name="t"
  )
  assert [c[2] for c in calls] == [5, 6, 5 + 1000003]  # arith in 2 batches, then half
  assert calls[0][0][0] == "Question: What is 0+0?\nAnswer:"
  ar, hf = res["benchmarks"]["arith"], res["benchmarks"]["half"]
  assert ar["avg@4"] == pytest.approx((0 + 1 + 2) / 12)
  assert ar["pass@k"]["1"] == pytest.approx((0 + 0.25 + 0.5) / 3)
  assert ar["pass@k"]["2"] == pytest.approx((0 + 0.5 + (1 - 1 / 6)) / 3)
  assert ar["maj@k"]["1"] == pytest.approx(2 / 3) and ar["omitted_k"] == [8]
  assert ar["maj@k"]["2"] == pytest.approx(2 / 3)  # p1 ties 1-1 and its first (correct) answer wins
  assert hf["avg@4"] == 0.5 and hf["pass@k"]["2"] == pytest.approx(1 - 1 / 6) and hf["maj@k"]["2"] == 1.0
  assert hf["grading"]["no_answer"] == 1 and ar["grading"]["graded"] == 12
  assert res["macro"]["avg@4"] == pytest.approx((ar["avg@4"] + 0.5) / 2)
  saved = json.loads((tmp_path / "t.json").read_text())
  assert saved["macro"] == pytest.approx(res["macro"])
  md = (tmp_path / "t.md").read_text()
  assert md == to_markdown(res)
  assert md.splitlines()[0] == "| benchmark | problems | avg@4 | pass@1 | pass@2 | maj@1 | maj@2 |"
  assert "| half | 1 | 50.0 | 50.0 | 83.3 | 100.0 | 100.0 |" in md and "**macro avg**" in md


def test_evaluate_rejects_bad_generate_fn():
  p = [MathProblem(id="x", prompt="q", answer="1", source="s")]
  with pytest.raises(ValueError, match="generate_fn returned"):
    evaluate(lambda prompts, n, seed: [["\\boxed{1}"]], {"s": p}, n=2)
  with pytest.raises(ValueError, match="no problems"):
    evaluate(lambda prompts, n, seed: [], {"s": []}, n=1)
