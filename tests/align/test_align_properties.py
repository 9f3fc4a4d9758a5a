"""Property tests of the vectorised alignment against the brute-force oracle (SPEC §2, §7, §8).

"Random tokenizers" are random segmentations of the UTF-8 bytes of random unicode text (cuts may
fall inside a multi-byte character), with optional zero-length tokens and unpairable (added)
tokens; a second family of samples has different text on the two sides (byte mismatch)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from _align_oracle import (ATOM_REASONS, atoms_oracle, local_index, make_batch, simct_oracle,
                           strict_oracle, two_pointer_groups)
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
def test_strict_alignment_equals_oracle_and_partitions_each_sample(samples):
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
        _assert_exact_increasing_partition(teacher, student, got, b, t, s)
    want_pairs = sum(len(strict_oracle(*x)[0]) + 1 for x in samples if strict_oracle(*x))
    assert got.num_pairs == want_pairs
    assert got.num_student_response_tokens == sum(len(x[1]) + 1 for x in samples)


def _assert_exact_increasing_partition(teacher, student, got, b, t, s):
    """Sample b's pairs are increasing on both sides, each pair equal non-empty bytes ending at a
    common boundary, and pairs plus mismatch groups cover every token of both sides once."""
    sel = (got.pair_sample == b) & ~got.pair_is_eos
    ti = [local_index(teacher, b, r) for r in got.teacher_rows[sel]]
    si = [local_index(student, b, r) for r in got.student_rows[sel]]
    assert all(np.diff(ti) > 0) and all(np.diff(si) > 0)
    for i, j in zip(ti, si):
        assert t[i] == s[j] and t[i]
        assert len(b"".join(t[:i + 1])) == len(b"".join(s[:j + 1]))
    cover_t, cover_s = list(ti), list(si)
    for g in got.mismatch_groups[got.mismatch_groups[:, 0] == b]:
        cover_t += range(local_index(teacher, b, g[1]), local_index(teacher, b, g[2]))
        cover_s += range(local_index(student, b, g[3]), local_index(student, b, g[4]))
    assert sorted(cover_t) == list(range(len(t)))
    assert sorted(cover_s) == list(range(len(s)))


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
@given(st.lists(sample(allow_empty=True), min_size=1, max_size=4))
def test_simct_segments_equal_literal_walk(samples):
    """Random segmentations (cuts inside characters, empty tokens, byte mismatches) against the
    literal SPEC §7 walk over per-token decodes (bytes decoded with replacement)."""
    from ctopd_jax.align import simct

    teacher, student = make_batch(samples)
    got: SimCTSegments = simct.simct_segments(teacher, student)
    for b, (t, s, _, _) in enumerate(samples):
        want = simct_oracle([_lossy(p) for p in t], [_lossy(p) for p in s])
        mine = [tuple(local_index(teacher if k < 2 else student, b, v) for k, v in
                      enumerate(g[1:])) for g in got.segments[got.segments[:, 0] == b]]
        assert mine == want
        sel = got.segments[:, 0] == b
        spans = [(te - ts) > 1 or (se - ss) > 1 for ts, te, ss, se in want]
        assert got.is_span[sel].tolist() == spans
        assert got.ends_with_eos[sel].tolist() == [te == len(t) + 1 for _, te, _, _ in want]


@SETTINGS
@given(st.lists(sample(allow_empty=True), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_atoms_equal_the_decode_prefix_oracle(samples, seed):
    """SPEC §8 atoms and fail-closed reasons against the literal prefix-decode oracle. Ids are
    random (some equal to the EOS id 0, so trailing EOS copies occur); unpairable tokens stand
    for the added vocabulary; decode = the pieces' bytes decoded with replacement."""
    rng = np.random.default_rng(seed)
    ids = [np.where(rng.random(n) < 0.15, 0, rng.integers(1, 50, n)) for n in
           (sum(len(x[0]) for x in samples), sum(len(x[1]) for x in samples))]
    teacher, student = make_batch(samples, ids=ids)
    got = mpopd_atoms(teacher, student)
    for b, (t, s, tp, sp) in enumerate(samples):
        lo_t, lo_s = teacher.resp_offsets[b], student.resp_offsets[b]
        t_ids, s_ids = list(range(len(t))), list(range(len(s)))  # local indices as ids
        t_eos = [teacher.resp_ids[lo_t + i] == 0 for i in t_ids]
        s_eos = [student.resp_ids[lo_s + i] == 0 for i in s_ids]
        while t_ids and t_eos[t_ids[-1]]:  # trailing EOS copies, then a marker no id equals
            t_ids.pop()
        while s_ids and s_eos[s_ids[-1]]:
            s_ids.pop()
        reason, want = atoms_oracle(
            t_ids, s_ids, lambda k: b"".join(t[i] for i in k).decode("utf-8", "replace"),
            lambda k: b"".join(s[i] for i in k).decode("utf-8", "replace"),
            lambda i: not tp[i], lambda i: not sp[i], -1, -1)
        assert got.sample_valid[b] == (reason is None)
        assert got.fail_reason[b] == (-1 if reason is None else ATOM_REASONS.index(reason))
        atoms = got.atoms[got.atoms[:, 0] == b]
        mine = [(list(range(local_index(teacher, b, a[1]), local_index(teacher, b, a[2]))),
                 list(range(local_index(student, b, a[3]), local_index(student, b, a[4]))))
                for a in atoms]
        assert mine == want
        for ti, si in mine:  # each atom: equal bytes on both sides, whole characters
            assert b"".join(t[i] for i in ti) == b"".join(s[j] for j in si)
            b"".join(t[i] for i in ti).decode("utf-8")
    counts = got.fail_counts()
    assert sum(counts.values()) == got.num_invalid


