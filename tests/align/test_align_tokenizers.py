"""End to end on real tokenizers and random text: re-tokenize both sides, align, and compare with
the brute-force oracle on the byte views of the tokens that land in the response."""
from hypothesis import given, settings, strategies as st

from _align_oracle import strict_oracle
from ctopd_jax.align import strict_align
from ctopd_jax.tokenization import retokenize_pair

TEXT = st.text(alphabet=st.sampled_from(list("0123456789+-*=()., ?:abcdefxyzTQA\n") +
                                        ["é", "数", "😀", "Ü"]), max_size=60)


def _check(teacher_side, student_side, texts):
    t, s = retokenize_pair(teacher_side, student_side,
                           [teacher_side.render_prompt("q")] * len(texts),
                           [student_side.render_prompt("q")] * len(texts), texts)
    got = strict_align(t, s)
    for b in range(len(texts)):
        pieces = []
        for side, batch in ((teacher_side, t), (student_side, s)):
            lo = batch.resp_offsets[b]
            ids = batch.resp_ids[lo:batch.resp_offsets[b + 1]]
            data = [side.token_bytes[i][1:] if batch.resp_stripped[lo + k] else side.token_bytes[i]
                    for k, i in enumerate(ids)]
            pieces.append((data, [not side.is_added[i] for i in ids]))
        want = strict_oracle(pieces[0][0], pieces[1][0], pieces[0][1], pieces[1][1])
        sel = got.pair_sample == b
        if want is None:
            assert got.byte_mismatch[b] and not sel.any()
            continue
        mine = list(zip((got.teacher_rows[sel] - t.row_base[b]).tolist(),
                        (got.student_rows[sel] - s.row_base[b]).tolist()))
        assert mine == want[0] + [(len(pieces[0][0]), len(pieces[1][0]))]


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_tiny_pair(texts, tiny_bpe, tiny_unigram):
    _check(tiny_bpe, tiny_unigram, texts)


@settings(max_examples=15, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_real_pair(texts, qwen, llama):
    _check(qwen, llama, texts)
