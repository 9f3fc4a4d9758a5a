"""Strict 1:1 byte alignment of a batch (SPEC §2) as compact int32 index arrays.

Rows are flat indices into the ``[B * T]`` LOGITS rows of each side: the row that PREDICTS the
paired token (``row_base[b] + k`` for response token ``k``; see ``retokenize``). Pairs are
sorted by sample and position and strictly increasing on both sides within a sample.

Coverage (decision): the EOS pair counts as a strict pair and the EOS as a response token,
so ``student_coverage = num_pairs / num_student_response_tokens`` with the same denominator
as the loss normalization of SPEC §1; the teacher coverage uses the teacher's token count.
A byte-mismatched sample yields no pairs (not even EOS) but its tokens stay in the
denominators.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.align.sync import Groups, sync_groups
from ctopd_jax.tokenization.retokenize import RetokenizedBatch


@dataclasses.dataclass(frozen=True, eq=False)
class StrictAlignment:
    teacher_rows: np.ndarray         # int32 [P] flat teacher logits rows (EOS pairs included)
    student_rows: np.ndarray         # int32 [P] flat student logits rows
    pair_sample: np.ndarray          # int32 [P]
    pair_is_eos: np.ndarray          # bool [P]
    mismatch_groups: np.ndarray      # int32 [G, 5]: sample, t_start, t_end, s_start, s_end
    #                                  (flat logits rows, end exclusive; a side may be empty)
    byte_mismatch: np.ndarray        # bool [B]: concatenated bytes differ -> no pairs
    teacher_pairs: np.ndarray        # int32 [B] strict pairs per sample (EOS included)
    teacher_response_tokens: np.ndarray  # int32 [B] EOS included
    student_response_tokens: np.ndarray  # int32 [B] EOS included
    group_source: tuple              # (teacher batch, student batch) for ``groups``

    @property
    def groups(self) -> Groups:
        """All groups in flat token indices (strict and mismatch; computed on first use)."""
        cached = self.__dict__.get("_groups")
        if cached is None:
            teacher, student = self.group_source
            cached = compute_groups(teacher, student, self.byte_mismatch)
            object.__setattr__(self, "_groups", cached)
        return cached

    @property
    def num_pairs(self) -> int:
        return int(self.teacher_rows.shape[0])

    @property
    def num_student_response_tokens(self) -> int:
        """The normalization denominator of SPEC §1 (EOS included, aligned or not)."""
        return int(self.student_response_tokens.sum())

    @property
    def num_byte_mismatch(self) -> int:
        return int(self.byte_mismatch.sum())

    @property
    def student_coverage(self) -> float:
        return self.num_pairs / max(1, self.num_student_response_tokens)

    @property
    def teacher_coverage(self) -> float:
        return self.num_pairs / max(1, int(self.teacher_response_tokens.sum()))

    def mismatch_size_histogram(self) -> dict[tuple[int, int], int]:
        """{(teacher tokens, student tokens): count} over mismatch groups."""
        sizes = np.stack([self.mismatch_groups[:, 2] - self.mismatch_groups[:, 1],
                          self.mismatch_groups[:, 4] - self.mismatch_groups[:, 3]], axis=1)
        keys, counts = np.unique(sizes, axis=0, return_counts=True)
        return {(int(a), int(b)): int(c) for (a, b), c in zip(keys, counts)}


def byte_mismatch(teacher: RetokenizedBatch, student: RetokenizedBatch) -> np.ndarray:
    if teacher.batch_size != student.batch_size:
        raise ValueError(f"batch: teacher has {teacher.batch_size} samples, student "
                         f"{student.batch_size}; re-tokenize the same responses on both sides")
    return np.fromiter((a != b for a, b in zip(teacher.resp_bytes, student.resp_bytes)),
                       dtype=bool, count=teacher.batch_size)


def _gather_flag(flags: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``flags[index]``, False where a trailing group's empty side points outside."""
    if flags.size == 0:
        return np.zeros(index.shape, bool)
    if index.size and (index.min() < 0 or index.max() >= flags.size):
        return np.where((index >= 0) & (index < flags.size),
                        flags[np.clip(index, 0, flags.size - 1)], False)
    return flags[index]


def row_shift(batch: RetokenizedBatch) -> np.ndarray:
    """int64 [B]: add to a flat response-token index of sample b to get its logits row."""
    return batch.row_base - batch.resp_offsets[:-1]


def compute_groups(teacher: RetokenizedBatch, student: RetokenizedBatch,
                   mismatch: np.ndarray) -> Groups:
    return sync_groups(teacher.resp_byte_len, teacher.resp_offsets, student.resp_byte_len,
                       student.resp_offsets, ~mismatch)


class ByteMismatchError(ValueError):
    """A response whose byte views differ between the sides (it does not round-trip)."""


