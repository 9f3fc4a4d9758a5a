"""SimCT segments (SPEC §7): the released `span_ctkd` walk over per-token DECODED strings.

The walk (SPEC §7, literally): take the response label ids, EOS included, decode each id on its
own on both sides and walk two pointers with the decoded-string histories:

    if histories equal and (current decoded tokens equal or both are EOS): boundary, advance both
    elif one history is shorter (in characters): advance that side
    else (equal length, equal in content or not): advance both

A segment runs from after the previous boundary up to and including the boundary token (the
anchor); a trailing run with no anchor is dropped. ONE loss row per segment (algorithms/simct.py).

Implementation. Histories are prefixes of each side's decoded text, so "histories equal" is
"equal lengths, within the common prefix of the two decoded texts", and comparing lengths in
characters or in UTF-8 bytes of the decoded strings orders prefix-related histories the same
way. So, when no decoded token is empty, the walk is the two-pointer group walk of
``sync_groups`` on decoded byte lengths, limited to that common prefix, with each run of non-1:1
groups merged into the following 1:1 group (a 1:1 group inside the common prefix covers the same
substring on both sides, so its decoded tokens are equal). The EOS is a final length-1 token on
both sides that matches iff the whole decoded responses are equal. Samples with an EMPTY decoded
token (where "equal length: advance both" differs from the offset walk) take the literal walk.

Decisions (documented differences from the released code):
- A token's decoded string is its byte view (the batch's ``resp_bytes``, dummy prefix removed)
  decoded as UTF-8 with replacement (one U+FFFD per invalid sequence). That equals
  ``tokenizer.decode([id])`` (special tokens kept, no clean-up) for ByteLevel vocabularies,
  including Qwen2.5 and Llama-3; a decode that splits a UTF-8 character is its replacement
  character, so the walk differs from a byte ruler there (two sides splitting an emoji
  differently hold U+FFFD histories that may compare equal). For SentencePiece it keeps a
  token's ``▁`` as a space where ``decode([id])`` strips it (which would make every history
  differ after the first word).
- No ``clean_up_tokenization_spaces``: transformers 4.57 applied it inside Llama-3's
  ``decode([id])`` in the released stack (" ." -> "."), which desynchronised the walk for the
  rest of such a sample; current transformers does not, and neither do we.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.align.sync import sync_groups
from ctopd_jax.tokenization.retokenize import RetokenizedBatch


@dataclasses.dataclass(frozen=True, eq=False)
class SimCTSegments:
    segments: np.ndarray   # int32 [S, 5]: sample, t_start, t_end, s_start, s_end (flat logits
    #                        rows, end exclusive); the EOS anchor is the last row of its segment
    is_span: np.ndarray    # bool [S]: more than one token on either side (a virtual column)
    ends_with_eos: np.ndarray  # bool [S]

    def __len__(self) -> int:
        return int(self.segments.shape[0])


def _token_ends(batch: RetokenizedBatch) -> np.ndarray:
    """int64 [N + 1]: byte offsets of every response token in the concatenated resp_bytes."""
    return np.concatenate([[0], np.cumsum(batch.resp_byte_len)]).astype(np.int64)


def _decoded_view(batch: RetokenizedBatch):
    """Per token: decoded byte length (UTF-8 of its replacement-decoded string); per sample the
    decoded text (None where it equals ``resp_bytes``) and whether a decoded token is empty.

    Vectorised: a token whose start and end fall on character starts of a valid UTF-8 response
    decodes to exactly its bytes; only the others (pieces of a split character) are decoded one
    by one."""
    ends = _token_ends(batch)
    data = np.frombuffer(b"".join(batch.resp_bytes), np.uint8)
    starts_char = np.ones(len(data) + 1, bool)
    starts_char[:-1] = (data & 0xC0) != 0x80
    lengths = batch.resp_byte_len.astype(np.int64).copy()
    exact = starts_char[ends[:-1]] & starts_char[ends[1:]]
    texts, has_empty = [], np.zeros(batch.batch_size, bool)
    for b in range(batch.batch_size):
        lo, hi = int(batch.resp_offsets[b]), int(batch.resp_offsets[b + 1])
        raw = batch.resp_bytes[b]
        try:
            raw.decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        if valid and exact[lo:hi].all():
            texts.append(None)
            has_empty[b] = bool((lengths[lo:hi] == 0).any())
            continue
        base = ends[lo]
        pieces = []
        for k in range(lo, hi):
            piece = raw[ends[k] - base:ends[k + 1] - base].decode("utf-8", "replace").encode("utf-8")
            lengths[k] = len(piece)
            pieces.append(piece)
        texts.append(b"".join(pieces))
        has_empty[b] = bool((lengths[lo:hi] == 0).any())
    return lengths, texts, has_empty


def decoded_pieces(batch: RetokenizedBatch, b: int) -> list[bytes]:
    """The decoded strings (UTF-8 bytes) of sample b's response tokens, EOS excluded."""
    ends = _token_ends(batch)
    lo, hi = int(batch.resp_offsets[b]), int(batch.resp_offsets[b + 1])
    raw, base = batch.resp_bytes[b], ends[lo]
    return [raw[ends[k] - base:ends[k + 1] - base].decode("utf-8", "replace").encode("utf-8")
            for k in range(lo, hi)]


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality (C-speed slices)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def literal_walk(t_dec: list[bytes], s_dec: list[bytes]) -> list[tuple[int, int, int, int]]:
    """SPEC §7's walk on one sample's decoded tokens (EOS excluded; it is index len on each
    side). Returns segments (t_start, t_end, s_start, s_end) in response-token indices, end
    exclusive, EOS included as a token."""
    t_text, s_text = b"".join(t_dec), b"".join(s_dec)
    limit = _common_prefix(t_text, s_text)
    n_t, n_s = len(t_dec) + 1, len(s_dec) + 1
    eos_len = 1  # the EOS is last on both sides: its length never decides a later boundary
    i = j = lt = ls = st = ss = 0
    out = []
    while i < n_t and j < n_s:
        t_eos, s_eos = i == n_t - 1, j == n_s - 1
        same_hist = lt == ls and lt <= limit
        same_tok = (t_eos and s_eos) or (not t_eos and not s_eos and t_dec[i] == s_dec[j])
        step_t = step_s = False
        if same_hist and same_tok:
            out.append((st, i + 1, ss, j + 1))
            st, ss = i + 1, j + 1
            step_t = step_s = True
        elif lt < ls:
            step_t = True
        elif ls < lt:
            step_s = True
        else:
            step_t = step_s = True
        if step_t:
            lt += eos_len if t_eos else len(t_dec[i])
            i += 1
        if step_s:
            ls += eos_len if s_eos else len(s_dec[j])
            j += 1
    return out


