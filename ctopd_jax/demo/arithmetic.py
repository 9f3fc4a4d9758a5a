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
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from ctopd_jax.demo.task import apply

SYSTEM_PROMPT = "Answer with only the final number."
OPERATORS = ("+", "-", "*")
SPLIT_SEED = 20261206


def problems() -> list[tuple[str, str]]:
    """(question, answer) for the whole universe, in a fixed order."""
    out = []
    for op in OPERATORS:
        for a in range(1, 10):
            for b in range(1, 10):
                if op == "-" and a < b:
                    continue
                out.append((f"What is {a} {op} {b}?", str(apply(a, op, b))))
    return out


def split(held_out: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out): held-out whole unordered pairs until it has >= `held_out` problems."""
    groups: dict[tuple, list] = {}
    for question, answer in problems():
        _, a, op, b = question.rstrip("?").rsplit(" ", 3)
        groups.setdefault((op, min(a, b), max(a, b)), []).append((question, answer))
    keys = sorted(groups)
    random.Random(SPLIT_SEED).shuffle(keys)
    test, train = [], []
    for key in keys:
        (test if len(test) < held_out else train).extend(groups[key])
    return train, test


def write_files(folder: Path, held_out: int) -> tuple[Path, Path]:
    """train.jsonl ({"prompt", "response"}) and held_out.jsonl ({"prompt", "answer"}) in
    `folder`: the layouts `python -m ctopd_jax.train` (data.path) and `python -m
    ctopd_jax.evaluate --dataset ... --system-prompt ...` read. The response, the bare answer,
    is what gkd's off-policy share (1 - gkd_lambda) trains on; on-policy objectives sample
    their own."""
    train, test = split(held_out)
    folder.mkdir(parents=True, exist_ok=True)
    train_file, test_file = folder / "train.jsonl", folder / "held_out.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": q, "response": a}) + "\n" for q, a in train))
    test_file.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in test))
    return train_file, test_file
