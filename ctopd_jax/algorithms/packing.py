"""Packed rows: the samples of a micro-batch laid end to end in one row per model, instead of
one right-padded row each (pack.py's layout).

    arrays = objective.prepare(host, start, stop)       # one sample per row
    arrays = pack_rows(arrays, objective.packed_rows)    # the same samples in one row per side

Per side (`student_*`, `teacher_*`): the ids become one row of its samples' tokens in sample
order, its width the token budget (else the length bucket of their total); the mask becomes int32
segment ids (sample i of the micro-batch is segment i + 1, pads 0), which the decoder reads as
"attend only inside your segment, positions restart at each segment" (models/decoder.py,
kv_cache.prefill_positions). Every flat row index of that side (the keys the objective names
in `packed_rows`) moves from (sample b, position p) = divmod(row, T) to offset_b + p, so each
per-token term (response, strict pair, span, teacher row) reads the same hidden state as
before: the loss sums are those of the unpacked micro-batch up to float summation order.

An objective declares `packed_rows` = {array key: "student" | "teacher"} for every array of
flat row indices its `prepare` makes; None declares that it cannot pack (an array indexed by
sample position, or rows the loop cannot see), and the loop keeps one row per sample for it.
A key ending in `_rows` that the declaration leaves out is an error, not a silent misread.
"""
from __future__ import annotations

import numpy as np

from ctopd_jax.algorithms.pack import length_bucket

SIDES = ("student", "teacher")


class PackingError(ValueError):
    """Arrays that cannot be packed as declared (a programming error of an objective)."""


def layout(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of right-padded samples laid end to end; raises for other padding."""
    lengths = mask.sum(axis=1).astype(np.int64)
    if not (mask == (np.arange(mask.shape[1]) < lengths[:, None])).all():
        raise PackingError("packed rows need right-padded samples (real tokens first)")
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths


def pack_side(ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
              width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids [1, W], segment ids [1, W] int32) of one side's samples in one row (`layout`): W is
    `width` when they fit it (the token budget: one shape, padding only at the row's end), else
    the length bucket of their total."""
    total = max(int(lengths.sum()), 1)
    width = width if width is not None and total <= width else length_bucket(total)
    out = np.zeros((1, width), ids.dtype)
    segments = np.zeros((1, width), np.int32)
    for b, (at, n) in enumerate(zip(offsets, lengths)):
        out[0, at:at + n] = ids[b, :n]
        segments[0, at:at + n] = b + 1
    return out, segments


def move_rows(rows: np.ndarray, width: int, offsets: np.ndarray, lengths: np.ndarray, key: str) -> np.ndarray:
    """Flat rows of [M, width] (one sample per row) -> flat rows of the packed row."""
    b, p = np.divmod(np.asarray(rows, np.int64), width)
    if (b >= len(lengths)).any() or (p >= np.maximum(lengths[b.clip(max=len(lengths) - 1)], 1)).any():
        raise PackingError(f"{key}: a row index points past its sample's tokens")
    return (offsets[b] + p).astype(np.asarray(rows).dtype)


def pack_rows(arrays: dict[str, np.ndarray], row_keys: dict[str, str],
              width: int | None = None) -> dict[str, np.ndarray]:
    """`arrays` of one micro-batch (one sample per row) with both sides packed (module doc),
    each side's row `width` slots when its tokens fit (pack_side)."""
    undeclared = sorted(k for k in arrays if k.endswith("_rows") and k not in row_keys)
    if undeclared:
        raise PackingError(f"row arrays {undeclared} are not in the objective's packed_rows")
    out = dict(arrays)
    for side in SIDES:
        if f"{side}_ids" not in arrays:
            continue
        ids, mask = arrays[f"{side}_ids"], arrays[f"{side}_mask"]
        offsets, lengths = layout(mask)
        out[f"{side}_ids"], out[f"{side}_mask"] = pack_side(ids, offsets, lengths, width)
        for key, owner in row_keys.items():
            if owner == side and key in arrays:
                out[key] = move_rows(arrays[key], ids.shape[1], offsets, lengths, key)
    return out
