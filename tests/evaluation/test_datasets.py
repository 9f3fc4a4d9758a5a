"""Dataset loaders on fixtures in the real layouts, and file:line errors on malformed rows."""
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctopd_jax.data.eval_sets import MATH_SYSTEM_PROMPT, DatasetError, load_dataset

FIXTURES = Path(__file__).parent / "fixtures"


def test_math500_directory_layout():
    ds = load_dataset(FIXTURES / "math500")
    assert len(ds) == 3 and not ds.answer_fallbacks
    assert ds.system_prompt == MATH_SYSTEM_PROMPT
    first = ds.problems[0]
    assert first.id == "test/precalculus/807.json"
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.problem.startswith("Convert the point $(0,3)$")
    assert ds.problems[2].answer == "11\\sqrt2"


def test_gsm8k_layout_takes_text_after_hashes_and_keeps_line_numbers():
    ds = load_dataset(FIXTURES / "gsm8k_test.jsonl")
    assert [p.answer for p in ds.problems] == ["18", "3", "70,000"]
    assert ds.answer_fallbacks
    assert ds.problems[2].source.endswith("gsm8k_test.jsonl:4")  # line 3 is blank


def test_parquet_chat_messages_with_verl_ground_truth():
    ds = load_dataset(FIXTURES / "dapo_prompts.parquet")
    assert [p.answer for p in ds.problems] == ["5", "\\frac{5}{6}"]
    assert [p.id for p in ds.problems] == ["a1", "a2"]
    assert ds.problems[1].messages[0] == {"role": "system", "content": "You are a careful solver."}
    assert ds.problems[1].problem == "Compute $\\frac{1}{2}+\\frac{1}{3}$."


def test_parquet_string_prompts():
    ds = load_dataset(FIXTURES / "string_prompts.parquet")
    assert [(p.problem, p.answer, p.messages) for p in ds.problems] == [
        ("What is 7*6?", "42", None), ("What is 1/4 as a decimal?", "0.25", None)]


def test_limit():
    assert len(load_dataset(FIXTURES / "math500", limit=2)) == 2


def _write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("lines, line_no, words", [
    (['{"problem": "p", "answer": "1"}', '{"problem": "q"}'], 2, "missing field 'answer'"),
    (['{"problem": "p", "answer": "1"}', '{"problem": "q", "answer": 1', ''], 2, "not valid JSON"),
    (['{"problem": "p", "answer": "1"}', '["a list"]'], 2, "expected a JSON object"),
    (['{"problem": "p", "answer": "1"}', '{"problem": "", "answer": "2"}'], 2, "non-empty"),
    (['{"question": "q", "answer": "#### 4"}', '{"question": "r", "answer": "no final line"}'], 2,
     "'#### "),
    (['{"prompt": [{"role": "user"}], "answer": "3"}'], 1, "prompt[0]"),
])
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, lines, line_no, words):
    path = _write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    message = str(info.value)
    assert f"{path}:{line_no}:" in message
    assert words in message


def test_malformed_parquet_row_names_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "ok", "answer": "1"}, {"prompt": "no answer here", "answer": None}]), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet:row 2: no reference answer"):
        load_dataset(path)


def test_unknown_name_and_unknown_layout(tmp_path):
    with pytest.raises(DatasetError, match="neither a dataset name"):
        load_dataset("math_nonexistent")
    path = _write(tmp_path, "odd.jsonl", [json.dumps({"text": "x"})])
    with pytest.raises(DatasetError, match="cannot tell the layout"):
        load_dataset(path)


def test_gsm_symbolic_is_deterministic_and_graded_by_its_own_answers():
    a = load_dataset("gsm_symbolic:5", seed=3)
    b = load_dataset("gsm_symbolic:5", seed=3)
    assert [p.problem for p in a.problems] == [p.problem for p in b.problems]
    import reasoning_gym  # independent check against the generator itself
    gen = reasoning_gym.create_dataset("gsm_symbolic", size=5, seed=3)
    assert [p.answer for p in a.problems] == [str(item["answer"]) for item in gen]


def test_champ_registry_set():
    full = load_dataset("champ")
    assert len(full) == 270  # the package's published size
    numeric = load_dataset("champ:numeric")
    assert 0 < len(numeric) < 270
    by_id = {p.id: p for p in full.problems}
    assert by_id["P_Combinatorics_1"].answer == "239"


@pytest.mark.parametrize("name,module", [("gsm_symbolic:5", "reasoning_gym"),
                                         ("champ", "champ_dataset")])
def test_a_named_set_without_the_eval_extra_names_the_extra(monkeypatch, name, module):
    import ctopd_jax.data.eval_sets as datasets
    datasets._champ_problems.cache_clear()
    monkeypatch.setitem(sys.modules, module, None)   # what an install without `[eval]` sees
    with pytest.raises(DatasetError, match=rf"needs the package {module}: pip install -e '\.\[eval\]'"):
        load_dataset(name)
    datasets._champ_problems.cache_clear()


def test_demo_task_dataset_uses_its_own_grader():
    from ctopd_jax.demo import task

    ds = load_dataset("demo")
    held_out = task.split("held_out")
    assert len(ds) == len(held_out) and ds.system_prompt is None
    p = held_out[0]
    assert ds.grade_fn(p.solution, ds.problems[0].answer)
    assert not ds.grade_fn(p.solution.replace(f"is {p.answer}", f"is {p.answer + 1}"),
                           ds.problems[0].answer)
