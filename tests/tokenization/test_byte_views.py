"""Byte views against independent references: transformers' GPT-2 table and the tokenizers'
own decoders (SPEC §2)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ctopd_jax.tokenization.byte_view import gpt2_printable_table


def test_gpt2_table_matches_transformers():
    assert gpt2_printable_table() == bytes_to_unicode()


@pytest.mark.parametrize("name", ["tiny_bpe", "tiny_unigram", "qwen", "llama"])
def test_token_bytes_match_tokenizer_decode(name, request):
    """Every id whose bytes are valid UTF-8 on their own decodes (tokenizers' decoder) to them."""
    side = request.getfixturevalue(name)
    rng = np.random.default_rng(0)
    ids = rng.choice(side.vocab_size, size=min(side.vocab_size, 3000), replace=False)
    checked = 0
    for i in ids.tolist():
        data = side.token_bytes[i]
        if side.is_added[i]:
            assert data == side.tokenizer.id_to_token(i).encode()
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        # decode a known anchor before the token so a SentencePiece decoder keeps its space
        anchor = side.encode("x")
        decoded = side.decode(anchor + [i], skip_special_tokens=False)
        assert decoded == side.decode(anchor) + text, (i, side.tokenizer.id_to_token(i))
        checked += 1
    assert checked > len(ids) // 2


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=40).filter(lambda t: not t[:1].isspace()))
def test_response_bytes_round_trip_text(text, tiny_bpe, tiny_unigram, qwen, llama):
    """The response's byte view is the text's UTF-8 (NFC for Qwen2.5; dummy prefix removed).
    Texts starting with whitespace are left out: the prompt's trailing newline may merge with
    them, which the SPEC prompt_len formula then assigns to one side or the other."""
    import unicodedata

    from ctopd_jax.tokenization.retokenize import retokenize

    for side in (tiny_bpe, tiny_unigram, qwen, llama):
        batch = retokenize(side, [side.render_prompt("hi")], [text])
        expect = unicodedata.normalize("NFC", text) if side is qwen else text
        assert batch.resp_bytes[0] == expect.encode(), side.name
        assert int(batch.resp_byte_len.sum()) == len(expect.encode())
