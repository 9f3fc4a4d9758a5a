"""Vocabulary overlap (SPEC §3) on the real pair (paper Table 4) and rule details."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ctopd_jax.tokenization import NoOverlapError, load_tokenizer_side, overlap_map


def test_real_pair_matches_paper_table4(qwen, llama):
    got = overlap_map(qwen, llama)
    assert got.rule == "string"
    assert (got.teacher_vocab_size, got.student_vocab_size, got.shared) == (151_665, 128_256,
                                                                           109_567)
    assert round(100 * got.jaccard, 2) == 64.32
    assert got.eos_appended and (got.s_ids[-1], got.t_ids[-1]) == (llama.eos_id, qwen.eos_id)


def test_string_rule_against_independent_count(qwen, llama):
    """Intersect the raw vocab dicts with Ġ -> ▁ keys, written out here."""
    t = {k.replace("Ġ", "▁"): v for k, v in qwen.tokenizer.get_vocab(True).items()}
    s = {k.replace("Ġ", "▁"): v for k, v in llama.tokenizer.get_vocab(True).items()}
    common = sorted(t.keys() & s.keys(), key=lambda k: s[k])
    got = overlap_map(qwen, llama)
    assert got.s_ids[:-1].tolist() == [s[k] for k in common]
    assert got.t_ids[:-1].tolist() == [t[k] for k in common]


def test_byte_rule_pairs_equal_bytes_and_excludes_specials(tiny_bpe, tiny_unigram):
    got = overlap_map(tiny_bpe, tiny_unigram)
    assert got.rule == "bytes" and got.shared == len(got.s_ids) == len(got.t_ids)
    for s, t in zip(got.s_ids[:-1], got.t_ids[:-1]):
        assert tiny_unigram.token_bytes[s] == tiny_bpe.token_bytes[t]
        assert not tiny_unigram.is_added[s] and not tiny_bpe.is_added[t]
    # independent: byte strings held by exactly one regular piece on each side (a <0xHH>
    # byte-fallback twin does not make a regular single-byte piece ambiguous)
    import re
    from collections import Counter

    def unique_keys(side):
        regular, fallback = Counter(), Counter()
        for i, b in enumerate(side.token_bytes):
            if side.is_added[i] or not b:
                continue
            piece = side.tokenizer.id_to_token(i)
            (fallback if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece) else regular)[b] += 1
        return {b for b in regular.keys() | fallback.keys()
                if regular[b] == 1 or (regular[b] == 0 and fallback[b] == 1)}

    assert got.shared - 1 == len(unique_keys(tiny_unigram) & unique_keys(tiny_bpe))
    paired = {tiny_unigram.tokenizer.id_to_token(int(s)) for s in got.s_ids}
    assert set("0123456789+-=().") <= paired  # the regular pieces, not their <0xHH> twins
    assert (got.s_ids[-1], got.t_ids[-1]) == (tiny_unigram.eos_id, tiny_bpe.eos_id)


def _word_level(tmp_path, name, words):
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    d = tmp_path / name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return load_tokenizer_side(d)


def test_no_overlap_is_a_clear_error(tmp_path):
    a = _word_level(tmp_path, "a", ["a", "b"])
    b = _word_level(tmp_path, "b", ["c", "d"])
    with pytest.raises(NoOverlapError, match="share no token"):
        overlap_map(a, b, rule="bytes")
    with pytest.raises(ValueError, match="rule"):
        overlap_map(a, b, rule="fuzzy")
