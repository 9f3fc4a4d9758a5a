"""The real Qwen2.5 -> Llama-3 pair on a few hundred GSM-style worked solutions
(reasoning-gym gsm_symbolic), checked against the brute-force oracle."""
import numpy as np
import pytest
import reasoning_gym

from _align_oracle import ATOM_REASONS, atoms_oracle, simct_oracle, strict_oracle
from ctopd_jax.align import mpopd_atoms, simct_segments, strict_align
from ctopd_jax.tokenization import retokenize_pair

NUM = 300


@pytest.fixture(scope="module")
def batch(qwen, llama):
    data = reasoning_gym.create_dataset("gsm_symbolic", size=NUM, seed=7)
    rows = [(x["question"], x["metadata"]["answer_cot"] + f"\n\\boxed{{{x['answer']}}}")
            for x in data]
    t_prompts = [qwen.render_prompt(q) for q, _ in rows]
    s_prompts = [llama.render_prompt(q) for q, _ in rows]
    teacher, student = retokenize_pair(qwen, llama, t_prompts, s_prompts, [r for _, r in rows])
    return teacher, student


def _pieces(side, batch, b):
    ids = batch.input_ids[b, batch.prompt_lens[b]:batch.prompt_lens[b] + batch.response_lens[b] - 1]
    return [side.token_bytes[i] for i in ids], [not side.is_added[i] for i in ids], ids


def test_strict_alignment_and_coverage(batch, qwen, llama):
    teacher, student = batch
    got = strict_align(teacher, student)
    assert got.num_byte_mismatch == 0
    pairs = 0
    for b in range(NUM):
        t, tp, _ = _pieces(qwen, teacher, b)
        s, sp, _ = _pieces(llama, student, b)
        want_pairs, _ = strict_oracle(t, s, tp, sp)
        sel = got.pair_sample == b
        got_t = (got.teacher_rows[sel] - teacher.row_base[b]).tolist()
        got_s = (got.student_rows[sel] - student.row_base[b]).tolist()
        assert list(zip(got_t, got_s)) == want_pairs + [(len(t), len(s))]
        pairs += len(want_pairs) + 1
    assert got.num_pairs == pairs
    # the strict pairs predict identical bytes on both sides
    flat_t, flat_s = teacher.input_ids.reshape(-1), student.input_ids.reshape(-1)
    nt = ~got.pair_is_eos
    assert all(qwen.token_bytes[a] == llama.token_bytes[c] for a, c in
               zip(flat_t[got.teacher_rows[nt] + 1], flat_s[got.student_rows[nt] + 1]))
    # Paper Table 1 reports 85.6-97.0 % student coverage across pairs (93.6 % for this one,
    # on model samples); worked GSM solutions with many numbers sit in that range.
    assert 0.85 < got.student_coverage < 0.99
    assert got.teacher_coverage < got.student_coverage  # Qwen splits digits: more tokens
    print(f"coverage student {got.student_coverage:.4f} teacher {got.teacher_coverage:.4f}")


def test_simct_against_decode_walk(batch, qwen, llama):
    """Oracle decodes each id alone with the tokenizers library (independent of byte views)."""
    teacher, student = batch
    got = simct_segments(qwen, llama, teacher, student)
    for b in range(0, NUM, 10):
        *_, t_ids = _pieces(qwen, teacher, b)
        *_, s_ids = _pieces(llama, student, b)
        t_dec = [qwen.tokenizer.decode([int(i)]).encode() for i in t_ids]
        s_dec = [llama.tokenizer.decode([int(i)]).encode() for i in s_ids]
        want = simct_oracle(t_dec, s_dec)
        rows = got.segments[got.segments[:, 0] == b]
        mine = [(r[1] - teacher.row_base[b], r[2] - teacher.row_base[b],
                 r[3] - student.row_base[b], r[4] - student.row_base[b]) for r in rows]
        assert [tuple(map(int, m)) for m in mine] == want


def test_atoms_cover_every_response_token(batch):
    teacher, student = batch
    alignment = strict_align(teacher, student)
    atoms = mpopd_atoms(teacher, student, alignment)
    assert atoms.num_invalid == 0
    assert atoms.student_tokens.sum() == student.num_response_tokens - NUM  # EOS masked
    assert (atoms.atoms[:, 2] - atoms.atoms[:, 1]).sum() == teacher.num_response_tokens - NUM
    assert np.all(atoms.student_tokens >= 1)


