"""A table of tricky (prediction, reference) answer pairs with verdicts decided by hand.

Each verdict is the mathematical answer to "does this prediction state the reference value",
under the harness conventions of SPEC §10 (units and presentation are not part of the value,
1e-6 numeric tolerance). They were written before running the grader, not read off it.
"""
import pytest

from ctopd_jax.grading import MathGrader

PAIRS = [
    # --- fractions and their spellings
    ("\\frac{1}{2}", "\\frac12", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("1/2", "\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    (".5", "\\frac{1}{2}", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("\\frac{1}{3}", "0.33", False),
    ("\\frac{1}{3}", "0.3333333333", True),  # within 1e-6
    ("\\frac{3}{2}", "\\frac{2}{3}", False),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
    ("\\frac{-1}{2}", "\\frac{1}{2}", False),
    ("\\left(\\frac{1}{2}\\right)", "\\frac{1}{2}", True),
    ("2\\frac{1}{2}", "\\frac{5}{2}", True),  # mixed number
    ("-1\\frac{1}{2}", "-1.5", True),
    ("2\\frac{1}{2}", "1", False),
    # --- integers, signs, separators, decimals
    ("-3", "-3", True),
    ("\u22123", "-3", True),  # unicode minus
    ("3", "-3", False),
    ("- 3", "-3", True),
    ("1,000", "1000", True),
    ("1{,}000{,}000", "1000000", True),
    ("\\$32,\\!348", "32348", True),
    ("1000001", "1000000", False),  # integers compare exactly
    ("5.0", "5", True),
    ("5.", "5", True),
    ("5.01", "5", False),
    ("0.1 + 0.2", "0.3", True),  # symbolic/numeric value
    ("10110_2", "10110_{2}", True),
    ("10110", "10110_2", True),  # "in base 2" answered without the subscript
    ("10111_2", "10110_2", False),
    # --- text, units, degrees, dollars, percent
    ("\\text{5 cm}", "5", True),
    ("10\\text{ inches}", "10", True),
    ("12 \\text{ square units}", "12", True),
    ("7 \\mbox{ cm}^2", "7", True),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    ("45\u00b0", "45", True),
    ("\\$18.90", "18.90", True),
    ("\\$18.90", "18.9", True),
    ("18", "18.90", False),
    ("50\\%", "50", True),
    ("0.5", "50\\%", True),
    ("50\\%", "0.5\\%", False),
    ("\\text{Evelyn}", "\\text{Evelyn}", True),
    ("\\text{evelyn}", "Evelyn", True),
    ("\\text{(C)}", "\\text{(C)}", True),
    ("\\text{No}", "\\text{Yes}", False),
    # --- surds and symbolic forms
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\sqrt{8}", "2\\sqrt{3}", False),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("\\sqrt{3}/2", "\\frac{\\sqrt3}{2}", True),
    ("\\frac{1}{2}\\sqrt{3}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", True),
    ("3\\sqrt{2}", "\\sqrt{18}", True),
    ("\\sqrt[3]{27}", "3", True),
    ("2+\\sqrt{5}", "\\sqrt{5}+2", True),
    ("2-\\sqrt{5}", "\\sqrt{5}-2", False),
    ("\\pi", "3.14", False),  # wrong but close
    ("3.1416", "\\pi", False),
    ("2\\pi", "\\pi\\cdot 2", True),
    ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi", True),
    ("6\\pi r", "6 r \\pi", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x^2+2x+1", "(x-1)^2", False),
    ("\\frac{x+1}{2}", "\\frac{1}{2}x+\\frac{1}{2}", True),
    ("2^{10}", "1024", True),
    ("10^{-2}", "0.01", True),
    ("1.5\\times10^{3}", "1500", True),
    ("1.5e3", "1500", True),
    ("3!", "6", True),
    ("\\infty", "\\infty", True),
    ("-\\infty", "\\infty", False),
    ("\\log_2 8", "3", True),
    ("\\log_{3}(81)", "5", False),
    ("e^{i\\pi}", "-1", True),
    ("(1+i)^2", "2i", True),
    # --- equations and assignments
    ("x = 5", "5", True),
    ("k=-2", "-2", True),
    ("y=2x+1", "2x+1", True),
    ("x=4", "5", False),
    ("x=-1 \\text{ or } x=3", "3, -1", True),
    ("x=1, y=2", "1, 2", False),  # a point is not the solution list
    # --- intervals, tuples, sets, lists
    ("[0, 1)", "[0,1)", True),
    ("(0,1)", "[0,1)", False),
    ("x \\in [2, 5)", "[2,5)", True),
    ("(0,1]", "(0,1)", False),
    ("(-\\infty, 3)", "(-\\infty,3)", True),
    ("(-\\infty,0)\\cup(1,\\infty)", "(-\\infty, 0) \\cup (1, \\infty)", True),
    ("(-\\infty,0)\\cup(2,\\infty)", "(-\\infty,0)\\cup(1,\\infty)", False),
    ("(1,2)", "(1, 2)", True),
    ("(2,1)", "(1,2)", False),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\{1,2,3\\}", "\\{3,2,1\\}", True),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("1, 2, 3", "3, 2, 1", True),
    ("1, -2", "-2, 1", True),
    ("1, 2", "1, 3", False),
    ("\\frac{1}{2}, 3", "3, 0.5", True),
    ("[0,1]", "0", False),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\3\\end{pmatrix}", False),
    # --- degenerate predictions
    ("", "5", False),
    ("5", "", False),
]


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=10.0, workers=2) as g:
        yield g


def test_table_is_large_enough():
    assert len(PAIRS) >= 60


def test_table_verdicts(grader):
    responses = [f"Work... so the answer is $\\boxed{{{pred}}}$." for pred, _, _ in PAIRS]
    results = grader.grade_many(responses, [gold for _, gold, _ in PAIRS])
    wrong = [(pred, gold, want, r.method) for (pred, gold, want), r in zip(PAIRS, results)
             if r.correct != want]
    assert not wrong, f"{len(wrong)} verdicts differ from the table: {wrong}"