def describe_byte_mismatch(teacher: RetokenizedBatch, student: RetokenizedBatch, b: int) -> str:
    t, s = teacher.resp_bytes[b], student.resp_bytes[b]
    at = next((i for i, (x, y) in enumerate(zip(t, s)) if x != y), min(len(t), len(s)))
    return (f"sample {b}: teacher and student byte views differ at byte {at} "
            f"(teacher {t[max(0, at - 8):at + 8]!r}, student {s[max(0, at - 8):at + 8]!r}); "
            "a normalizer (e.g. Qwen's NFC), an <unk> token or a merge across the prompt "
            "boundary changed the text on one side")


def strict_align(teacher: RetokenizedBatch, student: RetokenizedBatch, fast: bool = True,
                 on_byte_mismatch: str = "count") -> StrictAlignment:
    """Strict pairs, mismatch groups, EOS pairs and coverage for a re-tokenized batch pair.

    ``on_byte_mismatch``: "count" (SPEC §2: the sample yields no pairs and is counted) or
    "raise" (``ByteMismatchError`` naming the first such sample and byte, for tools that
    check a data set). ``fast`` takes the closer-space path when every sample's bytes agree
    and no token is empty (the usual batch); both paths give identical arrays (tested)."""
    if on_byte_mismatch not in ("count", "raise"):
        raise ValueError(f"on_byte_mismatch: {on_byte_mismatch!r}; use 'count' or 'raise'")
    mismatch = byte_mismatch(teacher, student)
    if on_byte_mismatch == "raise" and mismatch.any():
        raise ByteMismatchError(describe_byte_mismatch(teacher, student,
                                                       int(np.flatnonzero(mismatch)[0])))
    if fast and not mismatch.any() and teacher.resp_byte_len.size and \
            student.resp_byte_len.size and teacher.resp_byte_len.min() > 0 and \
            student.resp_byte_len.min() > 0:
        return _strict_fast(teacher, student, mismatch)
    groups = compute_groups(teacher, student, mismatch)
    strict = (groups.t_first == groups.t_last) & (groups.s_first == groups.s_last)
    if groups.trailing.any():
        strict &= ~groups.trailing
    # a token may pair only if it is not an added token and holds a byte
    t_can = teacher.resp_pairable & (teacher.resp_byte_len > 0)
    strict &= _gather_flag(t_can, groups.t_last) & _gather_flag(student.resp_pairable,
                                                                groups.s_last)
    t_shift, s_shift = row_shift(teacher), row_shift(student)
    t_end_row = groups.t_last + t_shift[groups.sample]  # row of each group's last token
    s_end_row = groups.s_last + s_shift[groups.sample]
    keep = np.flatnonzero(strict)
    sample = groups.sample[keep]
    pair_t, pair_s = t_end_row[keep], s_end_row[keep]
    # EOS pairs go after each ok sample's last strict pair (both sides stay increasing).
    ok = np.flatnonzero(~mismatch)
    at = np.searchsorted(sample, ok, "right")
    pair_t = np.insert(pair_t, at, teacher.row_base[ok] + teacher.response_lens[ok] - 1)
    pair_s = np.insert(pair_s, at, student.row_base[ok] + student.response_lens[ok] - 1)
    pair_sample = np.insert(sample, at, ok)
    is_eos = np.insert(np.zeros(sample.shape, bool), at, True)
    rest = np.flatnonzero(~strict)
    mismatch_rows = np.stack([
        groups.sample[rest],
        t_end_row[rest] - (groups.t_last[rest] - groups.t_first[rest]), t_end_row[rest] + 1,
        s_end_row[rest] - (groups.s_last[rest] - groups.s_first[rest]), s_end_row[rest] + 1,
    ], axis=1).astype(np.int32).reshape(-1, 5)
    per_sample = np.bincount(pair_sample, minlength=teacher.batch_size).astype(np.int32)
    return StrictAlignment(
        teacher_rows=pair_t.astype(np.int32), student_rows=pair_s.astype(np.int32),
        pair_sample=pair_sample.astype(np.int32), pair_is_eos=is_eos,
        mismatch_groups=mismatch_rows, byte_mismatch=mismatch, teacher_pairs=per_sample,
        teacher_response_tokens=teacher.response_lens.copy(),
        student_response_tokens=student.response_lens.copy(), group_source=(teacher, student))


