"""Packed rows: the samples of a micro-batch laid end to end in rows of a token budget, several
per row, instead of one right-padded row each (pack.py's layout).

    ranges = micro_ranges(student_lengths, teacher_lengths, budget)  # the micro-batches
    arrays = objective.prepare(host, start, stop)                    # one sample per row
    arrays = pack_rows(arrays, objective.packed_rows, budget)        # several samples per row

Layout, per side (`student_*`, `teacher_*`): rows of width W = the length bucket of the
micro-batch's longest sample (pack.length_bucket, as unpacked), budget // W of them (at least
one); the samples go first-fit into them in order (the collector orders a batch longest first,
so this is first-fit decreasing). A micro-batch is the consecutive samples that fit that way on
both sides. One shape per width bucket, as unpacked; attention costs rows · W², as unpacked,
but the rows hold several short samples instead of one each.

The mask becomes int32 segment ids (sample i of the micro-batch is segment i + 1, pads 0),
which the decoder reads as "attend only inside your segment, positions restart at each
segment" (models/decoder.py, kv_cache.prefill_positions). Every flat row index of that side
(the keys the objective names in `packed_rows`) moves from (sample b, position p) =
divmod(row, T) to row_b · W + offset_b + p, so each per-token term (response, strict pair,
span, teacher row) reads the same hidden state as before: the loss sums are those of the
unpacked micro-batch up to float summation order.

An objective declares `packed_rows` = {array key: "student" | "teacher"} for every array of
flat row indices its `prepare` makes; None declares that it cannot pack, and the loop keeps one
row per sample for it. A key ending in `_rows` that the declaration leaves out is an error, not
a silent misread.
"""
from __future__ import annotations

import numpy as np

from ctopd_jax.algorithms.pack import length_bucket, round_up

SIDES = ("student", "teacher")


class PackingError(ValueError):
    """Arrays that cannot be packed as declared (a programming error of an objective)."""


def shape(lengths, budget: int | None, cap: int) -> tuple[int, int]:
    """(rows, width) of the packed rows of samples of these lengths: width their longest's
    length bucket, at most `cap` (the side's padded length, as pack.micro_length); budget
    None: as many rows as samples, so any of them fit (a batch shard's part of a micro-batch)."""
    width = min(length_bucket(max(int(max(lengths, default=1)), 1)), cap)
    return (len(lengths) if budget is None else max(1, budget // width)), width


def first_fit(lengths, budget: int | None, cap: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(row, offset) of each sample, first-fit into `shape(lengths, budget, cap)`; None if they
    do not all fit."""
    rows, width = shape(lengths, budget, cap)
    used = np.zeros(rows, np.int64)
    row, offset = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    for i, n in enumerate(lengths):
        free = np.flatnonzero(used + n <= width)
        if not len(free):
            return None
        row[i], offset[i] = free[0], used[free[0]]
        used[free[0]] += n
    return row, offset


def micro_ranges(lengths: np.ndarray, first: int, budget: int, caps) -> list[tuple[int, int]]:
    """Consecutive [start, stop) of samples `first`.. whose lengths ([n, sides]) each side's
    rows hold (first_fit; `caps`: each side's padded length); a sample alone always fits."""
    ranges, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or any(first_fit(lengths[start:i + 1, s], budget, caps[s]) is None
                                    for s in range(lengths.shape[1])):
            ranges.append((first + start, first + i))
            start = i
    return ranges


def host_micro_ranges(host, first: int, last: int, budget: int) -> list[tuple[int, int]]:
    """micro_ranges of samples [first, last) of a host batch: each side's real tokens, in rows
    at most that side's padded length wide (its sequence length rounded up to 64, as the
    objectives' arrays are)."""
    sides = (host.student, host.teacher)
    lengths = np.stack([side.attention_mask[first:last].sum(axis=1) for side in sides], 1)
    return micro_ranges(lengths, first, budget, [round_up(side.seq_len, 64) for side in sides])


def lengths_of(mask: np.ndarray) -> np.ndarray:
    """Real tokens per sample of right-padded rows; raises for other padding."""
    lengths = mask.sum(axis=1).astype(np.int64)
    if not (mask == (np.arange(mask.shape[1]) < lengths[:, None])).all():
        raise PackingError("packed rows need right-padded samples (real tokens first)")
    return lengths


def move_rows(rows: np.ndarray, width: int, flat_start: np.ndarray, lengths: np.ndarray, key: str) -> np.ndarray:
    """Flat rows of [M, width] (one sample per row) -> flat rows of the packed rows, where
    sample b starts at flat slot flat_start[b]."""
    b, p = np.divmod(np.asarray(rows, np.int64), width)
    if (b >= len(lengths)).any() or (p >= np.maximum(lengths[b.clip(max=len(lengths) - 1)], 1)).any():
        raise PackingError(f"{key}: a row index points past its sample's tokens")
    return (flat_start[b] + p).astype(np.asarray(rows).dtype)


def pack_rows(arrays: dict[str, np.ndarray], row_keys: dict[str, str],
              budget: int | None) -> dict[str, np.ndarray]:
    """`arrays` of one micro-batch (one sample per row) with both sides packed (module doc)."""
    undeclared = sorted(k for k in arrays if k.endswith("_rows") and k not in row_keys)
    if undeclared:
        raise PackingError(f"row arrays {undeclared} are not in the objective's packed_rows")
    out = dict(arrays)
    for side in SIDES:
        if f"{side}_ids" not in arrays:
            continue
        ids, lengths = arrays[f"{side}_ids"], lengths_of(arrays[f"{side}_mask"])
        placed = first_fit(lengths, budget, ids.shape[1])
        if placed is None:
            raise PackingError(f"the {side} samples do not fit rows of {budget} tokens (micro_ranges)")
        (rows, width), (row, offset) = shape(lengths, budget, ids.shape[1]), placed
        packed, segments = np.zeros((rows, width), ids.dtype), np.zeros((rows, width), np.int32)
        for b, (r, at, n) in enumerate(zip(row, offset, lengths)):
            packed[r, at:at + n] = ids[b, :n]
            segments[r, at:at + n] = b + 1
        out[f"{side}_ids"], out[f"{side}_mask"] = packed, segments
        for key, owner in row_keys.items():
            if owner == side and key in arrays:
                out[key] = move_rows(arrays[key], ids.shape[1], row * width + offset, lengths, key)
    return out
