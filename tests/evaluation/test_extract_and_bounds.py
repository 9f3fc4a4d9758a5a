"""Answer extraction rules and the per-sample time bound of the symbolic step."""
import time

import pytest

from ctopd_jax.grading import MathGrader, extract_answer, normalize_answer
from ctopd_jax.grading.pool import SymbolicPool


@pytest.mark.parametrize("response, expected", [
    ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{4}.", "4"),  # the last box wins
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped set braces do not close the box
    ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("\\fbox{7}", "7"),
    ("the answer: $\\boxed 5$", "5"),
    ("\\boxed{3} and finally \\boxed{\\frac{1}{2", None),  # truncated last box: no answer
    ("no box here, the answer is 4", None),  # MATH rule: boxed only
    ("", None),
])
def test_boxed_extraction(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response, expected", [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("So the answer is 42 apples.", "42"),
    ("The final answer is: $\\frac{3}{4}$.", "$\\frac{3}{4}$."),
    ("The answer is 5.\n#### 6", "6"),  # '####' is tried before 'answer is'
    ("#### 6 but \\boxed{7}", "7"),  # a box always wins
    ("nothing to see", None),
])
def test_fallback_extraction(response, expected):
    assert extract_answer(response, fallbacks=True) == expected


@pytest.mark.parametrize("raw, expected", [
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\text{ 10 cm }", "10"),
    ("x = \\frac12", "\\frac{1}{2}"),
    ("5.", "5"),
    ("\\$1{,}000", "1000"),
    ("2 \\pi r", "2\\pi r"),
])
def test_normalisation(raw, expected):
    assert normalize_answer(raw) == expected


def test_fallback_answers_grade_against_gsm8k_reference():
    with MathGrader(timeout_s=5.0) as grader:
        result = grader.grade("The answer is 1,234.", "1234", fallbacks=True)
    assert result.correct and result.extracted == "1,234."


def test_pathological_power_is_killed_and_pool_recovers():
    """9^(9^9) is one CPU-bound big-integer power (~150 MB, minutes of work) inside a single
    C call: only killing the worker stops it. The pool must report a timeout and keep
    working. The elapsed bound is generous (worker start-up included); a hang never ends."""
    with SymbolicPool(workers=1, timeout_s=1.0) as pool:
        start = time.monotonic()
        outcomes = pool.run([("9^{9^{9}}", "5"), ("\\sqrt{12}", "2\\sqrt{3}")])
        elapsed = time.monotonic() - start
    assert outcomes[0] in ("timeout", "error")
    assert outcomes[1] == "equal"
    assert elapsed < 60


def test_adversarial_inputs_do_not_hang_grading():
    nested = "(" * 3000 + "x" + ")" * 3000
    tower = "10^{10^{10}}"
    long_list = ",".join(["1"] * 900)  # once overflowed the recursion of list matching
    responses = [f"\\boxed{{{tower}}}", f"\\boxed{{{nested}}}", "\\boxed{3}",
                 "x" * 200_000 + "\\boxed{" * 5000, f"\\boxed{{{long_list}}}",
                 f"\\boxed{{{long_list}}}", "\\boxed{5" + " \\, " * 400 + "}"]  # thin spaces: still 5
    golds = ["5", "y", "3", "1", "1", ",".join(["1"] * 899 + ["2"]), "5"]
    start = time.monotonic()
    with MathGrader(timeout_s=1.0, workers=2) as grader:
        results = grader.grade_many(responses, golds)
    elapsed = time.monotonic() - start
    assert [r.correct for r in results] == [False, False, True, False, False, False, True]
    assert results[0].method in ("timeout", "error")
    assert elapsed < 60
