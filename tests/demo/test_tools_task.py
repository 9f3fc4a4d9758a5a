"""The demo's tool-use task (demo/tools_task.py): splits, the exact transcript format, the
calculator, the grader, the named sources and the committed tool-use character pair."""
import json

import numpy as np
import pytest

from ctopd_jax.common import sources
from ctopd_jax.demo import tools_task
from ctopd_jax.demo.pretrain_tools import TOOLS_SEQ_LEN, tools_sft_batch
from ctopd_jax.tokenization import IGNORE_INDEX, load_tokenizer_side


def test_splits_are_disjoint_fixed_and_sized():
    train, held = tools_task.split("train"), tools_task.split("held_out")
    assert len(held) == tools_task.HELD_OUT_SIZE == 200
    assert len(train) + len(held) == len(tools_task.all_problems()) == 8100 + 8100 + 4095
    assert not set(train) & set(held)
    assert held == tools_task.split("held_out")                      # seeded: the same every time
    assert {p.op for p in held} == set(tools_task.OPERATORS)
    assert all(10 <= p.a <= 99 and 10 <= p.b <= 99 and p.answer >= 0 for p in held)
    with pytest.raises(ValueError, match="split must be 'train' or 'held_out'"):
        tools_task.split("test")


def test_transcript_format_is_exact():
    p = tools_task.Problem(12, "*", 34)
    assert p.prompt == "Compute 12 * 34."
    assert p.answer == 408
    assert p.expert_turns == ["<calc>12*34</calc>", "The answer is 408."]
    assert p.observation == "<result>408</result>"
    assert p.transcript() == "<calc>12*34</calc><result>408</result>The answer is 408."
    assert p.to_row() == {"prompt": "Compute 12 * 34.", "answer": "408",
                          "expert_turns": ["<calc>12*34</calc>", "The answer is 408."],
                          "response": "<calc>12*34</calc><result>408</result>The answer is 408."}
    assert tools_task.Problem(50, "-", 50).transcript() == (
        "<calc>50-50</calc><result>0</result>The answer is 0.")


def test_calculator_parses_without_eval():
    assert tools_task.calculate("12*34") == 408
    assert tools_task.calculate(" 12 + 34 ") == 46
    assert tools_task.calculate("12-34") == -22
    assert tools_task.calculate("__import__('os')") is None
    assert tools_task.calculate("1*2*3") is None and tools_task.calculate("") is None
    assert tools_task.respond("<calc>12*34</calc>") == "<result>408</result>"
    assert tools_task.respond("<calc>12x34</calc>") == "<result>error</result>"
    assert tools_task.respond("The answer is 3.") is None
    assert tools_task.cut_after_call("<calc>1+2</calc>The") == "<calc>1+2</calc>"
    assert tools_task.cut_after_call("<calc>1+2</cal") is None


def test_grade_right_wrong_missing():
    assert tools_task.grade("<calc>12*34</calc><result>408</result>The answer is 408.", 408)
    assert tools_task.grade("The answer is 1. The answer is 408.", "408")   # the LAST one counts
    assert not tools_task.grade("<calc>12*34</calc><result>408</result>The answer is 418.", 408)
    assert not tools_task.grade("<calc>12*34</calc><result>408</result>", 408)   # missing


def test_sft_batch_supervises_the_assistant_turns_only():
    side = load_tokenizer_side("char")
    p = tools_task.Problem(99, "*", 99)      # the longest transcript
    ids, labels, mask = tools_sft_batch(side, [p])
    assert ids.shape == (1, TOOLS_SEQ_LEN)
    text = side.decode(ids[0][mask[0]], skip_special_tokens=False)
    assert text == ("<|bos|><|user|>Compute 99 * 99.<|end|><|assistant|>"
                    "<calc>99*99</calc><result>9801</result>The answer is 9801.<|end|>")
    supervised = labels[0][labels[0] != IGNORE_INDEX]
    assert side.decode(supervised, skip_special_tokens=False) == (
        "<calc>99*99</calc>The answer is 9801.<|end|>")


def test_named_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("CTOPD_JAX_CACHE", str(tmp_path))
    path = sources.resolve("prompts", "demo:tools_held_out", "data.path")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [p.to_row() for p in tools_task.split("held_out")]
    assert sources.resolve("prompts", "demo:held_out", "data.path").name == "held_out.jsonl"
    dataset = sources.resolve("dataset", "demo:tools_held_out", "--dataset")
    assert len(dataset) == 200
    first = tools_task.split("held_out")[0]
    assert dataset.problems[0].problem == first.prompt
    assert dataset.grade_fn(first.transcript(), dataset.problems[0].answer)
    with pytest.raises(ValueError, match="demo:char_tools_teacher"):
        sources.resolve("model", "demo:char_tools_nope", "model.student")


def test_committed_checkpoints_load_and_record_the_gap():
    from ctopd_jax.models.weights import load_hf_checkpoint

    recorded = {}
    for role in ("teacher", "student"):
        path = sources.resolve("model", f"demo:char_tools_{role}", "model.student")
        assert path.parent.name == "demo_char_tools"
        model, cfg = load_hf_checkpoint(path)
        side = load_tokenizer_side(str(path))
        assert cfg.vocab_size == side.vocab_size == load_tokenizer_side("char").vocab_size
        recorded[role] = json.loads((path / "pretrain.json").read_text())
    assert recorded["teacher"]["held_out_accuracy"] >= 0.9
    assert 0.1 <= recorded["student"]["held_out_accuracy"] <= 0.6


def test_teacher_writes_the_transcript_teacher_forced():
    """Every supervised token of a few held-out transcripts is the committed teacher's argmax."""
    import jax.numpy as jnp

    from ctopd_jax.models.weights import load_hf_checkpoint

    path = sources.resolve("model", "demo:char_tools_teacher", "model.teacher")
    model, _ = load_hf_checkpoint(path)
    side = load_tokenizer_side(str(path))
    ids, labels, mask = tools_sft_batch(side, tools_task.split("held_out")[:16])
    positions = jnp.broadcast_to(jnp.arange(TOOLS_SEQ_LEN), ids.shape)
    pred = np.asarray(model(jnp.asarray(ids), positions, jnp.asarray(mask)).argmax(-1))
    rows = labels != IGNORE_INDEX
    assert ((pred == labels) | ~rows).all(axis=1).mean() >= 0.9
