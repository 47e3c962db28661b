"""Math-Verify's equivalence cases run through this project's grader, ``minpro_jax.data.rewards.math_reward``.

Source: the categories of huggingface/Math-Verify ``tests/test_all.py`` (numbers, fractions and decimals, roots,
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
