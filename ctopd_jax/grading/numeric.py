"""Exact reading of numeric literals and the numeric equality rule of SPEC §10.

Everything here runs in the grading process, so it must be cheap on any input: literals are
read as ``fractions.Fraction`` from bounded-size strings (exponents limited to |e| <= 400),
never through ``eval`` or sympy.

Forms read: integers and decimals with optional sign ("-3", "0.50", "5."), fractions
("3/4", "\\frac{3}{4}", "-\\frac{3}{4}", "\\frac{-3}{4}"), mixed numbers ("2\\frac{1}{2}" = 5/2), scientific notation ("1.5e3",
"1.5\\times10^{3}", "1.5\\cdot10^3", "10^{-2}"), and percentages ("50%").

Decision (SPEC says "numerically within 1e-6"): two numbers are equal if exactly equal, or
if not both integers and |a - b| <= 1e-6 * max(1, |gold|). Integers compare exactly, so an
off-by-one count like 1000000 vs 1000001 is wrong even though the relative gap is 1e-6.
A percentage "p%" on either side matches both p and p/100 of the other side ("50%" ≡ "50"
≡ "0.5"), since references and models disagree on whether the percent is part of the value.
"""
from __future__ import annotations

import re
from fractions import Fraction

_MAX_LITERAL_CHARS = 200
_MAX_EXPONENT = 400
TOLERANCE = 1e-6
_TOLERANCE_EXACT = Fraction(1, 10**6)

_DECIMAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"


def _decimal(text: str) -> Fraction:
    return Fraction(text.replace("+", "") if text.startswith("+") else text)


def _signed(sign: str, value: Fraction) -> Fraction:
    return -value if sign == "-" else value


def _power(m: re.Match) -> Fraction | None:
    """mantissa (default 1) times 10 to the exponent; None past the exponent bound."""
    e = int(next(g for g in m.groups()[1:] if g is not None))
    if abs(e) > _MAX_EXPONENT:
        return None
    return (_decimal(m.group(1)) if m.group(1) else Fraction(1)) * Fraction(10) ** e


def _ratio(m: re.Match) -> Fraction | None:
    den = _decimal(m.group(2))
    return None if den == 0 else _decimal(m.group(1)) / den


def _mixed(m: re.Match) -> Fraction | None:
    whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
    if den == 0 or num >= den:
        return None  # "2\frac{3}{2}" is not a mixed number: leave it to sympy
    return _signed(m.group(1), whole + Fraction(num, den))


def _frac(m: re.Match) -> Fraction | None:
    den = _decimal(m.group(3))
    return None if den == 0 else _signed(m.group(1), _decimal(m.group(2)) / den)


# The literal forms, tried in this order: (the whole literal, its value from the match; None
# when the form matches but names no usable number).
_FORMS = (
    (re.compile(rf"^{_DECIMAL}$"), lambda m: _decimal(m.group(0))),
    (re.compile(rf"^({_DECIMAL})[eE]([+-]?\d+)$"), _power),
    (re.compile(rf"^(?:({_DECIMAL})(?:\\times|\\cdot|\*))?10\^(?:\{{([+-]?\d+)\}}|([+-]?\d))$"), _power),
    (re.compile(rf"^({_DECIMAL})/({_DECIMAL})$"), _ratio),
    # "2\frac{1}{2}" is the mixed number 5/2 (how MATH references write it), not 2 x 1/2.
    (re.compile(r"^([+-]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$"), _mixed),
    (re.compile(rf"^([+-]?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}$"), _frac),
)


def parse_number(text: str | None) -> tuple[Fraction, bool] | None:
    """(value, is_percent) for a normalised numeric literal, or None if it is not one."""
    if not text or len(text) > _MAX_LITERAL_CHARS:
        return None
    s = text
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        s = s[1:-1]  # "(-3)" reads as -3; a single pair only, tuples are handled elsewhere
    for pattern, value_of in _FORMS:
        m = pattern.match(s)
        if m:
            try:
                value = value_of(m)
            except (ValueError, ZeroDivisionError):
                return None
            return None if value is None else (value, percent)
    return None


def _close(a: Fraction, gold: Fraction) -> bool:
    if a == gold:
        return True
    if a.denominator == 1 and gold.denominator == 1:
        return False
    # Exact Fraction arithmetic: no float overflow on 1e400-sized literals.
    return abs(a - gold) <= _TOLERANCE_EXACT * max(Fraction(1), abs(gold))


def numbers_equal(pred: tuple[Fraction, bool], gold: tuple[Fraction, bool]) -> bool:
    """SPEC §10 numeric rule on two ``parse_number`` results (see module docstring)."""
    if pred[1] == gold[1]:
        return _close(pred[0], gold[0])  # both or neither are percentages: plain values
    marked, plain = (pred, gold) if pred[1] else (gold, pred)
    candidates = (marked[0], marked[0] / 100)
    if marked is pred:
        return any(_close(c, plain[0]) for c in candidates)
    return any(_close(plain[0], c) for c in candidates)
