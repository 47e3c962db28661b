"""Math-Verify's equivalence cases run through this project's grader, ``minpro_jax.data.rewards.math_reward``.

Two tables. First, upstream's own: every (gold, pred, expected) row of huggingface/Math-Verify ``tests/test_all.py``
(171 rows, tests/fixtures/math_verify_test_all.json, at the end of this file), each with this grader's verdict and,
where the two differ, the reason. Second, our own table in the categories of the same file (numbers, fractions and decimals, roots,
symbolic expressions, sets / tuples / intervals, matrices, equations and inequalities, percent, units, thousands
separators, choices). The upstream file is not shipped in the math-verify wheel, so the table below is our own
(gold, prediction) pairs in those categories; its ``math_verify`` column is re-checked here against the installed
math-verify 0.9.0 (``verify(parse(gold), parse(prediction))``), so the table cannot drift from the peer silently.

Each row: (gold LaTeX without ``$``, model response, math-verify's verdict, this project's verdict). The rows where
the two differ are the ones the grader treats differently by design, listed in ``BY_DESIGN`` with the reason
(each reason names its rule in the rewards module docstring / docs/data.md).
"""

import pytest
from math_verify import parse, verify

from minpro_jax.data.rewards import math_reward

CASES = [
    ("1/2", "\\boxed{0.5}", 1, 1),
    ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 1, 1),
    ("3", "\\boxed{3.0}", 1, 1),
    ("-3", "\\boxed{3}", 0, 0),
    ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}", 1, 1),
    ("\\pi", "\\boxed{3.14159}", 0, 0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1, 1),
    ("2x", "\\boxed{x+x}", 1, 1),
    ("\\{1,2,3\\}", "\\boxed{\\{3,2,1\\}}", 1, 1),
    ("\\{1,2\\}", "\\boxed{\\{1,2,3\\}}", 0, 0),
    ("(1,2)", "\\boxed{(1,2)}", 1, 1),
    ("(1,2)", "\\boxed{(2,1)}", 0, 0),
    ("[0,1]", "\\boxed{[0,1]}", 1, 1),
    ("(0,1)", "\\boxed{[0,1]}", 0, 0),
    ("50\\%", "\\boxed{50}", 1, 1),
    ("50\\%", "\\boxed{0.5}", 1, 1),
    ("x=2", "\\boxed{2}", 1, 1),
    ("2", "\\boxed{x=2}", 1, 1),
    ("1000", "\\boxed{1,000}", 1, 1),
    ("1000", "\\boxed{1\\,000}", 0, 1),
    ("10^3", "\\boxed{1000}", 1, 1),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{1}{2}\\sqrt{3}}", 1, 1),
    ("e^{i\\pi}", "\\boxed{-1}", 0, 0),
    ("\\ln e", "\\boxed{1}", 1, 1),
    ("\\sin^2 x + \\cos^2 x", "\\boxed{1}", 1, 1),
    ("0.333", "\\boxed{\\frac{1}{3}}", 0, 0),
    ("0.3333333", "\\boxed{\\frac{1}{3}}", 1, 1),
    ("\\frac{1}{3}", "\\boxed{0.333333}", 1, 1),
    ("1/2^{99}", "\\boxed{1/2^{98}}", 1, 0),
    ("\\infty", "\\boxed{\\infty}", 1, 1),
    ("-\\infty", "\\boxed{\\infty}", 0, 0),
    ("\\emptyset", "\\boxed{\\emptyset}", 1, 1),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", 1, 1),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\boxed{\\begin{pmatrix}2\\\\1\\end{pmatrix}}", 0, 0),
    ("a+b", "\\boxed{b+a}", 1, 1),
    ("\\frac{a}{b}", "\\boxed{a/b}", 1, 1),
    ("y=2x+1", "\\boxed{y=1+2x}", 1, 1),
    ("x \\le 3", "\\boxed{x \\leq 3}", 1, 1),
    ("x<3", "\\boxed{3>x}", 1, 1),
    ("\\text{(A)}", "\\boxed{A}", 1, 1),
    ("A", "\\boxed{\\text{A}}", 1, 1),
    ("10", "\\boxed{10 \\text{ meters}}", 1, 1),
    ("45^\\circ", "\\boxed{45}", 1, 1),
    ("\\frac{\\pi}{4}", "\\boxed{45^\\circ}", 0, 0),
    ("2,3", "\\boxed{3,2}", 1, 1),
    ("1, 2, 3", "\\boxed{1, 2}", 0, 0),
    ("\\dfrac{5}{6}", "\\boxed{\\frac56}", 1, 1),
    ("5/6", "\\boxed{\\frac{5}{6}}", 1, 1),
    ("1.5", "\\boxed{\\frac{3}{2}}", 1, 1),
    ("0,125", "\\boxed{125}", 0, 0),
    ("125", "\\boxed{0,125}", 0, 0),
    ("1.25", "\\boxed{1.250}", 1, 1),
    ("12", "\\boxed{012}", 1, 1),
    ("2^{10}", "\\boxed{1024}", 1, 1),
    ("\\binom{5}{2}", "\\boxed{10}", 1, 1),
    ("5!", "\\boxed{120}", 1, 1),
    ("|{-3}|", "\\boxed{3}", 1, 1),
    ("i", "\\boxed{\\sqrt{-1}}", 0, 0),
    ("\\sqrt{2}/2", "\\boxed{1/\\sqrt{2}}", 1, 1),
    ("3\\sqrt{3}", "\\boxed{\\sqrt{27}}", 1, 1),
    ("x \\in (1,2)", "\\boxed{(1,2)}", 1, 1),
    ("\\{-1, 1\\}", "\\boxed{\\pm 1}", 1, 1),
    ("20\\%", "\\boxed{20}", 1, 1),
    ("\\$5", "\\boxed{5}", 1, 1),
    ("\\frac{7}{2}", "\\boxed{3\\frac{1}{2}}", 1, 1),
    ("1e3", "\\boxed{1000}", 0, 0),
    ("0.1", "\\boxed{\\frac{1}{10}}", 1, 1),
    ("\\log_2 8", "\\boxed{3}", 1, 1),
    ("30", "\\boxed{30°}", 0, 1),
    ("2\\sqrt{3}", "\\boxed{2\\sqrt3\\text{ cm}^2}", 1, 1),
    ("12", "\\boxed{12 \\text{ ft}}", 1, 1),
    ("(2,\\infty)", "\\boxed{(2, \\infty)}", 1, 1),
    ("25\\%", "\\boxed{25}", 1, 1),
    ("\\frac{3}{4}", "\\boxed{\\tfrac34}", 1, 1),
]

