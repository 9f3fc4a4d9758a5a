"""Prompt files: jsonl / parquet parsing, bad rows with file:line, deterministic resumable order."""
import json

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctopd_jax.data.prompts import DataError, PromptStream, load_prompts


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_prompt_and_messages(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ])
    prompts = load_prompts(f, system_prompt="SYS")
    assert prompts[0].messages == ({"role": "system", "content": "SYS"}, {"role": "user", "content": "What is 2+2?"})
    assert prompts[0].extra == {"answer": "4"}
    # an existing system turn is kept, not doubled
    assert prompts[1].messages[0] == {"role": "system", "content": "be brief"}
    assert prompts[1].text == "hi"
    assert prompts[1].source.endswith("p.jsonl:2")


def test_parquet_messages_column(tmp_path):
    table = pa.table({"messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                      "answer": ["1", "2"]})
    pq.write_table(table, tmp_path / "p.parquet")
    prompts = load_prompts(tmp_path / "p.parquet", prompt_key="messages")
    assert [p.text for p in prompts] == ["a", "b"]
    assert prompts[1].extra["answer"] == "2"


@pytest.mark.parametrize("bad,match", [
    ("{not json", "p.jsonl:2: not valid JSON"),
    ({"question": "x"}, "p.jsonl:2: no 'prompt' column"),
    ({"prompt": "  "}, "p.jsonl:2: column 'prompt' is an empty string"),
    ({"prompt": 3}, "p.jsonl:2: column 'prompt' must be"),
    ({"messages": [{"role": "user"}]}, r"p.jsonl:2: messages\[0\] must be"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "must end with a user turn"),
    ([1, 2], "p.jsonl:2: expected a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad, match):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(DataError, match=match):
        load_prompts(f)


def test_bad_parquet_row_and_missing_file(tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", ""]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match="p.parquet:row 2"):
        load_prompts(tmp_path / "p.parquet")
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("prompt\na\n")
    with pytest.raises(DataError, match="unsupported extension"):
        load_prompts(tmp_path / "x.csv")


def _prompts(tmp_path, n=7):
    return load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(n)]))


def test_each_epoch_is_a_permutation_and_seed_decides_order(tmp_path):
    prompts = _prompts(tmp_path)
    stream = PromptStream(prompts, batch_size=7, seed=1)
    e1, e2 = [p.text for p in stream.next_batch()], [p.text for p in stream.next_batch()]
    assert sorted(e1) == sorted(e2) == sorted(f"q{i}" for i in range(7))
    assert e1 != e2  # a fresh permutation per epoch
    again = PromptStream(prompts, batch_size=7, seed=1)
    assert [p.text for p in again.next_batch()] == e1
    other = PromptStream(prompts, batch_size=7, seed=2)
    assert [p.text for p in other.next_batch()] != e1
    plain = PromptStream(prompts, batch_size=3, shuffle=False)
    assert [p.text for p in plain.next_batch()] == ["q0", "q1", "q2"]


def test_restored_stream_continues_exactly(tmp_path):
    prompts = _prompts(tmp_path)
    full = PromptStream(prompts, batch_size=3, seed=5)
    reference = [[p.text for p in full.next_batch()] for _ in range(6)]
    first = PromptStream(prompts, batch_size=3, seed=5)
    for _ in range(2):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))  # it must survive a JSON round trip
    resumed = PromptStream(prompts, batch_size=3, seed=5)
    resumed.restore(state)
    assert [[p.text for p in resumed.next_batch()] for _ in range(4)] == reference[2:]


def _labelled(tmp_path, sizes):
    rows = [{"prompt": f"{g}{k}"} for g, n in enumerate(sizes) for k in range(n)]
    prompts = load_prompts(write_jsonl(tmp_path / "g.jsonl", rows))
    return prompts, [p.text[0] for p in prompts]


def test_equal_groups_fill_every_batch_equally_and_each_epoch_once(tmp_path):
    prompts, groups = _labelled(tmp_path, [9, 9])
    stream = PromptStream(prompts, batch_size=4, seed=3, groups=groups)
    rows = [p.text for _ in range(9) for p in stream.next_batch()]   # two epochs of 18
    for b in range(9):
        assert sorted(t[0] for t in rows[4 * b:4 * b + 4]) == ["0", "0", "1", "1"]
    assert sorted(rows[:18]) == sorted(rows[18:]) == sorted(p.text for p in prompts)
    assert rows[:18] != rows[18:]   # each group reshuffled per epoch


def test_unequal_groups_keep_their_share_of_every_batch(tmp_path):
    sizes = [3, 32, 1, 5]
    prompts, groups = _labelled(tmp_path, sizes)
    n = sum(sizes)
    for batch_size in (1, 7, 30, 41):
        stream = PromptStream(prompts, batch_size=batch_size, seed=0, groups=groups)
        batches = [[p.text for p in stream.next_batch()] for _ in range(3 * n // batch_size)]
        for batch in batches:
            labels = [t[0] for t in batch]
            for g, size in enumerate(sizes):   # a random share of 30 from 32/41 strays by ~3
                assert abs(labels.count(str(g)) - batch_size * size / n) < 2
        rows = [t for b in batches for t in b]
        assert sorted(rows[:n]) == sorted(p.text for p in prompts)   # an epoch: each row once


def test_grouped_stream_resumes_exactly(tmp_path):
    prompts, groups = _labelled(tmp_path, [5, 8])
    full = PromptStream(prompts, batch_size=3, seed=5, groups=groups)
    reference = [[p.text for p in full.next_batch()] for _ in range(9)]
    first = PromptStream(prompts, batch_size=3, seed=5, groups=groups)
    for _ in range(4):
        first.next_batch()
    resumed = PromptStream(prompts, batch_size=3, seed=5, groups=groups)
    resumed.restore(json.loads(json.dumps(first.state())))
    assert [[p.text for p in resumed.next_batch()] for _ in range(5)] == reference[4:]


def test_one_group_is_grains_shuffled_repeat_as_before(tmp_path):
    prompts = _prompts(tmp_path)
    order = grain.MapDataset.source(prompts).shuffle(seed=2).repeat(None)
    expected = [order[i].text for i in range(15)]
    for groups in (None, ["t"] * len(prompts)):
        stream = PromptStream(prompts, batch_size=3, seed=2, groups=groups)
        assert [p.text for _ in range(5) for p in stream.next_batch()] == expected