def test_atoms_fail_reasons_in_order():
    """One sample per reason; a sample with several problems reports the first in SPEC order."""
    cases = [
        ([], [b"a"], [], [True]),                                    # empty_response
        ([b"a", b"<x>"], [b"a", b"<x>"], [True, False], [True, True]),  # added token
        ([b"\xef\xbf\xbd"], [b"\xef\xbf\xbd"], [True], [True]),  # U+FFFD in the text
        ([b"", b""], [b"a"], [True, True], [True]),                   # empty decode
        ([b"ab"], [b"ac"], [True], [True]),                           # normalization mismatch
        ([b"\xe4", b"\xb8"], [b"x"], [False, True], [True]),          # added wins over U+FFFD
        ([b"ok"], [b"o", b"k"], [True], [True, True]),                # valid
    ]
    teacher, student = make_batch(cases)
    got = mpopd_atoms(teacher, student)
    names = [None if r < 0 else ATOM_REASONS[r] for r in got.fail_reason]
    assert names == ["empty_response", "unsupported_added_token", "replacement_character",
                     "empty_decode", "normalization_mismatch", "unsupported_added_token", None]
    assert got.fail_counts() == {"empty_response": 1, "unsupported_added_token": 2,
                                 "replacement_character": 1, "empty_decode": 1,
                                 "normalization_mismatch": 1, "unaligned_suffix": 0}


def test_atoms_keep_split_characters_whole():
    """Both sides split an emoji the same way: the byte ruler pairs the pieces, atoms do not."""
    emoji = "😀".encode()
    teacher, student = make_batch([([b"a", emoji[:2], emoji[2:]], [b"a", emoji[:2], emoji[2:]],
                                    [True] * 3, [True] * 3)])
    got = mpopd_atoms(teacher, student)
    assert [(a[2] - a[1], a[4] - a[3]) for a in got.atoms] == [(1, 1), (2, 2)]
    assert strict_align(teacher, student).num_pairs == 4  # a, both halves, EOS


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


def test_eos_atom_is_one_more_atom_on_the_eos_rows():
    """`eos_atom`: each valid sample keeps its SPEC §8 atoms and gains one last atom, the row
    after its content on each side (the appended EOS, or the first trailing EOS copy); a sample
    that fails closed still has none."""
    cases = [([b"ab", b"c"], [b"a", b"bc"], [True] * 2, [True] * 2),
             ([b"ab"], [b"ac"], [True], [True]),                      # normalization mismatch
             ([b"x", b"y", b""], [b"xy", b""], [True] * 3, [True] * 2)]   # a trailing EOS copy
    ids = ([5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 0])                         # EOS id 0
    teacher, student = make_batch(cases, ids=ids)
    plain, extra = mpopd_atoms(teacher, student), mpopd_atoms(teacher, student, eos_atom=True)
    assert extra.fail_reason.tolist() == plain.fail_reason.tolist()
    local = lambda batch, b, rows: [local_index(batch, b, r) for r in rows]
    for b, n_t, n_s in ((0, 2, 2), (2, 2, 1)):   # content tokens before the EOS on each side
        mine, base = extra.atoms[extra.atoms[:, 0] == b], plain.atoms[plain.atoms[:, 0] == b]
        assert mine[:-1].tolist() == base.tolist()
        assert local(teacher, b, mine[-1, 1:3]) == [n_t, n_t + 1]
        assert local(student, b, mine[-1, 3:5]) == [n_s, n_s + 1]
    assert not (extra.atoms[:, 0] == 1).any()