def test_simct_with_partial_utf8_tokens(qwen, llama):
    """Emoji / CJK / accents split inside characters on one side: per-token decodes hold U+FFFD
    and the histories diverge until the character completes (oracle: tokenizers' decode)."""
    texts = ["数学很有趣 😀😀 — naïve café ½ × 3 = 1.5", "🙂 答案是 42。", "plain ascii 1+1=2"]
    teacher, student = retokenize_pair(qwen, llama, [qwen.render_prompt("q")] * 3,
                                       [llama.render_prompt("q")] * 3, texts)
    got = simct_segments(qwen, llama, teacher, student)
    for b in range(len(texts)):
        *_, t_ids = _pieces(qwen, teacher, b)
        *_, s_ids = _pieces(llama, student, b)
        want = simct_oracle([qwen.tokenizer.decode([int(i)]).encode() for i in t_ids],
                            [llama.tokenizer.decode([int(i)]).encode() for i in s_ids])
        rows = got.segments[got.segments[:, 0] == b]
        mine = [(int(r[1] - teacher.row_base[b]), int(r[2] - teacher.row_base[b]),
                 int(r[3] - student.row_base[b]), int(r[4] - student.row_base[b])) for r in rows]
        assert mine == want


EDGE_TEXTS = ["数学很有趣 😀😀 — naïve café ½ × 3 = 1.5",   # CJK, emoji, accents
              "🙂 答案是 42。",
              "so the answer is 7 <|im_end|> then more",   # an added token of the teacher
              "truncated mid-character: 答" + "\ufffd",    # a split UTF-8 tail, decoded lossy
              "",                                          # nothing before the EOS
              "plain ascii 1+1=2"]


def _decoder(side):
    return lambda ids: side.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def test_atoms_against_prefix_decodes_on_edge_cases(qwen, llama):
    """CJK, emoji, an added token inside a response, a truncated response ending in a split
    character, an empty response: atoms and fail reasons against the SPEC §8 oracle, which
    decodes every prefix with the tokenizers library (independent of the byte views)."""
    teacher, student = retokenize_pair(qwen, llama, [qwen.render_prompt("q")] * len(EDGE_TEXTS),
                                       [llama.render_prompt("q")] * len(EDGE_TEXTS), EDGE_TEXTS)
    got = mpopd_atoms(teacher, student)
    reasons = []
    for b in range(len(EDGE_TEXTS)):
        *_, t_ids = _pieces(qwen, teacher, b)
        *_, s_ids = _pieces(llama, student, b)
        reason, want = atoms_oracle(t_ids, s_ids, _decoder(qwen), _decoder(llama),
                                    lambda i: bool(qwen.is_added[i]), lambda i: bool(llama.is_added[i]),
                                    qwen.eos_id, llama.eos_id)
        reasons.append(reason)
        assert got.fail_reason[b] == (-1 if reason is None else ATOM_REASONS.index(reason))
        atoms = got.atoms[got.atoms[:, 0] == b]
        mine = [(list(range(int(a[1] - teacher.row_base[b]), int(a[2] - teacher.row_base[b]))),
                 list(range(int(a[3] - student.row_base[b]), int(a[4] - student.row_base[b]))))
                for a in atoms]
        assert mine == want
    assert reasons == [None, None, "unsupported_added_token", "replacement_character",
                       "empty_response", None]
    # the emoji/CJK sample has atoms of several tokens (whole characters on both sides)
    sizes = {(len(t), len(s)) for t, s in atoms_oracle(*[_pieces(qwen, teacher, 0)[2],
                                                         _pieces(llama, student, 0)[2]],
                                                       _decoder(qwen), _decoder(llama),
                                                       lambda i: False, lambda i: False, -1, -1)[1]}
    assert any(t > 1 or s > 1 for t, s in sizes)


def test_simct_on_edge_cases(qwen, llama):
    """The same edge cases through SimCT: the literal SPEC §7 walk over tokenizers' decode([id])."""
    teacher, student = retokenize_pair(qwen, llama, [qwen.render_prompt("q")] * len(EDGE_TEXTS),
                                       [llama.render_prompt("q")] * len(EDGE_TEXTS), EDGE_TEXTS)
    got = simct_segments(teacher, student)
    for b in range(len(EDGE_TEXTS)):
        *_, t_ids = _pieces(qwen, teacher, b)
        *_, s_ids = _pieces(llama, student, b)
        want = simct_oracle([_decoder(qwen)([i]).encode() for i in t_ids],
                            [_decoder(llama)([i]).encode() for i in s_ids])
        rows = got.segments[got.segments[:, 0] == b]
        mine = [(int(r[1] - teacher.row_base[b]), int(r[2] - teacher.row_base[b]),
                 int(r[3] - student.row_base[b]), int(r[4] - student.row_base[b])) for r in rows]
        assert mine == want
    # the truncated tail splits 答 differently on the two sides: the decoded histories differ
    # from there on, so no EOS anchor; the plain and empty samples end on their EOS anchor
    assert not got.ends_with_eos[got.segments[:, 0] == 3].any()
    assert got.ends_with_eos[got.segments[:, 0] == 4].tolist() == [True]
    assert got.ends_with_eos[got.segments[:, 0] == 5][-1]
