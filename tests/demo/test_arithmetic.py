"""The real demo's task files: the universe, answers checked by hand, a held-out split with no
unordered pair on both sides, and files the plain commands read."""
import json

from ctopd_jax.common.routing import route_rows
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.demo import arithmetic


def test_the_universe_and_some_answers_by_hand():
    answers = dict(arithmetic.problems())
    assert len(answers) == 81 + 45 + 81   # a + b, a - b with a >= b, a * b over 1..9
    assert answers["What is 7 * 8?"] == "56"
    assert answers["What is 9 - 9?"] == "0"
    assert answers["What is 9 + 9?"] == "18"
    assert "What is 3 - 5?" not in answers


def test_held_out_pairs_are_never_in_training():
    train, test = arithmetic.split(60)
    assert len(test) >= 60 and len(train) + len(test) == 207

    def pairs(rows):
        out = set()
        for question, _ in rows:
            _, _, a, op, b = question.rstrip("?").split(" ")
            out.add((op, frozenset((a, b))))
        return out

    assert not pairs(train) & pairs(test)
    assert arithmetic.split(60) == (train, test)   # fixed, seeded


def test_files_read_as_a_prompt_set_and_an_evaluation_set(tmp_path):
    train_file, test_file = arithmetic.write_files(tmp_path, 60)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    assert len(rows) == 207 - len(arithmetic.split(60)[1])
    answers = dict(arithmetic.problems())     # gkd's off-policy share trains on the bare answer
    assert all(set(r) == {"prompt", "response"} and r["response"] == answers[r["prompt"]] for r in rows)
    dataset = load_dataset(test_file)
    assert dataset.answer_fallbacks   # bare numbers are graded
    assert {p.problem for p in dataset.problems} == {q for q, _ in arithmetic.split(60)[1]}


def test_with_two_teachers_the_training_rows_name_them_in_turn(tmp_path):
    train_file, _ = arithmetic.write_files(tmp_path, 60, ("small", "large"))
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    routed = route_rows(rows, ["small", "large"])      # the trainer's routing, no default teacher
    assert routed == {"small": list(range(0, len(rows), 2)), "large": list(range(1, len(rows), 2))}
    one, _ = arithmetic.write_files(tmp_path / "one", 60, ("only",))
    assert all("teacher" not in json.loads(line) for line in one.read_text().splitlines())


def test_the_three_digit_task_answers_by_hand_and_splits_apart():
    answers = dict(arithmetic.problems("three-digit-differences"))
    assert len(answers) == 1200
    for question, answer in answers.items():        # every problem by hand: a - b, 100 <= b <= a <= 999
        _, _, a, op, b = question.rstrip("?").split(" ")
        assert op == "-" and 100 <= int(b) <= int(a) <= 999 and answer == str(int(a) - int(b))
    train, test = arithmetic.split(60, "three-digit-differences")
    assert len(test) == 60 and not {q for q, _ in train} & {q for q, _ in test}
    assert arithmetic.problems("three-digit-differences")[:5] == list(answers.items())[:5]   # seeded
