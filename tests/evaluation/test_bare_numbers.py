"""A task that asks for "only the number", as a user writes it: a prompt+answer JSONL graded
with bare-number answers accepted, and `evaluate --system-prompt` in place of the math prompt
every file otherwise gets."""
import json
from pathlib import Path

import pytest

from ctopd_jax import evaluate
from ctopd_jax.data.eval_sets import MATH_SYSTEM_PROMPT, build_prompt, load_dataset
from ctopd_jax.grading import MathGrader, extract_answer
from ctopd_jax.tokenization.side import load_tokenizer_side

STUDENT = Path(__file__).resolve().parents[2] / "ctopd_jax" / "assets" / "demo" / "student"


@pytest.mark.parametrize("response, expected", [
    ("56", "56"), (" 56.\n", "56"), ("-7", "-7"), ("3.5", "3.5"), ("$1,200", "$1,200"),
    ("56 apples", None), ("7 * 8 = 56", None), ("To add 7 and 8, we need", None), ("", None),
])
def test_a_response_that_is_one_number_is_its_answer_with_fallbacks(response, expected):
    assert extract_answer(response, fallbacks=True) == expected
    assert extract_answer(response, fallbacks=False) is None   # MATH sets stay boxed-only


def test_the_grader_scores_bare_numbers_of_a_prompt_file(tmp_path):
    rows = [{"prompt": "What is 7 * 8?", "answer": "56"}, {"prompt": "What is 9 - 4?", "answer": 5}]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = load_dataset(path)
    assert dataset.answer_fallbacks
    with MathGrader() as grader:
        graded = grader.grade_many(["56", "The answer is 4."], [p.answer for p in dataset.problems],
                                   dataset.answer_fallbacks)
    assert [g.correct for g in graded] == [True, False]
    assert graded[0].extracted == "56"


@pytest.mark.parametrize("flag, system", [(["--system-prompt", "Answer with only the number."],
                                           "Answer with only the number."),
                                          (["--system-prompt", ""], None), ([], MATH_SYSTEM_PROMPT)])
def test_evaluate_system_prompt_replaces_the_math_prompt(flag, system, tmp_path, monkeypatch):
    path = tmp_path / "held_out.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    seen = {}

    def fake_evaluate_model(model, tokenizer, dataset, **kwargs):   # the prompts, no generation
        seen["system"] = dataset.system_prompt
        seen["prompt"] = build_prompt(tokenizer, dataset.problems[0], dataset.system_prompt)
        return evaluate.EvalReport(str(path), 1, 1, 0.0, 0.0, [], [])

    monkeypatch.setattr(evaluate, "evaluate_model", fake_evaluate_model)
    evaluate.main(["--checkpoint", str(STUDENT), "--dataset", str(path), *flag])
    assert seen["system"] == system
    side = load_tokenizer_side(STUDENT)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": "What is 2 + 2?"}]
    assert seen["prompt"] == side.render_chat(messages)
