"""inspect_pair CLI: numbers against the library on the same data, input formats, errors."""
import json

import pytest

from ctopd_jax import inspect_pair
from ctopd_jax.align import ByteMismatchError, strict_align
from ctopd_jax.tokenization import retokenize_pair

LINES = ["7 + 5 = 12. 12 - 3 = 9. The answer is 9.", "Question: What is 12 plus 7? Answer: 19"]


def run(capsys, *args):
    code = inspect_pair.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_report_on_jsonl_matches_a_direct_count(tmp_path, capsys, tiny_bpe, tiny_unigram):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps({"response": r}) for r in LINES) + "\n")
    code, out, _ = run(capsys, "--teacher", "tiny_bpe", "--student", "tiny_unigram",
                       "--text", str(path), "--json", "--show", "1")
    assert code == 0
    report = json.loads(out)
    assert report["overlap"]["V_T"] == tiny_bpe.vocab_size
    assert report["overlap"]["V_S"] == tiny_unigram.vocab_size
    prompt = "Solve the problem."
    t, s = retokenize_pair(tiny_bpe, tiny_unigram, [tiny_bpe.render_prompt(prompt)] * 2,
                           [tiny_unigram.render_prompt(prompt)] * 2, LINES)
    a = report["alignment"]
    assert a["student_response_tokens"] == int(s.response_lens.sum())
    assert a["teacher_response_tokens"] == int(t.response_lens.sum())
    assert a["strict_pairs"] == strict_align(t, s).num_pairs
    assert "<|eot_id|>" in a["view"]["student"] and "<|im_end|>" in a["view"]["teacher"]


def test_plain_text_and_human_output(tmp_path, capsys):
    path = tmp_path / "r.txt"
    path.write_text("\n".join(LINES) + "\n")
    code, out, _ = run(capsys, "--teacher", "tiny_bpe", "--student", "tiny_unigram",
                       "--text", str(path), "--show", "0", "--no-color")
    assert code == 0 and "strict coverage student" in out and "Jaccard" in out
    assert out.count("\n") >= 6


@pytest.mark.parametrize("content,message", [
    ("", "no non-empty line"), ('{"prompt": "x"}\n', "no string 'response' or 'text'"),
    ('{"response": "x"\n', "is not JSON")])
def test_bad_text_files(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, _, err = run(capsys, "--teacher", "tiny_bpe", "--student", "tiny_unigram",
                       "--text", str(path))
    assert code == 2 and message in err


def test_missing_tokenizer_and_file(tmp_path, capsys):
    code, _, err = run(capsys, "--teacher", str(tmp_path / "none"), "--student", "tiny_unigram")
    assert code == 2 and "no such directory" in err
    code, _, err = run(capsys, "--teacher", "tiny_bpe", "--student", "tiny_unigram",
                       "--text", str(tmp_path / "none.txt"))
    assert code == 2 and "no such file" in err


def test_text_that_does_not_round_trip(qwen, llama):
    """Qwen2.5 normalizes to NFC, Llama-3 does not: a decomposed accent differs in bytes."""
    text = "cafe\u0301 costs 3 euros"
    t, s = retokenize_pair(qwen, llama, [qwen.render_prompt("q")], [llama.render_prompt("q")],
                           [text])
    counted = strict_align(t, s)
    assert counted.byte_mismatch.tolist() == [True] and counted.num_pairs == 0
    assert counted.num_student_response_tokens == int(s.response_lens.sum())
    with pytest.raises(ByteMismatchError, match="sample 0: .* differ at byte 3"):
        strict_align(t, s, on_byte_mismatch="raise")


def test_token_text_shows_partial_characters_as_bytes_not_replacement_marks():
    emoji = "🙂".encode()
    assert inspect_pair.token_text(emoji) == "🙂"
    assert [inspect_pair.token_text(emoji[:2]), inspect_pair.token_text(emoji[2:])] == ["<f0><9f>", "<99><82>"]
    assert inspect_pair.token_text("a\nb".encode()) == "a\\nb"


def test_no_mismatch_groups_says_none(tmp_path, capsys):
    path = tmp_path / "r.txt"
    path.write_text("7 + 5 = 12.\n")
    code, out, _ = run(capsys, "--teacher", "tiny_bpe", "--student", "tiny_bpe", "--text", str(path))
    line = next(x for x in out.splitlines() if x.startswith("mismatch groups"))
    assert code == 0 and line.endswith("none (every token is in a strict pair)")
