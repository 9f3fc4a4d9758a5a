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
    rows = [{"prompt": f"{g}-{k}"} for g, n in enumerate(sizes) for k in range(n)]
    prompts = load_prompts(write_jsonl(tmp_path / "g.jsonl", rows))
    return prompts, [p.text.split("-")[0] for p in prompts]


@pytest.mark.parametrize("sizes,batch_size,shares", [
    ([9, 9], 4, [2, 2]),
    ([73, 72], 32, [16, 16]),        # 16.11 and 15.89
    ([3, 32, 1, 5], 30, [2, 23, 1, 4]),   # 2.20, 23.41, 0.73, 3.66
    ([3, 32, 1, 5], 7, [1, 4, 1, 1]),     # each group at least one
    ([10], 3, [3]),
])
def test_every_batch_takes_a_fixed_share_of_each_group_and_each_group_turns_over_whole(
        tmp_path, sizes, batch_size, shares):
    prompts, groups = _labelled(tmp_path, sizes)
    stream = PromptStream(prompts, batch_size=batch_size, seed=3, groups=groups)
    batches = [[p.text for p in stream.next_batch()] for _ in range(2 * max(sizes))]
    drawn = {str(g): [] for g in range(len(sizes))}
    for batch in batches:
        labels = [t.split("-")[0] for t in batch]
        assert [labels.count(str(g)) for g in range(len(sizes))] == shares
        for t in batch:
            drawn[t.split("-")[0]].append(t)
    for g, n in enumerate(sizes):   # each group's epoch: each of its rows once, then a new order
        first, second = drawn[str(g)][:n], drawn[str(g)][n:2 * n]
        assert sorted(first) == sorted(second) == sorted(f"{g}-{k}" for k in range(n))
        assert n < 4 or first != second


def test_a_batch_smaller_than_the_groups_is_refused(tmp_path):
    prompts, groups = _labelled(tmp_path, [2, 2, 2])
    with pytest.raises(DataError, match="batch size 2 is smaller than the 3 groups"):
        PromptStream(prompts, batch_size=2, groups=groups)


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
