"""SimCT segments (SPEC §7) from the shared group machine.

SimCT walks the cumulative DECODED strings of the two label sequences (each id decoded on its
own) and closes a segment when the histories are equal and the next decoded tokens match (or
both are EOS); the mismatched region before such an anchor is merged with it, and a trailing
unanchored region is dropped.

Equivalence used here: with histories compared as strings and advanced by length, equal
histories happen exactly at the common cumulative offsets that lie within the common prefix of
the two decoded strings, and "next tokens match" is a 1:1 group there. So the segments are the
groups of ``sync_groups`` on decoded lengths, limited to that prefix, each run of non-1:1
groups merged into the following 1:1 group. The EOS is a final length-1 token on both sides
that matches iff the whole decoded responses are equal.

Decision: a token's decoded string is its byte view decoded as UTF-8 with replacement
(U+FFFD per invalid sequence), which equals ``tokenizer.decode([id])`` for ByteLevel
vocabularies; for SentencePiece it keeps the token's ``▁`` as a space, where ``decode([id])``
would strip it and make every history differ.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.align.sync import sync_groups
from ctopd_jax.tokenization.retokenize import RetokenizedBatch
from ctopd_jax.tokenization.side import TokenizerSide


@dataclasses.dataclass(frozen=True, eq=False)
class SimCTSegments:
    segments: np.ndarray   # int32 [S, 5]: sample, t_start, t_end, s_start, s_end (flat logits
    #                        rows, end exclusive); the EOS anchor is the last row of its segment
    is_span: np.ndarray    # bool [S]: more than one token on either side (a virtual column)
    ends_with_eos: np.ndarray  # bool [S]

    def __len__(self) -> int:
        return int(self.segments.shape[0])


def _decoded_table(side: TokenizerSide):
    cache = side.__dict__.setdefault("_simct_cache", {})
    if "table" not in cache:
        decoded = [b.decode("utf-8", "replace").encode("utf-8") for b in side.token_bytes]
        cache["table"] = decoded
        cache["len"] = np.fromiter(map(len, decoded), np.int64, len(decoded))
        cache["same"] = np.fromiter((d == b for d, b in zip(decoded, side.token_bytes)), bool,
                                    len(decoded))
    return cache


def _decoded_view(side: TokenizerSide, batch: RetokenizedBatch):
    """Per token decoded byte length, and per sample the decoded string (only where it may
    differ from ``resp_bytes``; None means 'equal to resp_bytes')."""
    cache = _decoded_table(side)
    ids = batch.resp_ids
    lengths = cache["len"][ids]
    exact = cache["same"][ids] & ~batch.resp_stripped
    texts = []
    for b in range(batch.batch_size):
        lo, hi = batch.resp_offsets[b], batch.resp_offsets[b + 1]
        if exact[lo:hi].all():
            texts.append(None)
            continue
        pieces = []
        for k in range(lo, hi):
            raw = side.token_bytes[ids[k]][1:] if batch.resp_stripped[k] else side.token_bytes[ids[k]]
            piece = raw.decode("utf-8", "replace").encode("utf-8")
            lengths[k] = len(piece)
            pieces.append(piece)
        texts.append(b"".join(pieces))
    return lengths, texts


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


def simct_segments(teacher_side: TokenizerSide, student_side: TokenizerSide,
                   teacher: RetokenizedBatch, student: RetokenizedBatch) -> SimCTSegments:
    t_len, t_text = _decoded_view(teacher_side, teacher)
    s_len, s_text = _decoded_view(student_side, student)
    num = teacher.batch_size
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
    groups = sync_groups(t_len, t_off, s_len, s_off, np.ones(num, bool), limit=limit)
    anchor = (groups.t_first == groups.t_last) & (groups.s_first == groups.s_last)
    idx = np.flatnonzero(anchor)
    sample = groups.sample[idx]
    first = np.ones(idx.shape, bool)
    first[1:] = sample[1:] != sample[:-1]
    t_start = np.where(first, t_off[:-1][sample], np.r_[-1, groups.t_last[idx][:-1]] + 1)
    s_start = np.where(first, s_off[:-1][sample], np.r_[-1, groups.s_last[idx][:-1]] + 1)
    t_end, s_end = groups.t_last[idx] + 1, groups.s_last[idx] + 1

    def rows(batch, offsets, token):
        return batch.row_base[sample] + token - offsets[:-1][sample]

    segments = np.stack([sample, rows(teacher, t_off, t_start), rows(teacher, t_off, t_end),
                         rows(student, s_off, s_start), rows(student, s_off, s_end)],
                        axis=1).astype(np.int32).reshape(-1, 5)
    return SimCTSegments(
        segments=segments,
        is_span=((t_end - t_start) > 1) | ((s_end - s_start) > 1),
        ends_with_eos=groups.t_last[idx] == t_off[1:][sample] - 1)
