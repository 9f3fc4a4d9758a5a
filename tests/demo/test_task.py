"""The demo task: hand-written problems and verdicts, split determinism and disjointness."""
import json

import numpy as np
import pytest

from ctopd_jax.demo import data, task


@pytest.mark.parametrize("response, answer, verdict", [
    ("(7-5)=2, 2+3=5. The answer is 5.", 5, True),
    ("(7-5)=2, 2+3=5. The answer is 5.", "5", True),
    ("(7-5)=2, 2+3=6. The answer is 6.", 5, False),
    ("The answer is 4. No wait. The answer is 5.", 5, True),     # the LAST statement counts
    ("The answer is 5. No wait. The answer is 4.", 5, False),
    ("(7-5)=2, 2+3=5.", 5, False),                             # no final statement
    ("(7-5)=2, 2+3=5. The answer is", 5, False),               # truncated
    ("The answer is 15.", 5, False),                             # whole number, not a suffix
    ("The answer is5.", 5, True),
    ("", 0, False),
])
def test_grader_verdicts(response, answer, verdict):
    assert task.grade(response, answer) is verdict


def test_extract_answer_and_accuracy():
    assert task.extract_answer("blah The answer is 12.") == 12
    assert task.extract_answer("no answer here 3") is None
    assert task.accuracy(["The answer is 1.", "The answer is 3."], [1, 2]) == 0.5
    with pytest.raises(ValueError, match="empty"):
        task.accuracy([], [])


@pytest.mark.parametrize("problem, prompt, solution", [
    (task.Problem(7, "-", 5, "+", 3), "Compute 7 - 5 + 3.", "(7-5)=2, 2+3=5. The answer is 5."),
    (task.Problem(0, "+", 9, "-", 9), "Compute 0 + 9 - 9.", "(0+9)=9, 9-9=0. The answer is 0."),
    (task.Problem(4, "+", 4, "+", 1), "Compute 4 + 4 + 1.", "(4+4)=8, 8+1=9. The answer is 9."),
])
def test_prompt_and_solution_by_hand(problem, prompt, solution):
    assert problem.prompt == prompt and problem.solution == solution
    assert task.grade(problem.solution, problem.answer)


def test_universe_brute_force():
    """Every problem with single-digit operands, partial result and answer, counted by hand."""
    expected = set()
    for a in range(10):
        for b in range(10):
            for c in range(10):
                for op1, first in (("+", a + b), ("-", a - b)):
                    for op2, ans in (("+", first + c), ("-", first - c)):
                        if 0 <= first <= 9 and 0 <= ans <= 9:
                            expected.add((a, op1, b, op2, c))
    universe = task.all_problems()
    assert len(universe) == len(expected) == 1210
    assert {(p.a, p.op1, p.b, p.op2, p.c) for p in universe} == expected


def test_splits_are_deterministic_disjoint_and_cover_the_universe():
    train, held = task.split("train"), task.split("held_out")
    assert len(held) == task.HELD_OUT_SIZE and len(train) + len(held) == 1210
    assert not set(train) & set(held)
    assert task.split("held_out") == held and task.split("train") == train
    other = task.split("held_out", seed=task.SPLIT_SEED + 1)
    assert set(other) != set(held)          # the split really depends on the seed
    # every single-step fact of the held-out set also occurs in training: it tests the skill
    facts = lambda ps: {(p.a, p.op1, p.b) for p in ps} | {(p.first, p.op2, p.c) for p in ps}
    assert facts(held) <= facts(train)


def test_split_rejects_bad_names():
    with pytest.raises(ValueError, match="split"):
        task.split("test")
    with pytest.raises(ValueError, match="held_out_size"):
        task.split("train", held_out_size=0)


def test_sample_is_seeded():
    train = task.split("train")
    a = task.sample(train, 16, np.random.default_rng(3))
    b = task.sample(train, 16, np.random.default_rng(3))
    assert a == b and all(p in set(train) for p in a)


def test_prompt_file_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("CTOPD_JAX_CACHE", str(tmp_path))
    path = data.prompt_file("held_out")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    held = task.split("held_out")
    assert [r["prompt"] for r in rows] == [p.prompt for p in held]
    assert all(task.grade(r["response"], r["answer"]) for r in rows)
    with pytest.raises(ValueError, match="demo split"):
        data.prompt_file("dev")