def _strict_fast(teacher: RetokenizedBatch, student: RetokenizedBatch,
                 mismatch: np.ndarray) -> StrictAlignment:
    """All samples byte-equal, no empty token: the samples lie end to end on one byte ruler on
    both sides, a token closes a group iff the other side ends there, and a group is 1:1 iff
    its closer follows the previous closer (or starts the sample) on both sides. Works in
    token space with bool arrays and allocates few index arrays (numpy time here is mostly
    page faults of fresh arrays)."""
    t_cum = np.cumsum(teacher.resp_byte_len)
    s_cum = np.cumsum(student.resp_byte_len)
    ruler = np.zeros(int(t_cum[-1]) + 1, dtype=bool)
    ruler[s_cum] = True
    t_close = ruler[t_cum]
    ruler[s_cum] = False
    ruler[t_cum] = True
    s_close = ruler[s_cum]
    del ruler, t_cum, s_cum

    def single(close, batch):
        """Token closes a group that holds only itself on this side (and may pair); every
        token holds a byte on this path."""
        prev = np.empty_like(close)
        prev[0] = True
        prev[1:] = close[:-1]
        prev[batch.resp_offsets[:-1][np.diff(batch.resp_offsets) > 0]] = True
        prev &= close
        prev &= batch.resp_pairable
        return prev

    t_single = single(t_close, teacher)
    s_single = single(s_close, student)
    strict_g = t_single[t_close] & s_single[s_close]  # per group, in order
    t_idx = np.flatnonzero(t_close)
    s_idx = np.flatnonzero(s_close)
    # groups per sample: every sample ends with a closer on both sides
    ends = np.searchsorted(t_idx, teacher.resp_offsets[1:], "left")
    per_sample_groups = np.diff(np.concatenate([[0], ends]))
    keep = np.flatnonzero(strict_g)
    strict_cum = np.concatenate([[0], np.cumsum(strict_g)])
    pairs_per_sample = strict_cum[ends] - strict_cum[ends - per_sample_groups]
    t_shift, s_shift = row_shift(teacher), row_shift(student)
    batch = teacher.batch_size
    # final layout: each sample's strict pairs then its EOS pair
    total = keep.size + batch
    eos_at = np.cumsum(pairs_per_sample + 1) - 1
    is_eos = np.zeros(total, dtype=bool)
    is_eos[eos_at] = True
    not_eos = ~is_eos
    teacher_rows = np.empty(total, dtype=np.int32)
    student_rows = np.empty(total, dtype=np.int32)
    rows = t_idx[keep]
    rows += np.repeat(t_shift, pairs_per_sample)
    teacher_rows[not_eos] = rows
    rows = s_idx[keep]
    rows += np.repeat(s_shift, pairs_per_sample)
    student_rows[not_eos] = rows
    teacher_rows[eos_at] = teacher.row_base + teacher.response_lens - 1
    student_rows[eos_at] = student.row_base + student.response_lens - 1
    pair_sample = np.repeat(np.arange(batch, dtype=np.int32), pairs_per_sample + 1)
    rest = np.flatnonzero(~strict_g)
    sample = np.searchsorted(ends, rest, "right")
    first = rest == (ends - per_sample_groups)[sample]  # first group of its sample
    t_last, s_last = t_idx[rest], s_idx[rest]
    t_first = np.where(first, teacher.resp_offsets[:-1][sample], t_idx[rest - 1] + 1)
    s_first = np.where(first, student.resp_offsets[:-1][sample], s_idx[rest - 1] + 1)
    t_sh, s_sh = t_shift[sample], s_shift[sample]
    mismatch_rows = np.stack([sample, t_first + t_sh, t_last + 1 + t_sh, s_first + s_sh,
                              s_last + 1 + s_sh], axis=1).astype(np.int32)
    return StrictAlignment(
        teacher_rows=teacher_rows, student_rows=student_rows, pair_sample=pair_sample,
        pair_is_eos=is_eos, mismatch_groups=mismatch_rows.reshape(-1, 5), byte_mismatch=mismatch,
        teacher_pairs=(pairs_per_sample + 1).astype(np.int32),
        teacher_response_tokens=teacher.response_lens.copy(),
        student_response_tokens=student.response_lens.copy(), group_source=(teacher, student))


class CoverageMeter:
    """Cumulative strict coverage over batches (SPEC §2: report per batch and cumulatively)."""

    def __init__(self):
        self.pairs = self.student_tokens = self.teacher_tokens = self.mismatched = 0
        self.samples = 0

    def update(self, alignment: StrictAlignment) -> dict:
        self.pairs += alignment.num_pairs
        self.student_tokens += alignment.num_student_response_tokens
        self.teacher_tokens += int(alignment.teacher_response_tokens.sum())
        self.mismatched += alignment.num_byte_mismatch
        self.samples += int(alignment.byte_mismatch.shape[0])
        return {
            "coverage_student": alignment.student_coverage,
            "coverage_teacher": alignment.teacher_coverage,
            "coverage_student_cum": self.pairs / max(1, self.student_tokens),
            "coverage_teacher_cum": self.pairs / max(1, self.teacher_tokens),
            "byte_mismatch_samples": alignment.num_byte_mismatch,
            "byte_mismatch_samples_cum": self.mismatched,
        }
