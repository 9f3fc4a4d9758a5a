"""Host side: aligned samples -> padded int32 arrays of one micro-batch.

Row convention (decided here, SPEC is silent): a sequence of length L is padded on the right
to T; the logits row that predicts the token at position p is row p - 1, and its flat index in
the [M*T] rows of the micro-batch is i*T + p - 1. Response position j of sample i (0-based,
the appended EOS is the last one) is token position prompt_len + j.

Shapes are bucketed so jit sees few distinct shapes: sequence lengths round up to a multiple
of `length_multiple`, row counts to a power of two (at least `min_rows`); padding rows carry
weight 0 and index 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class AlignedSample:
    """One rollout after re-tokenization and strict alignment (SPEC §1 step 3, §2)."""
    student_ids: np.ndarray          # prompt + response + EOS (student tokenizer)
    student_prompt_len: int
    teacher_ids: np.ndarray          # prompt + response + EOS (teacher tokenizer)
    teacher_prompt_len: int
    strict_student: np.ndarray       # response positions (incl. EOS) of strict pairs, student side
    strict_teacher: np.ndarray       # the paired teacher response positions
    bytes_match: bool = True         # False: response bytes differ across sides (no pairs)
    rollout_logprobs: np.ndarray | None = None  # engine log-probs of the sampled tokens, when
                                                # the re-tokenized response equals them
    response_text: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def student_response_tokens(self) -> int:
        return len(self.student_ids) - self.student_prompt_len

    @property
    def teacher_response_tokens(self) -> int:
        return len(self.teacher_ids) - self.teacher_prompt_len


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def rows_bucket(n: int, min_rows: int = 64) -> int:
    size = min_rows
    while size < n:
        size *= 2
    return size


def _pad_tokens(seqs: Sequence[np.ndarray], length: int, pad_id: int):
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), bool)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)] = seq
        mask[i, :len(seq)] = True
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy()
    return ids, positions, mask


def _padded_rows(values: list[np.ndarray], size: int, dtype=np.int32):
    """Concatenate, zero-pad to `size`; weight 1 on real entries."""
    flat = np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype)
    out = np.zeros(size, dtype)
    out[:len(flat)] = flat
    weight = np.zeros(size, np.float32)
    weight[:len(flat)] = 1.0
    return out, weight


def _finish(s_ids, s_mask, t_ids, t_mask, response_rows, response_targets, rollout_lp, rollout_lp_w,
            strict_s, strict_t, min_rows: int) -> dict[str, np.ndarray]:
    r_size = rows_bucket(len(response_rows), min_rows)
    k_size = rows_bucket(len(strict_s), min_rows)
    rows, weight = _padded_rows([response_rows], r_size)
    targets, _ = _padded_rows([response_targets], r_size)
    logprobs, _ = _padded_rows([rollout_lp], r_size, np.float32)
    logprob_weight, _ = _padded_rows([rollout_lp_w], r_size, np.float32)
    strict_student_rows, strict_weight = _padded_rows([strict_s], k_size)
    strict_teacher_rows, _ = _padded_rows([strict_t], k_size)
    positions = lambda ids: np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    return {
        "student_ids": s_ids.astype(np.int32), "student_positions": positions(s_ids),
        "student_mask": s_mask.astype(bool),
        "teacher_ids": t_ids.astype(np.int32), "teacher_positions": positions(t_ids),
        "teacher_mask": t_mask.astype(bool),
        "response_rows": rows, "response_targets": targets, "response_weight": weight,
        "rollout_logprobs": logprobs, "rollout_logprob_weight": logprob_weight,
        "strict_student_rows": strict_student_rows, "strict_teacher_rows": strict_teacher_rows,
        "strict_weight": strict_weight,
    }


def pack_micro_batch(samples: Sequence[AlignedSample], student_pad_id: int, teacher_pad_id: int,
                     length_multiple: int = 64, min_rows: int = 64) -> dict[str, np.ndarray]:
    """Pack per-sample records (tests and custom pipelines)."""
    ts = round_up(max(len(s.student_ids) for s in samples), length_multiple)
    tt = round_up(max(len(s.teacher_ids) for s in samples), length_multiple)
    s_ids, _, s_mask = _pad_tokens([s.student_ids for s in samples], ts, student_pad_id)
    t_ids, _, t_mask = _pad_tokens([s.teacher_ids for s in samples], tt, teacher_pad_id)
    response_rows, response_targets, strict_s, strict_t, lp, lp_w = [], [], [], [], [], []
    for i, s in enumerate(samples):
        positions = np.arange(s.student_prompt_len, len(s.student_ids))
        response_rows.append(i * ts + positions - 1)
        response_targets.append(s.student_ids[positions])
        strict_s.append(i * ts + s.student_prompt_len + np.asarray(s.strict_student, np.int64) - 1)
        strict_t.append(i * tt + s.teacher_prompt_len + np.asarray(s.strict_teacher, np.int64) - 1)
        have = s.rollout_logprobs is not None and len(s.rollout_logprobs) == len(positions)
        lp.append(np.asarray(s.rollout_logprobs, np.float32) if have else np.zeros(len(positions), np.float32))
        lp_w.append(np.full(len(positions), 1.0 if have else 0.0, np.float32))
    cat = np.concatenate
    return _finish(s_ids, s_mask, t_ids, t_mask, cat(response_rows), cat(response_targets), cat(lp), cat(lp_w),
                   cat(strict_s), cat(strict_t), min_rows)


def slice_micro_batch(student, teacher, alignment, start: int, stop: int,
                      rollout_logprobs: tuple[np.ndarray, np.ndarray] | None = None,
                      min_rows: int = 64) -> dict[str, np.ndarray]:
    """Samples [start, stop) of a re-tokenized batch pair (`tokenization.retokenize`) and its
    `align.strict_align` result, with flat rows re-based to the micro-batch.

    rollout_logprobs: (values, weights) over the whole batch's response rows in `loss_mask`
    order (sample-major), weight 0 where the engine's sampled tokens differ from the re-tokenized
    response (then there is nothing to compare)."""
    ts, tt = student.seq_len, teacher.seq_len
    s_mask_rows = student.loss_mask[start:stop].reshape(-1)
    response_rows = np.flatnonzero(s_mask_rows)
    response_targets = student.labels[start:stop].reshape(-1)[response_rows]
    if rollout_logprobs is None:
        lp = np.zeros(len(response_rows), np.float32)
        lp_w = np.zeros(len(response_rows), np.float32)
    else:
        before = int(student.loss_mask[:start].sum())
        lp = rollout_logprobs[0][before:before + len(response_rows)]
        lp_w = rollout_logprobs[1][before:before + len(response_rows)]
    sel = (alignment.pair_sample >= start) & (alignment.pair_sample < stop)
    strict_s = alignment.student_rows[sel].astype(np.int64) - start * ts
    strict_t = alignment.teacher_rows[sel].astype(np.int64) - start * tt
    return _finish(student.input_ids[start:stop], student.attention_mask[start:stop],
                   teacher.input_ids[start:stop], teacher.attention_mask[start:stop],
                   response_rows, response_targets, lp, lp_w, strict_s, strict_t, min_rows)
