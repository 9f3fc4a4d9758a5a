"""A calculator tool: the model writes `<calc>EXPR</calc>` and gets `<result>VALUE</result>`.

A turn holding a calc call is a tool call (reward 0, the episode goes on); a turn without one is
the final answer, rewarded 1.0 when the number after its last "The answer is" equals the
prompt's `answer` column. Expressions are evaluated by walking their `ast` (never eval/exec),
with bounds that make every evaluation small and fast by construction: at most 200 characters,
32 nested parentheses and 64 AST nodes, exponents |e| <= 64 with |base| <= 1e6 when e > 1, integers within 10**30,
finite floats. Every refusal is an `error: ...` observation the model can read and retry on.

Decisions where the brief left room:
- The turn may end with an unclosed `<calc>EXPR` (a generator that strips its stop string
  "</calc>" from the output); that trailing call counts as a call.
- A call whose expression is refused still counts towards `max_calls`.
- "The answer is" is matched case-insensitively; markdown/`$`/`:` between it and the number
  are skipped; thousands separators ("1,234") are accepted.
- An `answer` column that is present but not a number is a data error (EnvConfigError at
  `reset`, naming the row), not a silent reward of 0 on every episode.
- Observations carry no separators: "<result>5</result>" is appended right after "</calc>".
"""
from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from typing import Any

from ctopd_jax.envs.base import EnvConfigError, StepResult

MAX_CHARS = 200
MAX_NODES = 64
MAX_DEPTH = 32  # nested parentheses, checked on the text before the parser sees it
MAX_EXPONENT = 64
MAX_POW_BASE = 1e6
MAX_INT = 10**30
FLOAT_TOL = 1e-6

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"the answer is[\s:*$\\(]*(-?(?:\d[\d,]*(?:\.\d+)?|\.\d+))", re.IGNORECASE)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, *_BINARY, *_UNARY)
_ALLOWED_TEXT = "only numbers, + - * / // % ** and parentheses are allowed"


class CalcError(Exception):
    """An expression the calculator refuses; the message is the observation's REASON."""


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalcError("complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise CalcError("result too large")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise CalcError(f"exponent too large (|exponent| must be at most {MAX_EXPONENT})")
    if exp > 1 and abs(base) > MAX_POW_BASE:
        raise CalcError("result too large")
    return base ** exp


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool, str, bytes, complex, None, ...
            raise CalcError(f"{type(node.value).__name__} constants are not allowed; "
                            f"{_ALLOWED_TEXT}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp):
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalcError(f"{type(node).__name__} is not allowed; {_ALLOWED_TEXT}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalcError (with the reason) when refused."""
    expression = expression.strip()
    if not expression:
        raise CalcError("empty expression")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    depth = 0
    for char in expression:
        depth += (char == "(") - (char == ")")
        if depth > MAX_DEPTH:
            raise CalcError(f"parentheses nested deeper than {MAX_DEPTH}")
    try:
        with warnings.catch_warnings():   # a model's "3x" is a refused call, not a warning on stderr
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("cannot parse the expression") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise CalcError(f"expression too complex (more than {MAX_NODES} syntax nodes)")
    for node in nodes:  # refuse before evaluating anything
        if not isinstance(node, _ALLOWED):
            raise CalcError(f"{type(node).__name__} is not allowed; {_ALLOWED_TEXT}")
    try:
        return _eval(tree)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("result too large") from None


def format_value(value: int | float) -> str:
    """Ints as digits; integral floats below 1e15 as ints (8/2 -> "4"); else 10 significant."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.10g}"


def _number(text: str) -> int | float | None:
    text = text.strip().replace(",", "")
    for parse in (int, float):
        try:
            value = parse(text)
        except ValueError:
            continue
        return value if isinstance(value, int) or math.isfinite(value) else None
    return None


def answers_match(given: int | float, expected: int | float) -> bool:
    """Exact for two ints, within FLOAT_TOL (absolute) when either is a float."""
    if isinstance(given, int) and isinstance(expected, int):
        return given == expected
    return abs(given - expected) <= FLOAT_TOL


def final_answer(text: str) -> int | float | None:
    """The number after the last "The answer is" in `text`, or None."""
    if not (matches := _ANSWER.findall(text)):
        return None
    return _number(matches[-1])


def last_call(text: str) -> str | None:
    """The expression of the last calc call of a turn (closed, or unclosed at its end)."""
    opened = text.rfind("<calc>")
    if opened >= 0 and opened > text.rfind("</calc>"):
        return text[opened + len("<calc>"):]
    calls = _CALL.findall(text)
    return calls[-1] if calls else None


class Calculator:
    """Calculator tool environment (see the module docstring); `max_calls` per episode."""

    name = "calculator"
    tool_stop = "</calc>"

    def __init__(self, max_calls: int = 8):
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise EnvConfigError(f"calculator setting max_calls={max_calls!r}: give a positive "
                                 "integer (calc calls allowed per episode)")
        self.max_calls = max_calls
        self._answer: int | float | None = None
        self._calls = 0
        self._done = True
        self._started = False

    def reset(self, prompt) -> str:
        raw = prompt.extra.get("answer")
        answer = None
        if raw is not None and not (isinstance(raw, str) and not raw.strip()):
            answer = raw if type(raw) is int else _number(str(raw))
            if answer is None:
                raise EnvConfigError(f"{prompt.source}: answer={raw!r} is not a number; the "
                                     "calculator environment needs a numeric 'answer' column")
        self._answer, self._calls, self._done, self._started = answer, 0, False, True
        return ""

    def step(self, text: str) -> StepResult:
        if not self._started:
            raise RuntimeError("Calculator.step before reset")
        if self._done:
            raise RuntimeError("Calculator.step after the episode ended; call reset")
        expression = last_call(text)
        if expression is None:  # the final answer
            self._done = True
            given = final_answer(text)
            ok = given is not None and self._answer is not None and answers_match(given, self._answer)
            return StepResult("", 1.0 if ok else 0.0, True)
        if self._calls >= self.max_calls:
            self._done = True
            return StepResult("<result>error: too many calls</result>", 0.0, True)
        self._calls += 1
        try:
            value = format_value(evaluate(expression))
        except CalcError as e:
            value = f"error: {e}"
        return StepResult(f"<result>{value}</result>", 0.0, False)
