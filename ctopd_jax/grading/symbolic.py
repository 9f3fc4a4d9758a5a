"""Symbolic equivalence with sympy: the last step of SPEC §10, run only inside a worker process.

Why sympy and not ``math-verify``: sympy is already a runtime dependency; math-verify adds
antlr4/latex2sympy pins, and its time limit is ``signal.alarm``, which cannot interrupt work
inside a single C call (``10**10**10`` is one big-integer power) and only works on the main
thread. Here the caller (``pool.SymbolicPool``) runs this module in a separate process and kills
it at the deadline, which bounds any input.

Why a small LaTeX-to-sympy translator instead of ``sympy.parsing.latex``: that parser needs
antlr4 or lark (not installed), and model output is untrusted text: ``parse_expr`` evaluates
Python, so the translated string is checked against a whitelist (digits, operators, brackets,
single-letter symbols and a fixed set of function names) before it is parsed, with builtins
removed from the evaluation namespace.
"""
from __future__ import annotations

import keyword
import re

import sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

_FUNCTIONS = {
    "sqrt": sympy.sqrt, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot,
    "sec": sympy.sec, "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos,
    "arctan": sympy.atan, "log": sympy.log, "ln": sympy.log, "exp": sympy.exp,
    "pi": sympy.pi, "oo": sympy.oo, "root": sympy.root,
}
_GLOBALS = {
    "__builtins__": {},
    "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
    "Symbol": sympy.Symbol, "factorial": sympy.factorial, **_FUNCTIONS,
}
# A bare "e" is Euler's number and a bare "i" the imaginary unit, as in competition answers
# ("e^{i\\pi}", "3+2i"); every other letter is a real-valued-agnostic symbol.
_CONSTANTS = {"e": sympy.E, "i": sympy.I}
_TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor)
_LATEX_WORDS = {
    "\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/",
    "\\sin": " sin ", "\\cos": " cos ", "\\tan": " tan ", "\\cot": " cot ", "\\sec": " sec ",
    "\\csc": " csc ", "\\arcsin": " arcsin ", "\\arccos": " arccos ", "\\arctan": " arctan ",
    "\\ln": " ln ", "\\log": " log ", "\\exp": " exp ",
}
_ALLOWED = re.compile(r"^[0-9a-zA-Z+\-*/^().,! ]*$")
_WORD = re.compile(r"[a-zA-Z]+")
_BAD_DOT = re.compile(r"\.(?!\d)|(?<!\d)\.")
_MAX_CHARS = 400


class NotParseable(ValueError):
    """The answer is outside the LaTeX subset this translator reads."""


def _braced(s: str, i: int) -> tuple[str, int]:
    """The content of the brace group starting at s[i] == '{' and the index after it."""
    if i >= len(s) or s[i] != "{":
        raise NotParseable(f"expected '{{' at {i} in {s!r}")
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1:j], j + 1
    raise NotParseable(f"unbalanced braces in {s!r}")


def _log_part(s: str, i: int, base: bool = False) -> tuple[str, int]:
    """A log base or argument at s[i]: a {group}, a (group), or a run of digits / one letter.
    An unbraced base is one character, as LaTeX reads a subscript ("\\log_28" = log base 2 of 8)."""
    if i < len(s) and s[i] == "{":
        return _braced(s, i)
    if i < len(s) and s[i] == "(":
        depth = 0
        for j in range(i, len(s)):
            depth += {"(": 1, ")": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1:j], j + 1
        raise NotParseable(f"unbalanced parentheses in {s!r}")
    m = re.match(r"[0-9a-zA-Z]" if base else r"\d+(?:\.\d+)?|[a-zA-Z]", s[i:])
    if not m:
        raise NotParseable(f"cannot read a logarithm at {i} in {s!r}")
    return m.group(0), i + len(m.group(0))


def latex_to_text(s: str) -> str:
    """Translate a normalised LaTeX answer into sympy input syntax (whitelisted)."""
    out = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _braced(s, i + 5)
            den, i = _braced(s, i)
            out.append(f"(({latex_to_text(num)})/({latex_to_text(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            if i < len(s) and s[i] == "[":
                close = s.index("]", i)
                index = latex_to_text(s[i + 1:close])
                body, i = _braced(s, close + 1)
                out.append(f"root(({latex_to_text(body)}),({index}))")
            else:
                body, i = _braced(s, i)
                out.append(f"sqrt({latex_to_text(body)})")
        elif s.startswith("\\log_", i):
            base, i = _log_part(s, i + 5, base=True)
            arg, i = _log_part(s, i)
            out.append(f"log(({latex_to_text(arg)}),({latex_to_text(base)}))")
        elif s[i] == "\\":
            m = re.match(r"\\[a-zA-Z]+", s[i:])
            word = m.group(0) if m else s[i:i + 2]
            if word not in _LATEX_WORDS:
                raise NotParseable(f"unsupported command {word}")
            out.append(_LATEX_WORDS[word])
            i += len(word)
        elif s[i] == "{":
            body, i = _braced(s, i)
            out.append(f"({latex_to_text(body)})")
        else:
            out.append(s[i])
            i += 1
    text = "".join(out)
    return text


def to_sympy(s: str) -> sympy.Expr:
    if len(s) > _MAX_CHARS:
        raise NotParseable("answer too long for symbolic comparison")
    text = latex_to_text(s)
    # parse_expr evaluates Python: allow only digits, operators, brackets, commas, "!" and
    # letters; no "_" (so no dunder access), "." only inside numbers (no attribute access),
    # no Python keywords. Unknown letter runs become products of one-letter symbols.
    if not _ALLOWED.match(text) or _BAD_DOT.search(text):
        raise NotParseable(f"characters outside the whitelist in {text!r}")
    if any(keyword.iskeyword(w) for w in _WORD.findall(text)):
        raise NotParseable(f"python keyword in {text!r}")
    try:
        return parse_expr(text, local_dict=dict(_CONSTANTS), global_dict=dict(_GLOBALS),
                          transformations=_TRANSFORMS)
    except (SyntaxError, TypeError, ValueError, AttributeError, NameError, TokenError_) as exc:
        raise NotParseable(str(exc)) from exc


try:  # tokenize errors surface as TokenError on unbalanced brackets
    from tokenize import TokenError as TokenError_
except ImportError:  # pragma: no cover
    TokenError_ = SyntaxError


def symbolic_equal(pred: str, gold: str) -> bool:
    """True if the two normalised answers are equal as sympy expressions.

    Constant expressions compare numerically within the SPEC tolerance (1e-6 relative to
    max(1, |gold|)); expressions with free symbols must simplify to a zero difference.
    """
    try:
        a, b = to_sympy(pred), to_sympy(gold)
    except NotParseable:
        return False
    if not (isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic)):
        return False
    if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return a == b  # infinities: no tolerance arithmetic (oo - oo, inf <= inf * 1e-6)
    diff = sympy.simplify(a - b)
    if diff == 0:
        return True
    if not diff.free_symbols:
        value = complex(sympy.N(diff, 30))
        scale = max(1.0, abs(complex(sympy.N(b, 30))))
        return abs(value) <= 1e-6 * scale
    return bool(a.equals(b))
