"""Host side: one micro-batch of a collected batch (collector.HostBatch) -> padded numpy arrays.

Row convention: a sequence of length L is padded on the right to T; the logits row that
predicts the token at position p is row p − 1, and its flat index in the [M·T] rows of the
micro-batch is i·T + p − 1. The collected batch uses the same convention with its own T, so
rows move to a micro-batch by (b − start)·T_micro + (row mod T_batch).

Shapes are bucketed so jit sees few distinct shapes: each micro-batch is padded to ITS longest
sequence rounded up to a length bucket (`length_bucket`; not to the longest of the whole batch,
and host.sort_by_length makes micro-batches of similar lengths), row counts to a power of two
(at least `min_rows`); padding rows carry weight 0 and index 0.
"""
from __future__ import annotations

import numpy as np

from ctopd_jax.algorithms.micro_batch import MicroBatch


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def rows_bucket(n: int, min_rows: int = 64) -> int:
    size = min_rows
    while size < n:
        size *= 2
    return size


def padded(values: np.ndarray, size: int, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """`values` zero-padded to `size`, and a weight that is 1 on the real entries."""
    out = np.zeros(size, dtype)
    out[:len(values)] = values
    weight = np.zeros(size, np.float32)
    weight[:len(values)] = 1.0
    return out, weight


def padded_rows(values: np.ndarray, size: int, fill=0) -> np.ndarray:
    """[n, C] `values` padded with `fill` rows to [size, C] (its dtype kept)."""
    out = np.full((size,) + values.shape[1:], fill, values.dtype)
    out[:len(values)] = values
    return out


def length_bucket(n: int, multiple: int = 64) -> int:
    """A few lengths only (one compile each): multiples of `multiple` up to 8 of them, then
    1.5x / 2x geometric steps (64, 128, ..., 512, 768, 1024, 1536, 2048, 3072, 4096, ...)."""
    size = multiple
    while size < n:
        size = size + multiple if size < 8 * multiple else (size * 3 // 2 if (size & (size - 1)) == 0 else
                                                             size * 4 // 3)
    return size


def micro_length(side, start: int, stop: int, length_multiple: int) -> int:
    """The micro-batch's own padded length: its longest sequence, rounded up to a bucket."""
    longest = int(side.attention_mask[start:stop].sum(axis=1).max(initial=1))
    return min(length_bucket(longest, length_multiple), round_up(side.seq_len, length_multiple))


def tokens(side, start: int, stop: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [M, length], mask [M, length]) of samples [start, stop), cut or padded to length."""
    ids = np.zeros((stop - start, length), np.int32)
    mask = np.zeros((stop - start, length), bool)
    n = min(length, side.seq_len)
    ids[:, :n] = side.input_ids[start:stop, :n]
    mask[:, :n] = side.attention_mask[start:stop, :n]
    return ids, mask


def rebase(rows: np.ndarray, batch_len: int, start: int, micro_len: int) -> np.ndarray:
    """Flat rows of the collected batch -> flat rows of the micro-batch starting at `start`."""
    rows = np.asarray(rows, np.int64)
    return (rows // batch_len - start) * micro_len + rows % batch_len


def micro_batch(host, start: int, stop: int, length_multiple: int = 64,
                min_rows: int = 64) -> MicroBatch:
    """The shared fields of samples [start, stop): student tokens, every response row (targets,
    weights), rollout-time log-probs and the teacher's tokens; the objective adds its
    teacher_rows and terms (dataclasses.replace)."""
    s, t = host.student, host.teacher
    ts = micro_length(s, start, stop, length_multiple)
    ids, mask = tokens(s, start, stop, ts)
    batch_rows = response_batch_rows(s, start, stop)
    targets = s.labels.reshape(-1)[batch_rows]
    size = rows_bucket(len(batch_rows), min_rows)
    rows, weight = padded(rebase(batch_rows, s.seq_len, start, ts), size)
    before = int(s.loss_mask[:start].sum())
    if host.rollout_logprobs is None:
        lp = lp_w = np.zeros(len(batch_rows), np.float32)
    else:
        lp = host.rollout_logprobs[0][before:before + len(batch_rows)]
        lp_w = host.rollout_logprobs[1][before:before + len(batch_rows)]
    t_ids, t_mask = tokens(t, start, stop, micro_length(t, start, stop, length_multiple))
    return MicroBatch(student_ids=ids, student_mask=mask, response_rows=rows,
                      response_targets=padded(targets, size)[0], response_weight=weight,
                      rollout_logprobs=padded(lp, size, np.float32)[0],
                      rollout_logprob_weight=padded(lp_w, size, np.float32)[0],
                      teacher_ids=t_ids, teacher_mask=t_mask)


def response_batch_rows(side, start: int, stop: int) -> np.ndarray:
    """Flat rows of the collected batch that predict a response token (EOS included) of
    samples [start, stop), in loss-mask order (micro_batch's response-row order)."""
    return np.flatnonzero(side.loss_mask[start:stop].reshape(-1)) + start * side.seq_len


def served_token_logprobs(host, teacher_rows: np.ndarray, size: int) -> np.ndarray:
    """A served teacher's log π_T of the token each of `teacher_rows` predicts (flat rows of the
    collected teacher batch), zero-padded to `size`: the served scores
    (host.served_teacher_rows, teacher_service.batch_rows) lie on exactly those rows."""
    return padded(host.served_teacher_rows.token_logprobs[teacher_rows], size, np.float32)[0]


def expand_ranges(first, count) -> tuple[np.ndarray, np.ndarray]:
    """Every index first[g] .. first[g] + count[g] − 1 in group order, and its group id g."""
    group = np.repeat(np.arange(len(first)), count)
    offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(np.asarray(first, np.int64), count) + offset, group