BY_DESIGN = {
    # (gold, prediction): why this project's verdict differs from math-verify's
    ("1000", "\\boxed{1\\,000}"): "a thin space inside digits is a thousands separator (rewards: normalisation, B17)",
    ("1/2^{99}", "\\boxed{1/2^{98}}"): "exact rationals compare exactly, never to 6 decimals (B21)",
    ("30", "\\boxed{30°}"): "a unicode degree sign is a unit, as ^\\circ is (B40's recommended verdict)",
}


def _mv(gold: str, pred: str) -> int:
  return int(verify(parse(f"${gold}$"), parse(pred)))


@pytest.mark.parametrize("gold,pred,mv,ours", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_math_verify_case(gold, pred, mv, ours):
  assert _mv(gold, pred) == mv, "the table's math-verify column is out of date"
  assert math_reward(pred, gold) == float(ours)
  assert (mv != ours) == ((gold, pred) in BY_DESIGN)


def test_by_design_list_is_exact():
  differing = {(g, p) for g, p, mv, ours in CASES if mv != ours}
  assert differing == set(BY_DESIGN)
  agree = sum(mv == ours for _, _, mv, ours in CASES)
  assert (agree, len(CASES)) == (71, 74)


# ------------------------------------------------------------------ upstream's own table (tests/fixtures)
# Every (gold, pred, expected) row of the parametrized tables of huggingface/Math-Verify tests/test_all.py (MIT),
# transcribed into tests/fixtures/math_verify_test_all.json with this grader's verdict. Upstream passes bare answers
# and prose as predictions and extracts from anywhere in them; a response graded here carries its final answer in
# a box or after a final-answer phrase, and the text is never searched for the gold (case B19). So each row is one of:
UPSTREAM_CATEGORIES = {
    "agree": "the same verdict on the prediction as written",
    "bare_answer": "a bare answer with no final-answer marker: 0 here by design (B19); boxed, the same verdict",
    "prose": "the answer stands inside prose without a box or final-answer phrase: 0 here by design (B19)",
    "locale_number": "'1 000', '1000,99', '1,22', '2,74': a space or a decimal comma never joins digits into one "
    "number here, since '3,5' is as often a list (B17)",
}


def _upstream_rows():
  import json
  import os

  with open(os.path.join(os.path.dirname(__file__), "fixtures", "math_verify_test_all.json")) as f:
    return json.load(f)["rows"]


def test_math_verify_upstream_table_every_row_has_its_verdict_and_reason():
  rows = _upstream_rows()
  assert len(rows) == 171 and set(r["category"] for r in rows) == set(UPSTREAM_CATEGORIES)
  wrong = []
  for r in rows:
    ours = int(math_reward(r["pred"], r["gold"], mode="math") >= 1.0)
    boxed = int(math_reward("\\boxed{" + r["pred"] + "}", r["gold"], mode="math") >= 1.0)
    ok = {
        "agree": ours == r["math_verify"],
        "bare_answer": ours == 0 and "\\boxed" not in r["pred"] and boxed == r["math_verify"] == 1,
        "prose": ours == 0 and r["math_verify"] == 1 and r["pred"].count("\\boxed") != 1,
        "locale_number": ours == 0 and r["math_verify"] == 1 and r["source_test"] == "test_number_extraction",
    }[r["category"]]
    if not ok or ours != r["ours"]:
      wrong.append((r["category"], r["gold"][:60], r["pred"][:60], r["math_verify"], ours))
  assert not wrong, wrong
  counts = {c: sum(r["category"] == c for r in rows) for c in UPSTREAM_CATEGORIES}
  assert counts == {"agree": 82, "bare_answer": 65, "prose": 20, "locale_number": 4}
