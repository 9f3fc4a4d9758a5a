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
    groups: Groups                   # all groups (token indices), for atoms / segments

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


def token_rows(batch: RetokenizedBatch) -> np.ndarray:
    """int64 [N]: the logits row predicting each flat response token (EOS excluded)."""
    counts = np.diff(batch.resp_offsets)
    sample = np.repeat(np.arange(batch.batch_size), counts)
    local = np.arange(batch.resp_offsets[-1]) - batch.resp_offsets[:-1][sample]
    return batch.row_base[sample] + local


def compute_groups(teacher: RetokenizedBatch, student: RetokenizedBatch,
                   mismatch: np.ndarray) -> Groups:
    return sync_groups(teacher.resp_byte_len, teacher.resp_offsets, student.resp_byte_len,
                       student.resp_offsets, ~mismatch)


def strict_align(teacher: RetokenizedBatch, student: RetokenizedBatch) -> StrictAlignment:
    """Strict pairs, mismatch groups, EOS pairs and coverage for a re-tokenized batch pair."""
    mismatch = byte_mismatch(teacher, student)
    groups = compute_groups(teacher, student, mismatch)
    t_rows, s_rows = token_rows(teacher), token_rows(student)
    one_to_one = ((groups.t_first == groups.t_last) & (groups.s_first == groups.s_last)
                  & ~groups.trailing)
    cand = np.flatnonzero(one_to_one)
    t_tok, s_tok = groups.t_last[cand], groups.s_last[cand]
    strict = np.zeros(len(groups), dtype=bool)
    strict[cand] = ((teacher.resp_byte_len[t_tok] > 0) & teacher.resp_pairable[t_tok]
                    & student.resp_pairable[s_tok])
    ok = np.flatnonzero(~mismatch)
    eos_t = teacher.row_base[ok] + teacher.response_lens[ok] - 1
    eos_s = student.row_base[ok] + student.response_lens[ok] - 1
    pair_t = np.concatenate([t_rows[groups.t_last[strict]], eos_t])
    pair_s = np.concatenate([s_rows[groups.s_last[strict]], eos_s])
    pair_sample = np.concatenate([groups.sample[strict], ok])
    is_eos = np.concatenate([np.zeros(int(strict.sum()), bool), np.ones(ok.shape, bool)])
    order = np.argsort(pair_t, kind="stable")
    rest = ~strict
    g_sample = groups.sample[rest]
    mismatch_rows = np.stack([
        g_sample,
        _start_row(teacher, groups.t_first[rest], g_sample),
        _start_row(teacher, groups.t_last[rest] + 1, g_sample),
        _start_row(student, groups.s_first[rest], g_sample),
        _start_row(student, groups.s_last[rest] + 1, g_sample),
    ], axis=1).astype(np.int32).reshape(-1, 5)
    per_sample = np.bincount(pair_sample, minlength=teacher.batch_size).astype(np.int32)
    return StrictAlignment(
        teacher_rows=pair_t[order].astype(np.int32), student_rows=pair_s[order].astype(np.int32),
        pair_sample=pair_sample[order].astype(np.int32), pair_is_eos=is_eos[order],
        mismatch_groups=mismatch_rows, byte_mismatch=mismatch, teacher_pairs=per_sample,
        teacher_response_tokens=teacher.response_lens.copy(),
        student_response_tokens=student.response_lens.copy(), groups=groups)


def _start_row(batch: RetokenizedBatch, token_index: np.ndarray, sample: np.ndarray):
    """Logits row of flat token index (possibly one past a sample's last token)."""
    return batch.row_base[sample] + token_index - batch.resp_offsets[:-1][sample]


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
