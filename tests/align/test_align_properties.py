"""Property tests of the vectorised alignment against the brute-force oracle (SPEC §2, §7, §8).

"Random tokenizers" are random segmentations of the UTF-8 bytes of random unicode text (cuts may
fall inside a multi-byte character), with optional zero-length tokens and unpairable (added)
tokens; a second family of samples has different text on the two sides (byte mismatch)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from _align_oracle import (local_index, make_batch, simct_oracle, strict_oracle,
                           two_pointer_groups)
from ctopd_jax.align import mpopd_atoms, strict_align
from ctopd_jax.align.simct import SimCTSegments
from ctopd_jax.align.sync import sync_groups

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def segmentation(draw, data: bytes, allow_empty: bool):
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    cuts = [c for c in cuts if 0 < c < len(data)]
    pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])] if data else []
    if allow_empty and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            pieces.insert(draw(st.integers(0, len(pieces))), b"")
    pairable = [draw(st.integers(0, 9)) > 0 for _ in pieces]
    return pieces, pairable


@st.composite
def sample(draw, allow_empty=False):
    text = draw(st.text(max_size=24)).encode("utf-8")
    t, tp = draw(segmentation(text, allow_empty))
    if draw(st.integers(0, 5)) == 0:  # byte mismatch: the student saw other text
        text = text + draw(st.text(min_size=1, max_size=4)).encode("utf-8")
    s, sp = draw(segmentation(text, allow_empty))
    return t, s, tp, sp


@SETTINGS
@given(st.lists(sample(allow_empty=True), min_size=1, max_size=5))
def test_strict_alignment_equals_oracle(samples):
    teacher, student = make_batch(samples)
    got = strict_align(teacher, student)
    for b, (t, s, tp, sp) in enumerate(samples):
        want = strict_oracle(t, s, tp, sp)
        sel = got.pair_sample == b
        rows_t, rows_s = got.teacher_rows[sel], got.student_rows[sel]
        groups = got.mismatch_groups[got.mismatch_groups[:, 0] == b]
        if want is None:
            assert got.byte_mismatch[b] and not sel.any() and len(groups) == 0
            continue
        pairs, rest = want
        assert not got.byte_mismatch[b]
        got_pairs = [(local_index(teacher, b, r), local_index(student, b, q))
                     for r, q in zip(rows_t, rows_s)]
        assert got_pairs == pairs + [(len(t), len(s))]  # the EOS pair last
        assert got.pair_is_eos[sel].tolist() == [False] * len(pairs) + [True]
        got_rest = [(list(range(local_index(teacher, b, g[1]), local_index(teacher, b, g[2]))),
                     list(range(local_index(student, b, g[3]), local_index(student, b, g[4]))))
                    for g in groups]
        assert got_rest == rest


@SETTINGS
@given(st.lists(sample(allow_empty=True), min_size=1, max_size=5))
def test_strict_pairs_are_exact_increasing_and_partition(samples):
    teacher, student = make_batch(samples)
    got = strict_align(teacher, student)
    for b, (t, s, _, _) in enumerate(samples):
        if got.byte_mismatch[b]:
            continue
        sel = (got.pair_sample == b) & ~got.pair_is_eos
        ti = [local_index(teacher, b, r) for r in got.teacher_rows[sel]]
        si = [local_index(student, b, r) for r in got.student_rows[sel]]
        assert all(np.diff(ti) > 0) and all(np.diff(si) > 0)
        for i, j in zip(ti, si):  # equal non-empty bytes ending at a common boundary
            assert t[i] == s[j] and t[i]
            assert len(b"".join(t[:i + 1])) == len(b"".join(s[:j + 1]))
        cover_t, cover_s = list(ti), list(si)
        for g in got.mismatch_groups[got.mismatch_groups[:, 0] == b]:
            cover_t += range(local_index(teacher, b, g[1]), local_index(teacher, b, g[2]))
            cover_s += range(local_index(student, b, g[3]), local_index(student, b, g[4]))
        assert sorted(cover_t) == list(range(len(t)))
        assert sorted(cover_s) == list(range(len(s)))
    want_pairs = sum(len(strict_oracle(*x)[0]) + 1 for x in samples if strict_oracle(*x))
    assert got.num_pairs == want_pairs
    assert got.num_student_response_tokens == sum(len(x[1]) + 1 for x in samples)


@SETTINGS
@given(st.lists(sample(), min_size=1, max_size=4))
def test_fast_path_equals_general_path(samples):
    """The byte-bitmap path (no empty tokens) and the searchsorted path agree."""
    teacher, student = make_batch(samples)
    args = (teacher.resp_byte_len, teacher.resp_offsets, student.resp_byte_len,
            student.resp_offsets, np.ones(len(samples), bool))
    fast = sync_groups(*args)
    # one appended empty sample with a zero-length token forces the general path
    t_len = np.r_[teacher.resp_byte_len, 0]
    s_len = np.r_[student.resp_byte_len, 0]
    general = sync_groups(t_len, np.r_[teacher.resp_offsets, teacher.resp_offsets[-1] + 1],
                          s_len, np.r_[student.resp_offsets, student.resp_offsets[-1] + 1],
                          np.ones(len(samples) + 1, bool))
    keep = general.sample < len(samples)
    for field in ("sample", "t_first", "t_last", "s_first", "s_last"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(general, field)[keep])


def _lossy(piece: bytes) -> bytes:
    return piece.decode("utf-8", "replace").encode("utf-8")


@SETTINGS
@given(st.lists(sample(), min_size=1, max_size=4))
def test_simct_segments_equal_literal_walk(samples):
    from ctopd_jax.align import simct

    teacher, student = make_batch(samples)
    lengths = {}

    def fake_view(side, batch):  # decoded per-token strings of the synthetic pieces
        pieces = [p for smp in samples for p in smp[0 if batch is teacher else 1]]
        dec = [_lossy(p) for p in pieces]
        offs = batch.resp_offsets
        texts = [b"".join(dec[offs[b]:offs[b + 1]]) for b in range(batch.batch_size)]
        lengths[id(batch)] = np.array([len(d) for d in dec], np.int64)
        return lengths[id(batch)], texts

    original = simct._decoded_view
    simct._decoded_view = fake_view
    try:
        got: SimCTSegments = simct.simct_segments(None, None, teacher, student)
    finally:
        simct._decoded_view = original
    for b, (t, s, _, _) in enumerate(samples):
        want = simct_oracle([_lossy(p) for p in t], [_lossy(p) for p in s])
        mine = [tuple(local_index(teacher if k < 2 else student, b, v) for k, v in
                      enumerate(g[1:])) for g in got.segments[got.segments[:, 0] == b]]
        assert mine == want


@SETTINGS
@given(st.lists(sample(allow_empty=True), min_size=1, max_size=4))
def test_atoms_are_the_minimal_synchronised_segments(samples):
    teacher, student = make_batch(samples)
    got = mpopd_atoms(teacher, student, strict_align(teacher, student))
    for b, (t, s, _, _) in enumerate(samples):
        atoms = got.atoms[got.atoms[:, 0] == b]
        valid = b"".join(t) == b"".join(s) and "\ufffd" not in teacher.responses[b]
        assert got.sample_valid[b] == valid
        if not valid:
            assert len(atoms) == 0
            continue
        want = two_pointer_groups(t, s)
        mine = [(list(range(local_index(teacher, b, a[1]), local_index(teacher, b, a[2]))),
                 list(range(local_index(student, b, a[3]), local_index(student, b, a[4]))))
                for a in atoms]
        assert mine == want
        for ti, si in mine:  # each atom has equal bytes on both sides
            assert b"".join(t[i] for i in ti) == b"".join(s[j] for j in si)


@st.composite
def matched_sample(draw):
    """Byte-equal sides, no empty token (the batches the fast path takes); may be empty."""
    text = draw(st.text(max_size=20)).encode("utf-8")
    t, tp = draw(segmentation(text, False))
    s, sp = draw(segmentation(text, False))
    return t, s, tp, sp


@SETTINGS
@given(st.lists(matched_sample(), min_size=1, max_size=6))
def test_fast_strict_path_equals_general_path(samples):
    teacher, student = make_batch(samples)
    fast, general = strict_align(teacher, student), strict_align(teacher, student, fast=False)
    for field in ("teacher_rows", "student_rows", "pair_sample", "pair_is_eos",
                  "mismatch_groups", "teacher_pairs", "byte_mismatch"):
        a, b = getattr(fast, field), getattr(general, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    for field in ("sample", "t_first", "t_last", "s_first", "s_last"):
        assert np.array_equal(getattr(fast.groups, field), getattr(general.groups, field))


def test_fast_path_with_empty_samples_at_the_edges():
    pieces = ([b"ab", b"c"], [b"a", b"bc"], [True, True], [True, True])
    empty = ([], [], [], [])
    one = ([b"x"], [b"x"], [True], [True])
    for samples in ([pieces, empty], [empty, pieces], [one, empty, pieces, empty, one]):
        teacher, student = make_batch(samples)
        fast, general = strict_align(teacher, student), strict_align(teacher, student, fast=False)
        for field in ("teacher_rows", "student_rows", "pair_sample", "pair_is_eos",
                      "mismatch_groups", "teacher_pairs"):
            assert np.array_equal(getattr(fast, field), getattr(general, field)), field
