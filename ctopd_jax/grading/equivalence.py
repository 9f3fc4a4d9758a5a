"""Answer equivalence: string, then numeric, then (optionally) symbolic — SPEC §10.

``compare(pred, gold, symbolic=None)`` works on normalised strings. Without a symbolic
checker it is the cheap in-process pass and may answer ``None`` ("needs sympy"); the worker
process calls it again with ``symbolic=symbolic_equal`` to settle those cases.

Structured answers (decisions where SPEC is silent):
- ``A \\cup B`` compares part by part, in order.
- Intervals and tuples "(a,b]", "[a,b]", "(a,b)" compare element-wise, in order, and the
  bracket kinds must agree ("[0,1)" is not "(0,1)").
- Sets "\\{a,b\\}" and bare lists "a, b" compare as multisets (any order); a bare list also
  matches a parenthesised tuple of the same elements in order.
- Plain words compare case-insensitively ("No" ≡ "no").
- Lists longer than 32 elements compare as exact string multisets (bounded work in process).
"""
from __future__ import annotations

import re
from typing import Callable

from ctopd_jax.grading.numeric import numbers_equal, parse_number

Symbolic = Callable[[str, str], bool]

_OPEN = "([{"
_CLOSE = ")]}"
_MAX_MATCHED_ELEMENTS = 32
_PLAIN_WORDS = re.compile(r"^[A-Za-z][A-Za-z ']*$")


def _split_top_level(s: str, sep: str) -> list[str]:
    """Split at separators not nested inside (), [] or {} (mismatched pairs like "[0,1)"
    count as one level, which is what interval notation needs)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):  # set braces nest too
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        ch = s[i]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _outer_brackets(s: str) -> tuple[str, str, str] | None:
    """(open, close, inner) if one bracket pair encloses the whole string."""
    if s.startswith("\\{") and s.endswith("\\}"):
        inner = s[2:-2]
        return ("{", "}", inner) if len(_split_top_level("x" + inner + "x", "\\}")) == 1 else None
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        depth = 0
        for i, ch in enumerate(s):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
                if depth == 0 and i != len(s) - 1:
                    return None  # "(a)(b)" is a product, not one bracketed group
        return s[0], s[-1], s[1:-1]
    return None


def _structure(s: str) -> tuple[str, list[str]]:
    """("scalar", [s]) | ("ordered:<o><c>", elems) | ("unordered", elems) | ("bare", elems)."""
    outer = _outer_brackets(s)
    if outer is not None:
        open_, close, inner = outer
        elems = _split_top_level(inner, ",")
        if open_ == "{":
            return "unordered", elems
        if len(elems) > 1:
            return f"ordered:{open_}{close}", elems
        return "scalar", [s]
    elems = _split_top_level(s, ",")
    if len(elems) > 1:
        return "bare", elems
    return "scalar", [s]


def _all(verdicts: list[bool | None]) -> bool | None:
    if any(v is False for v in verdicts):
        return False
    return None if any(v is None for v in verdicts) else True


def _multiset_match(pred: list[str], gold: list[str], scalar) -> bool | None:
    """Perfect matching over pairs judged equal (Kuhn's augmenting paths; lists are short)."""
    if len(pred) != len(gold):
        return False
    if len(pred) > _MAX_MATCHED_ELEMENTS:  # bound the pairwise table: exact multisets only
        return sorted(pred) == sorted(gold)
    table = [[scalar(p, g) for g in gold] for p in pred]
    owner: list[int | None] = [None] * len(gold)

    def augment(i: int, seen: set[int]) -> bool:
        for j in range(len(gold)):
            if table[i][j] is True and j not in seen:
                seen.add(j)
                if owner[j] is None or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    if all(augment(i, set()) for i in range(len(pred))):
        return True
    return None if any(v is None for row in table for v in row) else False


def scalar_compare(pred: str, gold: str, symbolic: Symbolic | None = None) -> bool | None:
    if pred == gold:
        return True
    p_num, g_num = parse_number(pred), parse_number(gold)
    if p_num is not None and g_num is not None:
        return numbers_equal(p_num, g_num)
    if _PLAIN_WORDS.match(pred) and _PLAIN_WORDS.match(gold):
        return pred.lower().replace(" ", "") == gold.lower().replace(" ", "")
    if symbolic is None:
        return None
    return symbolic(pred, gold)


def compare(pred: str, gold: str, symbolic: Symbolic | None = None) -> bool | None:
    """Equivalence of two normalised answers; None only when ``symbolic`` is None and the
    cheap checks cannot decide."""
    if pred == gold:
        return True
    scalar = lambda p, g: compare(p, g, symbolic)  # noqa: E731 - elements may be structured
    p_union, g_union = _split_top_level(pred, "\\cup"), _split_top_level(gold, "\\cup")
    if len(p_union) > 1 or len(g_union) > 1:
        if len(p_union) != len(g_union):
            return False
        return _all([scalar(p, g) for p, g in zip(p_union, g_union)])
    p_kind, p_elems = _structure(pred)
    g_kind, g_elems = _structure(gold)
    if p_kind == g_kind == "scalar":
        return scalar_compare(pred, gold, symbolic)
    if {p_kind, g_kind} <= {"bare", "unordered"}:
        return _multiset_match(p_elems, g_elems, scalar)
    if {p_kind, g_kind} == {"bare", "ordered:()"} or (p_kind == g_kind and p_kind.startswith("ordered")):
        if len(p_elems) != len(g_elems):
            return False
        return _all([scalar(p, g) for p, g in zip(p_elems, g_elems)])
    return False  # a set against an interval, a tuple against a number, ...