def simct_segments(*args) -> SimCTSegments:
    """Segments of a batch: ``simct_segments(teacher, student)`` (RetokenizedBatch each; the
    tokenizer sides of the older four-argument form ``(t_side, s_side, teacher, student)`` are
    not needed: the decoded strings come from the batches' byte views)."""
    teacher, student = args[-2], args[-1]
    t_len, t_text, t_empty = _decoded_view(teacher)
    s_len, s_text, s_empty = _decoded_view(student)
    num = teacher.batch_size
    literal = t_empty | s_empty
    limit = np.empty(num, dtype=np.int64)
    for b in range(num):
        a = t_text[b] if t_text[b] is not None else teacher.resp_bytes[b]
        c = s_text[b] if s_text[b] is not None else student.resp_bytes[b]
        limit[b] = len(a) + 1 if a == c else _common_prefix(a, c)
    # Append each sample's EOS as a length-1 token (it matches the other side's EOS).
    t_off, s_off = teacher.resp_offsets, student.resp_offsets
    t_len = np.insert(t_len, t_off[1:], 1)
    s_len = np.insert(s_len, s_off[1:], 1)
    t_off = t_off + np.arange(num + 1)
    s_off = s_off + np.arange(num + 1)
    groups = sync_groups(t_len, t_off, s_len, s_off, ~literal, limit=limit)
    anchor = (groups.t_first == groups.t_last) & (groups.s_first == groups.s_last)
    idx = np.flatnonzero(anchor)
    sample = groups.sample[idx]
    first = np.ones(idx.shape, bool)
    first[1:] = sample[1:] != sample[:-1]
    # local (per-sample) token indices, EOS = response length
    t_start = np.where(first, t_off[:-1][sample], np.r_[-1, groups.t_last[idx][:-1]] + 1) - t_off[:-1][sample]
    s_start = np.where(first, s_off[:-1][sample], np.r_[-1, groups.s_last[idx][:-1]] + 1) - s_off[:-1][sample]
    t_end = groups.t_last[idx] + 1 - t_off[:-1][sample]
    s_end = groups.s_last[idx] + 1 - s_off[:-1][sample]
    local = np.stack([sample, t_start, t_end, s_start, s_end], axis=1).astype(np.int64).reshape(-1, 5)
    extra = []
    for b in np.flatnonzero(literal):
        for seg in literal_walk(decoded_pieces(teacher, b), decoded_pieces(student, b)):
            extra.append((b, *seg))
    if extra:
        local = np.concatenate([local, np.asarray(extra, np.int64).reshape(-1, 5)])
        local = local[np.argsort(local[:, 0] * (1 << 32) + local[:, 1], kind="stable")]
    sample = local[:, 0]
    t_base, s_base = teacher.row_base[sample], student.row_base[sample]
    segments = np.stack([sample, t_base + local[:, 1], t_base + local[:, 2],
                         s_base + local[:, 3], s_base + local[:, 4]], axis=1)
    t_resp = (teacher.resp_offsets[1:] - teacher.resp_offsets[:-1])[sample]
    return SimCTSegments(
        segments=segments.astype(np.int32).reshape(-1, 5),
        is_span=((local[:, 2] - local[:, 1]) > 1) | ((local[:, 4] - local[:, 3]) > 1),
        ends_with_eos=local[:, 2] == t_resp + 1)
