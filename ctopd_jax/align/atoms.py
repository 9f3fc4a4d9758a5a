"""MP-OPD atoms (SPEC §8): the minimal synchronised segments of the two decodes, fail-closed.

Per sample, on each side: remove every trailing copy of the EOS; candidate offsets are, for
k = 1..n, the UTF-8 byte length of ``decode(ids[:k])`` (special tokens kept, no clean-up),
skipping empty prefixes, prefixes that contain U+FFFD and prefixes that are not a byte prefix
of the full decode; when several k give the same offset the largest k is kept (so empty tokens
join the atom before them). Atoms are the spans between consecutive offsets common to both
sides. A sample fails closed (no atoms: zero loss, its tokens stay in the denominator) for the
FIRST of these reasons, in this order (``FAIL_REASONS``): an empty response on either side, an
added-vocabulary id inside a response, U+FFFD in a full decode, an empty full decode, full
decodes that differ as bytes, or a last common offset short of the end (an unaligned suffix).

Decision: ``decode`` is modelled by the batch's byte views (``resp_bytes``: each token's bytes,
SentencePiece dummy prefix removed as the re-tokenizer does) decoded as UTF-8 with replacement.
For ByteLevel vocabularies (Qwen2.5, Llama-3) that is exactly ``tokenizer.decode(ids[:k])``
(tests/align/test_real_pair.py checks it with the tokenizers library), and then a prefix decode
holds U+FFFD exactly when the prefix ends inside a character, it is always a byte prefix of the
full decode, and ``unaligned_suffix`` cannot occur (it is kept for other decoders). For
SentencePiece the real ``decode`` would strip the leading space of a response's first word,
which would fail most samples as ``normalization_mismatch``; the byte view keeps it.
Unlike the strict byte ruler (SPEC §2), atoms never end inside a character: two sides that split
an emoji the same way still give one atom.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.tokenization.retokenize import RetokenizedBatch

FAIL_REASONS = ("empty_response", "unsupported_added_token", "replacement_character",
                "empty_decode", "normalization_mismatch", "unaligned_suffix")


@dataclasses.dataclass(frozen=True, eq=False)
class Atoms:
    atoms: np.ndarray          # int32 [A, 5]: sample, t_start, t_end, s_start, s_end (flat logits
    #                            rows, end exclusive)
    sample_valid: np.ndarray   # bool [B]
    fail_reason: np.ndarray    # int8 [B]: -1 for a valid sample, else an index into FAIL_REASONS

    @property
    def num_invalid(self) -> int:
        return int((~self.sample_valid).sum())

    @property
    def student_tokens(self) -> np.ndarray:
        """int32 [A]: w_i, the number of student tokens in each atom."""
        return (self.atoms[:, 4] - self.atoms[:, 3]).astype(np.int32)

    def fail_counts(self, start: int = 0, stop: int | None = None) -> dict[str, int]:
        """{reason: failed samples} over samples [start, stop)."""
        reasons = self.fail_reason[start:stop]
        return {name: int((reasons == k).sum()) for k, name in enumerate(FAIL_REASONS)}


@dataclasses.dataclass
class _Side:
    n: int              # tokens after removing trailing EOS copies
    added: bool
    text: bytes         # the full decode (UTF-8)
    ends: np.ndarray    # int64 [n]: byte end of each token within the response


def _side(batch: RetokenizedBatch, ends_all: np.ndarray, b: int) -> _Side:
    lo, hi = int(batch.resp_offsets[b]), int(batch.resp_offsets[b + 1])
    ids = batch.resp_ids[lo:hi]
    n = len(ids)
    while n and ids[n - 1] == batch.eos_id:
        n -= 1
    ends = ends_all[lo + 1:lo + n + 1] - ends_all[lo]
    raw = batch.resp_bytes[b][:int(ends[-1]) if n else 0]
    text = raw.decode("utf-8", "replace").encode("utf-8")
    return _Side(n, bool((~batch.resp_pairable[lo:lo + n]).any()), text, ends)


def _offsets(side: _Side) -> tuple[np.ndarray, np.ndarray]:
    """(candidate offsets ascending, the largest k giving each) of one side (valid sample: the
    full bytes are valid UTF-8 without U+FFFD, so a prefix decode is clean iff its byte end is
    a character start)."""
    data = np.frombuffer(side.text, np.uint8)
    char_start = np.ones(len(data) + 1, bool)
    char_start[:-1] = (data & 0xC0) != 0x80
    ok = (side.ends > 0) & char_start[side.ends]
    k = np.flatnonzero(ok) + 1              # prefix lengths
    offs = side.ends[ok]
    last = np.r_[offs[1:] != offs[:-1], True]   # offsets are non-decreasing: keep the largest k
    return offs[last], k[last]


def mpopd_atoms(teacher: RetokenizedBatch, student: RetokenizedBatch, alignment=None,
                eos_atom: bool = False) -> Atoms:
    """Atoms of every sample (``alignment`` is accepted for the older call form, unused).
    ``eos_atom`` (off in SPEC §8 and the released code): each valid sample gets one more atom,
    last, of the one row on each side that predicts the EOS after the content (the first of any
    trailing EOS copies, else the appended EOS), so the EOS decision gets its own credit."""
    num = teacher.batch_size
    t_ends = np.concatenate([[0], np.cumsum(teacher.resp_byte_len)]).astype(np.int64)
    s_ends = np.concatenate([[0], np.cumsum(student.resp_byte_len)]).astype(np.int64)
    reason = np.full(num, -1, np.int8)
    out = []
    for b in range(num):
        t, s = _side(teacher, t_ends, b), _side(student, s_ends, b)
        checks = (t.n == 0 or s.n == 0, t.added or s.added,
                  "\ufffd".encode() in t.text or "\ufffd".encode() in s.text,
                  not t.text or not s.text, t.text != s.text)
        failed = next((k for k, bad in enumerate(checks) if bad), None)
        if failed is not None:
            reason[b] = failed
            continue
        t_off, t_k = _offsets(t)
        s_off, s_k = _offsets(s)
        common, ti, si = np.intersect1d(t_off, s_off, assume_unique=True, return_indices=True)
        if not len(common) or common[-1] != len(t.text) or t_k[ti[-1]] != t.n or s_k[si[-1]] != s.n:
            reason[b] = FAIL_REASONS.index("unaligned_suffix")
            continue
        t_stop, s_stop = t_k[ti], s_k[si]
        t_start, s_start = np.r_[0, t_stop[:-1]], np.r_[0, s_stop[:-1]]
        if eos_atom:
            t_start, t_stop = np.r_[t_start, t.n], np.r_[t_stop, t.n + 1]
            s_start, s_stop = np.r_[s_start, s.n], np.r_[s_stop, s.n + 1]
        tb, sb = teacher.row_base[b], student.row_base[b]
        out.append(np.stack([np.full(len(t_start), b), tb + t_start, tb + t_stop,
                             sb + s_start, sb + s_stop], axis=1))
    atoms = np.concatenate(out) if out else np.zeros((0, 5), np.int64)
    return Atoms(atoms=atoms.astype(np.int32).reshape(-1, 5), sample_valid=reason < 0,
                 fail_reason=reason)
