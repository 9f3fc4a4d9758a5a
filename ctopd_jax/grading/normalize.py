"""String normalisation of final answers (SPEC §10) before any comparison.

Decisions where SPEC is silent (each is a rule a grader test pins down):
- ``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\mbox{}`` are unwrapped (content kept);
  unit words after a value ("5 cm", "10\\text{ inches}", "3 square units") are dropped.
- ``\\dfrac``/``\\tfrac`` become ``\\frac``; ``\\left``/``\\right``/``\\big...`` and the spacing
  commands ``\\, \\; \\: \\! \\quad \\qquad ~`` are dropped; ``\\displaystyle`` is dropped.
- Dollar signs (math delimiters and currency), ``\\(``/``\\)``, degree marks (``^\\circ``, ``°``)
  and a trailing period are dropped; ``\\%`` becomes ``%`` (the numeric step reads it).
- A lone "x = value" (one letter, one "=") or "x \\in S" keeps the value / set: MATH
  references box the value. "x = 1 or x = 3" / "x=1, x=3" become the list "1,3" (one unknown);
  "x=1, y=2" stays as written. " or " / " and " between items become list commas.
- Thousands separators ("1,000,000") are removed only in a full digit-group pattern; "1, 2"
  (with a space) stays a list.
- A numeral with a base subscript ("10110_2", "2121_{3}") keeps its digits.
- ``\\frac12``/``\\frac1{2}``/``\\sqrt2`` gain braces; ``^{2}`` becomes ``^2``; all whitespace
  is removed last, so the string comparison ignores spacing.
"""
from __future__ import annotations

import re

_REPLACEMENTS = (
    ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "\\times "), ("\u00f7", "\\div "),
    ("\u03c0", "\\pi "), ("\u221a", "\\sqrt"), ("\u221e", "\\infty "), ("\u00b7", "\\cdot "),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\displaystyle", ""),
    ("\\$", ""), ("$", ""), ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""),
    ("\\%", "%"), ("\\infin", "\\infty"), ("\\le ", "\\leq "), ("\\ge ", "\\geq "),
    ("{,}", ","), ("\\neq", "\\ne"), ("\\lbrace", "\\{"), ("\\rbrace", "\\}"),
)

# \left( \right] \bigl( ... : keep the delimiter, drop the sizing command.
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![a-zA-Z])")
_DIGIT_SPACING = re.compile(r"(?<=[\d,])\\[,!;:](?=\d)")
# "x = 1 or x = 3", "2 and 5" (after \text{} unwrapping): a list of solutions.
_WORD_LIST = re.compile(r"\s+(?:or|and)\s+")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|~")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\u00b0|\\degree(?![a-zA-Z])")
_UNITS = (
    r"square units?|sq\.? units?|cubic units?|units?|square (?:feet|foot|inches|meters|centimeters|miles|yards)"
    r"|cubic (?:feet|inches|meters|centimeters|yards)"
    r"|centimeters?|millimeters?|kilometers?|meters?|cm|mm|km|inches|inch|in\.|feet|foot|ft|yards?|yd|miles?|mph"
    r"|degrees?|dollars?|cents?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?"
    r"|pounds?|lbs?|ounces?|oz|kilograms?|kg|grams?|liters?|litres?|ml|gallons?|mL"
)
# A value ending in a digit/brace/paren followed by unit words (and an optional ^2 / ^3).
_TRAILING_UNIT = re.compile(
    r"^(?P<value>.*?[\d}\)a-zA-Z])\s*(?:\\text\{)?\s*(?:" + _UNITS + r")\s*(?:\^\s*\{?[23]\}?)?\s*\}?\s*$"
)
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")
_ASSIGNMENT = re.compile(r"^\s*[a-zA-Z]\s*(?:=|\\in(?![a-zA-Z]))\s*(?P<rhs>[^=]+)$")
# Short forms that gain their braces, in this order: \frac12, \frac1{2}, \frac{1}2, \sqrt2.
_BRACED_SHORT_FORMS = (
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),
    (re.compile(r"\\sqrt\s*(\d|[a-zA-Z](?![a-zA-Z]))"), r"\\sqrt{\1}"),
)
_BASE_SUBSCRIPT = re.compile(r"^([0-9A-Fa-f]+)_\{?\d+\}?$")
_SINGLE_BRACED_EXPONENT = re.compile(r"\^\{(\w)\}")


