"""Property checks of the in-process numeric rules against Python's exact Fraction arithmetic.

These exercise ``compare`` without sympy (the fast path decides every numeric literal), so they
run in milliseconds; the oracle is ``fractions.Fraction`` equality, written here.
"""
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from ctopd_jax.grading import normalize_answer
from ctopd_jax.grading.equivalence import compare

ints = st.integers(min_value=-10**6, max_value=10**6)
dens = st.integers(min_value=1, max_value=10**4)


def _latex_fraction(num: int, den: int) -> str:
    sign = "-" if num < 0 else ""
    return f"{sign}\\frac{{{abs(num)}}}{{{den}}}"


def _verdict(pred: str, gold: str) -> bool | None:
    return compare(normalize_answer(pred), normalize_answer(gold))


@settings(max_examples=300, deadline=None)
@given(ints, dens, ints, dens)
def test_fraction_pairs_agree_with_exact_arithmetic(a, b, c, d):
    x, y = Fraction(a, b), Fraction(c, d)
    # SPEC §10 rule as documented in grading/numeric.py: exact, or (not both integers and)
    # within 1e-6 relative to max(1, |reference|).
    both_int = x.denominator == 1 and y.denominator == 1
    expected = x == y or (not both_int and abs(x - y) <= Fraction(1, 10**6) * max(1, abs(y)))
    assert _verdict(_latex_fraction(a, b), f"{c}/{d}") is expected


@settings(max_examples=300, deadline=None)
@given(ints, st.integers(min_value=0, max_value=6))
def test_terminating_decimals_equal_their_fraction(n, places):
    value = Fraction(n, 10**places)
    decimal = f"{value.numerator / value.denominator:.{places}f}" if places else str(n)
    assert Fraction(decimal) == value  # the oracle's own sanity
    assert _verdict(decimal, _latex_fraction(value.numerator, value.denominator)) is True


@settings(max_examples=300, deadline=None)
@given(ints, ints)
def test_distinct_integers_never_match(a, b):
    assert _verdict(str(a), str(b)) is (a == b)
    assert _verdict(f"{a:,}", str(b)) is (a == b)  # thousands separators
