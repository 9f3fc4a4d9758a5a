"""The real demo's task: one-digit arithmetic asked for a bare number.

    system: "Answer with only the final number."    user: "What is 7 * 8?"    answer: "56"

Why this task: Qwen2.5-Coder-0.5B-Instruct answers it with the number (~100% greedy), while
SmolLM2-135M-Instruct answers "To add 7 and 8, we need to..." (0%), though it knows most of
the facts: with its reply forced to start "The answer is " it is right on ~83% of the sums,
~96% of the products and ~42% of the differences (2026-12-06, 24 problems each). So the gap is
the teacher's way of answering, which on-policy distillation teaches in tens of steps on a CPU,
and what the student then gets right measures what it already knew. (Two-digit sums were tried
first: the student's forced answers were right 4% of the time, too little to close half the gap
in 25 minutes.)

The universe is every `a op b` with a, b in 1..9 (`a - b` with a >= b, no negative answers):
207 problems. The held-out split takes whole unordered pairs per operator, so "3 + 5" and
"5 + 3" are never on both sides; it is a fixed seeded choice, training draws only from the rest.

A second task for the same-tokenizer pair (`three-digit-differences`: `a - b` with
100 <= b <= a <= 999, a seeded 1,200 of them): Qwen2.5-Coder-0.5B-Instruct answers every one-digit
problem already, so a pair of Qwen2.5-Coders (1.5B teaching 0.5B) has no gap there. Greedy on 30
random problems of each kind (2026-12-06), 0.5B against 1.5B: three-digit differences 0.53 against
0.97, three-digit sums 0.73 / 0.87, two-digit products 0.10 / 0.73 (facts the 0.5B lacks, not a
way of answering), `a * b` with a two-digit a and a one-digit b 0.75 / 0.77 (no gap).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from ctopd_jax.demo.task import apply

SYSTEM_PROMPT = "Answer with only the final number."
SPLIT_SEED = 20261206
# task -> (operators, a's range, b's range, how many of them: None = all, else a seeded sample)
TASKS = {"one-digit": (("+", "-", "*"), range(1, 10), range(1, 10), None),
         "three-digit-differences": (("-",), range(100, 1000), range(100, 1000), 1200)}


def problems(task: str = "one-digit") -> list[tuple[str, str]]:
    """(question, answer) for the whole universe of `task`, in a fixed order."""
    operators, a_range, b_range, sample = TASKS[task]
    terms = [(a, op, b) for op in operators for a in a_range for b in b_range
             if op != "-" or a >= b]
    if sample is not None:
        terms = sorted(random.Random(SPLIT_SEED).sample(terms, sample))
    return [(f"What is {a} {op} {b}?", str(apply(a, op, b))) for a, op, b in terms]


def split(held_out: int, task: str = "one-digit") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out): held-out whole unordered pairs until it has >= `held_out` problems."""
    groups: dict[tuple, list] = {}
    for question, answer in problems(task):
        _, a, op, b = question.rstrip("?").rsplit(" ", 3)
        groups.setdefault((op, min(a, b), max(a, b)), []).append((question, answer))
    keys = sorted(groups)
    random.Random(SPLIT_SEED).shuffle(keys)
    test, train = [], []
    for key in keys:
        (test if len(test) < held_out else train).extend(groups[key])
    return train, test


def write_files(folder: Path, held_out: int, teachers: tuple[str, ...] = (),
                task: str = "one-digit") -> tuple[Path, Path]:
    """train.jsonl ({"prompt", "response"}) and held_out.jsonl ({"prompt", "answer"}) in
    `folder`: the layouts `python -m ctopd_jax.train` (data.path) and `python -m
    ctopd_jax.evaluate --dataset ... --system-prompt ...` read. The response, the bare answer,
    is what gkd's off-policy share (1 - gkd_lambda) trains on; on-policy objectives sample
    their own. With several `teachers`, training row i also names teachers[i % n] as its
    `teacher` (data.teacher_key): each teacher gets every n-th problem."""
    train, test = split(held_out, task)
    folder.mkdir(parents=True, exist_ok=True)
    train_file, test_file = folder / "train.jsonl", folder / "held_out.jsonl"
    rows = [{"prompt": q, "response": a} for q, a in train]
    for i, row in enumerate(rows if len(teachers) > 1 else ()):
        row["teacher"] = teachers[i % len(teachers)]
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    test_file.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in test))
    return train_file, test_file