def _unwrap_text_commands(s: str) -> str:
    """Replace ``\\text{X}`` (and friends) by `` X `` using brace matching (nesting-safe)."""
    out = []
    i = 0
    while True:
        m = _TEXT_WRAPPERS.search(s, i)
        if m is None:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:m.start()])
        depth, j = 1, m.end()
        while j < len(s) and depth:
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
            j += 1
        inner_end = j - 1 if depth == 0 else len(s)
        out.append(" " + s[m.end():inner_end] + " ")
        i = j


def _strip_repeated_assignments(s: str) -> str:
    """"x=1, x=3" -> "1,3" (solutions of one unknown); "x=1, y=2" (a point) stays."""
    parts = [p.strip() for p in s.split(",")]
    if len(parts) < 2:
        return s
    matches = [_ASSIGNMENT.match(p) for p in parts]
    if all(matches) and len({p[0] for p in parts}) == 1:
        return ",".join(m.group("rhs") for m in matches)
    return s


def _strip_units(s: str) -> str:
    m = _TRAILING_UNIT.match(s)
    if m and m.group("value").strip():
        value = m.group("value")
        # "x in" / "3 m" must not lose a variable: only strip after something value-like.
        if re.search(r"[\d}\)]\s*$", value) or re.search(r"\\pi\s*$", value):
            return value
    return s


_CONTROL_WORD_THEN_LETTER = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])")


def _drop_spaces(s: str) -> str:
    """Remove whitespace, except one space ending a control word before a letter
    ("\\pi r" must not become the unknown command "\\pir")."""
    s = _CONTROL_WORD_THEN_LETTER.sub(lambda m: m.group(1) + "\x00", s)
    return re.sub(r"\s+", "", s).replace("\x00", " ")


def normalize_answer(answer: str | None) -> str | None:
    """Canonical string form of an extracted answer (None stays None)."""
    if answer is None:
        return None
    # One space per whitespace run: keeps the unit regex linear on long blank stretches.
    s = re.sub(r"\s+", " ", answer).strip()
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = s.replace("\\\\", "\x01")  # LaTeX row break "\\\\" (matrices): not a spacing command
    s = _SIZING.sub("", s)
    s = _DIGIT_SPACING.sub("", s)  # "32,\\!348", "1\\,000": spacing inside a number
    s = _SPACING.sub(" ", s)
    s = _unwrap_text_commands(s)
    s = _WORD_LIST.sub(",", s)
    s = re.sub(r"\s+", " ", s)  # spacing commands and unwrapped \text{} left runs of blanks
    s = _DEGREES.sub("", s)
    s = s.strip().rstrip(".").strip()
    s = _strip_units(s)
    m = _ASSIGNMENT.match(s)
    if m:
        s = m.group("rhs")
    s = _strip_repeated_assignments(s)
    s = _THOUSANDS.sub(lambda g: g.group(1).replace(",", ""), s)
    for short_form, braced in _BRACED_SHORT_FORMS:
        s = short_form.sub(braced, s)
    s = _drop_spaces(s)
    s = _SINGLE_BRACED_EXPONENT.sub(r"^\1", s)
    s = s.rstrip(".")
    # "10110_2" / "10110_{2}": a numeral with its base; the digits are the answer.
    s = _BASE_SUBSCRIPT.sub(r"\1", s)
    # "0.5" and ".5" read the same to a person; give the leading zero back.
    s = re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)
    return s.replace("\x01", "\\\\")
