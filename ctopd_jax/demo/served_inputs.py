"""The demo's teacher inputs, as the trainer builds them (SPEC §1 step 3, teacher side).

Each input is the teacher's chat rendering of a demo prompt (add_generation_prompt) + a response
+ the teacher's EOS; `start` is the first response position. Responses are the reference
solutions with, at rate `corrupt`, one result digit replaced, as an untrained student writes
them, so the served and local teachers are compared on unlikely tokens too. Used by the
real-server test and benchmarks/served_teacher.py (64 rollouts = one demo step).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import ctopd_jax
from ctopd_jax.demo import task

DEMO_TEACHER = Path(ctopd_jax.__file__).parent / "assets" / "demo" / "teacher"


def demo_teacher_inputs(count: int, seed: int = 0, corrupt: float = 0.5,
                        teacher_dir=DEMO_TEACHER) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoTokenizer   # optional dependency (the test extras)

    tokenizer = AutoTokenizer.from_pretrained(str(teacher_dir))
    rng = np.random.default_rng(seed)
    sequences, starts = [], []
    for problem in task.sample(task.split("train"), count, rng):
        text = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = problem.solution
        if rng.random() < corrupt:
            wrong = str((problem.answer + int(rng.integers(1, 9))) % 10)
            response = response[:-2] + wrong + "."
        ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        sequences.append(prompt + list(ids) + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    return sequences, starts
