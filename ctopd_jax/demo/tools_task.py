"""The demo's tool-use task: two-digit arithmetic the model cannot do in its head but can hand to a
calculator tool, with a two-turn reference transcript.

A problem is ``A op B`` with two-digit operands (10..99) and ``op`` one of ``*``, ``+``, ``-``
(subtraction only when A >= B, so every answer is a non-negative integer). The model calls the
tool in its first turn, the environment answers with an observation, and the model's second turn
states the answer and ends with the EOS::

    prompt:        "Compute 12 * 34."
    turn 1:        "<calc>12*34</calc>"          (generation stops right after "</calc>")
    observation:   "<result>408</result>"        (appended by the environment, never trained)
    turn 2:        "The answer is 408."          (then the EOS)
    transcript():  "<calc>12*34</calc><result>408</result>The answer is 408."

No spaces between the parts, none inside the tags. The prompt writes the operator with spaces
("12 * 34"), the calc tag without ("12*34").

Why this task (decisions the brief leaves to us):
- Two-digit × two-digit multiplication is out of reach of a tiny character-level decoder (the
  answer has 3-4 digits that depend on every operand digit), but the transcript needs only two
  copies: the operands and operator from the prompt into the calc tag, and the result from the
  observation into the answer. So a solved problem measures tool use, not arithmetic.
- ``+`` and ``-`` are mixed in (uniform over the universe: 8100 ``*``, 8100 ``+`` and 4095
  ``-`` problems) so the operator must be copied too, and results have 1 to 4 digits, so the
  answer copy cannot rely on a fixed offset.
- The held-out split is a fixed, seeded shuffle of the finite universe (20295 problems); training
  draws only from the complement, so the two are disjoint by construction.

The calculator (``calculate``) parses exactly ``INT OP INT`` (optional surrounding spaces, at most
``MAX_OPERAND_DIGITS`` digits per operand) with plain ``int`` and applies the operator; it never
calls ``eval``. Anything else is a tool error: the observation is ``<result>error</result>``.

The grader reads the number after the LAST "The answer is" and compares it exactly with the
answer (task.grade); a response without that phrase is wrong. Grading the full transcript is
the same as grading turn 2 alone unless the model writes the phrase in turn 1.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ctopd_jax.demo import task
from ctopd_jax.demo.data import cached_jsonl

OPERATORS = ("*", "+", "-")
OPERANDS = range(10, 100)
SPLIT_SEED = 20261203
HELD_OUT_SIZE = 200
SPLITS = ("train", "held_out")

CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
TOOL_ERROR = "error"
MAX_OPERAND_DIGITS = 12

_CALL_RE = re.compile(re.escape(CALC_OPEN) + r"(.*?)" + re.escape(CALC_CLOSE), re.DOTALL)
_EXPR_RE = re.compile(r"\s*(-?\d{1,%d})\s*([*+-])\s*(-?\d{1,%d})\s*" % (MAX_OPERAND_DIGITS,
                                                                       MAX_OPERAND_DIGITS))


@dataclasses.dataclass(frozen=True, order=True)
class Problem(task.Expression):   # the prompt and the answer come from `terms`
    a: int
    op: str
    b: int

    @property
    def terms(self) -> tuple:
        return self.a, self.op, self.b

    @property
    def expression(self) -> str:
        """What the calc tag holds: "12*34"."""
        return f"{self.a}{self.op}{self.b}"

    @property
    def expert_turns(self) -> list[str]:
        """The reference assistant turns: the tool call, then the final answer (EOS follows)."""
        return [f"{CALC_OPEN}{self.expression}{CALC_CLOSE}", f"The answer is {self.answer}."]

    @property
    def observation(self) -> str:
        """The environment's reply to the reference tool call."""
        return observation(self.answer)

    def transcript(self) -> str:
        """turn 1 + observation + turn 2, no separators."""
        first, second = self.expert_turns
        return first + self.observation + second

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": str(self.answer),
                "expert_turns": self.expert_turns, "response": self.transcript()}


def all_problems() -> list[Problem]:
    """Every problem (subtraction only with a >= b), in a fixed order: 20295 of them."""
    return [Problem(a, op, b) for a in OPERANDS for op in OPERATORS for b in OPERANDS
            if op != "-" or a >= b]


def split(name: str, seed: int = SPLIT_SEED, held_out_size: int = HELD_OUT_SIZE) -> list[Problem]:
    """The problems of split ``name`` ("train" or "held_out"), disjoint by construction."""
    return task.split_of(all_problems(), name, seed, held_out_size)


sample = task.sample   # ``n`` problems drawn uniformly with replacement (training batches)


def calculate(expression: str) -> int | None:
    """``INT OP INT`` evaluated with int parsing (never eval); None when it is not that form."""
    m = _EXPR_RE.fullmatch(expression)
    if m is None:
        return None
    return task.apply(int(m.group(1)), m.group(2), int(m.group(3)))


def observation(value: int | None) -> str:
    """``<result>VALUE</result>``; ``<result>error</result>`` for a failed tool call."""
    return f"{RESULT_OPEN}{TOOL_ERROR if value is None else value}{RESULT_CLOSE}"


def tool_call(turn: str) -> str | None:
    """The expression of the first ``<calc>…</calc>`` in ``turn``, or None without one."""
    m = _CALL_RE.search(turn)
    return m.group(1) if m else None


def cut_after_call(text: str) -> str | None:
    """``text`` up to and including its first ``</calc>`` (where generation stops), or None."""
    end = text.find(CALC_CLOSE)
    return None if end < 0 else text[:end + len(CALC_CLOSE)]


def respond(turn: str) -> str | None:
    """The environment's observation for a model turn that ends with a tool call; None when the
    turn holds no call (the episode is then over)."""
    expression = tool_call(turn)
    return None if expression is None else observation(calculate(expression))


# -- grading and files ------------------------------------------------------------------------
extract_answer = task.extract_answer
accuracy = task.accuracy


def grade(response: str, answer: int | str) -> bool:
    """The number after the LAST "The answer is" equals ``answer`` (missing phrase: wrong)."""
    return task.grade(response, answer)


write_jsonl = task.write_jsonl   # one row (`Problem.to_row()`) per line


def prompt_file(split_name: str) -> Path:
    """The jsonl of ``split_name`` in the demo cache (``demo:tools_train`` / ``demo:tools_held_out``),
    rewritten only when its content would change (as demo.data.prompt_file)."""
    if split_name not in SPLITS:
        raise ValueError(f"demo tools split {split_name!r} is unknown; use demo:tools_train or "
                         "demo:tools_held_out")
    return cached_jsonl(f"tools_{split_name}.jsonl", split(split_name))
