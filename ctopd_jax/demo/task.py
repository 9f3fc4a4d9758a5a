"""The demo's synthetic task: two-step single-digit arithmetic with a worked answer.

A problem is ``a op1 b op2 c`` with single-digit operands and ``+``/``-`` whose partial result
and answer are single digits too (0..9). The reference response shows both steps, then the
answer::

    prompt:   "Compute 7 - 5 + 3."
    response: "(7-5)=2, 2+3=5. The answer is 5."

Why this task (decisions the spec leaves to us):
- Each step is one fact from one small table (single digit +/- single digit with a single-digit
  result, 110 facts), so a tiny decoder learns it in minutes on a CPU, and a held-out PROBLEM
  (an unseen triple) is still made of facts seen in training: the held-out set measures the
  skill, not memorisation.
- The response format is chosen for the demo's tokenizer pair (byte-level BPE teacher, Unigram
  student with byte fallback): every result digit follows "=" with no space, so on both sides
  it is its own token and the strict 1:1 alignment supervises exactly the digits the student
  must get right; and every teacher token of a reference response has a byte-identical student
  token (is in V∩). The first format tried, "(7-5)=2, (2+3)=5. ...", had a teacher token "Ġ("
  with no student counterpart: when the student drifted there, the teacher rows renormalised on
  V∩ supervised noise and on-policy distillation collapsed (unreliable supervision, the
  paper's point). Strict coverage of reference responses is ~98%, not 100%: numbers after a
  space can still split differently ("▁", "1" against "Ġ1").
- The response is fully determined by the prompt, so the teacher's next-token distribution is
  sharp everywhere and the answer digits are the only places where a weak student goes wrong.
  On-policy distillation then supervises exactly the student's own mistakes.
- The held-out split is a fixed, seeded shuffle of the finite problem universe; training draws
  only from the complement, so the two are disjoint by construction.

The grader reads the number after the LAST "The answer is" and compares it exactly with the
answer; a response without that phrase is wrong (truncated or malformed samples score 0).
"""
from __future__ import annotations

import dataclasses
import json
import operator
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

OPERATORS = ("+", "-")
DIGITS = range(10)
SPLIT_SEED = 20261202
HELD_OUT_SIZE = 200

_ANSWER_RE = re.compile(r"The answer is\s*(-?\d+)")


_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def apply(x: int, op: str, y: int) -> int:
    """``x op y`` for the operators of both demo tasks (this one and tools_task.py); never eval."""
    if op not in _OPERATIONS:
        raise ValueError(f"unknown operator {op!r}; use one of {tuple(_OPERATIONS)}")
    return _OPERATIONS[op](x, y)


class Expression:
    """What the problems of both demo tasks share: ``terms`` (``a op b [op c ...]``), read out as
    the prompt "Compute a op b." and evaluated left to right as the answer."""

    @property
    def terms(self) -> tuple:
        raise NotImplementedError

    @property
    def answer(self) -> int:
        value = self.terms[0]
        for op, y in zip(self.terms[1::2], self.terms[2::2]):
            value = apply(value, op, y)
        return value

    @property
    def prompt(self) -> str:
        return f"Compute {' '.join(str(t) for t in self.terms)}."


@dataclasses.dataclass(frozen=True, order=True)
class Problem(Expression):
    a: int
    op1: str
    b: int
    op2: str
    c: int

    @property
    def terms(self) -> tuple:
        return self.a, self.op1, self.b, self.op2, self.c

    @property
    def first(self) -> int:
        """The result of the first step."""
        return apply(self.a, self.op1, self.b)

    @property
    def solution(self) -> str:
        """The reference (teacher-format) response."""
        return (f"({self.a}{self.op1}{self.b})={self.first}, "
                f"{self.first}{self.op2}{self.c}={self.answer}. The answer is {self.answer}.")

    def to_row(self) -> dict:
        return {"prompt": self.prompt, "answer": str(self.answer), "response": self.solution}


def all_problems() -> list[Problem]:
    """Every valid problem (partial result and answer in 0..9), in a fixed order: 1210 of them."""
    out = []
    for a in DIGITS:
        for op1 in OPERATORS:
            for b in DIGITS:
                for op2 in OPERATORS:
                    for c in DIGITS:
                        p = Problem(a, op1, b, op2, c)
                        if 0 <= p.first <= 9 and 0 <= p.answer <= 9:
                            out.append(p)
    return out


def split(name: str, seed: int = SPLIT_SEED, held_out_size: int = HELD_OUT_SIZE) -> list[Problem]:
    """The problems of split ``name`` ("train" or "held_out"), disjoint by construction."""
    return split_of(all_problems(), name, seed, held_out_size)


def split_of(universe: Sequence, name: str, seed: int, held_out_size: int) -> list:
    """Split ``name`` of a finite problem universe: a fixed, seeded shuffle; the first
    ``held_out_size`` are held out, training draws only from the rest."""
    if name not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {name!r}")
    if not 0 < held_out_size < len(universe):
        raise ValueError(f"held_out_size must be in (0, {len(universe)}), got {held_out_size}")
    order = np.random.default_rng(seed).permutation(len(universe))
    idx = order[:held_out_size] if name == "held_out" else order[held_out_size:]
    return [universe[i] for i in sorted(idx)]


def sample(problems: Sequence[Problem], n: int, rng: np.random.Generator) -> list[Problem]:
    """``n`` problems drawn uniformly with replacement (training batches)."""
    return [problems[i] for i in rng.integers(0, len(problems), size=n)]


def extract_answer(response: str) -> int | None:
    """The integer after the last "The answer is", or None when the phrase is missing."""
    found = _ANSWER_RE.findall(response)
    return int(found[-1]) if found else None


def grade(response: str, answer: int | str) -> bool:
    """Exact match of the extracted final number with the reference answer."""
    got = extract_answer(response)
    return got is not None and got == int(answer)


def accuracy(responses: Iterable[str], answers: Iterable[int | str]) -> float:
    verdicts = [grade(r, a) for r, a in zip(responses, answers, strict=True)]
    if not verdicts:
        raise ValueError("accuracy of an empty set is undefined; pass at least one response")
    return sum(verdicts) / len(verdicts)


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """One ``{"prompt", "answer", "response"}`` object per line (the trainer's prompt format)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps(p.to_row()) + "\n")
    return path
