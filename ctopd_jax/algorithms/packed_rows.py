"""Packed rows: the samples of a micro-batch laid end to end in rows of a token budget, several
per row, instead of one right-padded row each (pack.py's layout).

    ranges = micro_ranges(student_lengths, teacher_lengths, budget)  # the micro-batches
    batch = objective.prepare(host, start, stop)                     # one sample per row
    batch = pack_rows(batch, budget)                                 # several samples per row

The budget is `optimizer.micro_batch_tokens` (`budget`: auto, the default, is micro_batch_size
rows of the longest sequence the rollout allows, so a packed micro-batch never holds more
tokens than an unpacked one may).

Layout, per side (`student_*`, `teacher_*`): rows of width W = the micro-batch's longest
sample rounded up to a width bucket (multiples of 16 up to 128, of 64 up to 512, then
pack.length_bucket's 1.5x / 2x steps; never wider than unpacked's bucket, at most the side's
padded length); the samples go first-fit into at most budget // W such rows, in order; the
rows used, rounded up to a power of two or 1.5 times one (`row_count`), are the array's rows
(a handful of shapes per width). A micro-batch is the consecutive samples that fit that way on
both sides. Blockwise attention skips, row by row, the tiles no query of the row's samples
needs (models/attention.py), so a packed row costs about its samples' own attention, not W².

Order: `order` lays out the samples of an optimizer batch so that these consecutive
micro-batches are first-fit-decreasing bins over the whole batch: each micro-batch starts with
the longest sample left and takes, longest first, every later sample that still fits, so short
samples fill the gaps beside long ones. The cross-tokenizer collector orders each optimizer
batch so when packing (host.sort_by_length); the loss normalisation of SPEC §1 is over the
optimizer batch, so which micro-batch a sample lands in changes nothing but summation order.

The mask becomes int32 segment ids (sample i of the micro-batch is segment i + 1, pads 0),
which the decoder reads as "attend only inside your segment, positions restart at each
segment" (models/decoder.py, attention.prefill_positions). Every flat row index of that side
(each micro-batch field declared `rows(side)`, micro_batch.py, terms included) moves from (sample b, position p) =
divmod(row, T) to row_b · W + offset_b + p, so each per-token term (response, strict pair,
span, teacher row) reads the same hidden state as before: the loss sums are those of the
unpacked micro-batch up to float summation order.

An objective that cannot pack (its loss depends on the micro-batch boundaries, or its arrays
cannot move) says so with `packs = False`, and the loop keeps one row per sample for it. A
field named `*_rows` that declares no side is an error (micro_batch.map_rows), not a silent
misread.
"""
from __future__ import annotations

import copy

import numpy as np

# PackingError: raised here, defined beside the row declarations it enforces
from ctopd_jax.algorithms.micro_batch import (MicroBatch, PackingError, map_rows,  # noqa: F401
                                              side_tokens, with_side_tokens)
from ctopd_jax.algorithms.padded_rows import length_bucket, round_up

ROW_MULTIPLE = 16   # packed row widths step by 16 where unpacked's buckets step by 64
ROUNDING = 64       # each side's padded length (the objectives' arrays), as host_micro_ranges


def budget(config) -> int:
    """The token budget of a packed micro-batch (`optimizer.micro_batch_tokens`, auto
    resolved); 0: one row per sample."""
    o, r = config.optimizer, config.rollout
    if o.micro_batch_tokens != "auto":
        return o.micro_batch_tokens
    return o.micro_batch_size * round_up(r.max_prompt_len + r.generate_max_len + 1, ROUNDING)


def objective_budget(config, objective) -> int:
    """The budget `objective`'s micro-batches pack to: 0 when it cannot pack (`packs` False:
    one row per sample) or packing is off."""
    return budget(config) if objective.packs else 0


def place(lengths, budget: int | None, cap: int) -> tuple[int, int, np.ndarray, np.ndarray] | None:
    """(rows, width, row, offset): samples of these lengths first-fit, in order, into rows as
    wide as their longest's bucket (at most `cap`, the side's padded length, as
    pack.micro_length), at most budget // width of them; rows: those used, rounded up by
    row_count. budget None: up to one row per sample (a batch shard's part of a
    micro-batch). None if they do not all fit."""
    rows = Rows(lengths, budget, cap)
    if rows.row is None:
        return None
    return min(row_count(int((rows.used > 0).sum())), len(rows.used)), rows.width, rows.row, rows.offset


class Rows:
    """First-fit of samples into the rows of one side (`place`), which `order` grows one sample
    at a time: a sample that keeps the width bucket is placed into the rows as they are."""

    def __init__(self, lengths, budget: int | None, cap: int):
        self.lengths, self.budget, self.cap = [int(n) for n in lengths], budget, cap
        self.width = row_width(max(self.lengths, default=1), cap)
        limit = len(self.lengths) if budget is None else max(1, budget // self.width)
        self.used = np.zeros(max(limit, 1), np.int64)
        row, offset = np.zeros(len(self.lengths), np.int64), np.zeros(len(self.lengths), np.int64)
        for i, n in enumerate(self.lengths):
            free = np.flatnonzero(self.used + n <= self.width)
            if not len(free):
                self.row = self.offset = None
                return
            row[i], offset[i] = free[0], self.used[free[0]]
            self.used[free[0]] += n
        self.row, self.offset = row, offset

    def added(self, n: int) -> "Rows | None":
        """These rows with a sample of length n placed last, or None if it does not fit."""
        if row_width(max(self.lengths + [n]), self.cap) != self.width or self.budget is None:
            grown = Rows(self.lengths + [n], self.budget, self.cap)   # other rows: place anew
            return grown if grown.row is not None else None
        free = np.flatnonzero(self.used + n <= self.width)
        if not len(free):
            return None
        grown = copy.copy(self)
        grown.lengths, grown.used = self.lengths + [n], self.used.copy()
        grown.row, grown.offset = np.append(self.row, free[0]), np.append(self.offset, self.used[free[0]])
        grown.used[free[0]] += n
        return grown


def row_width(longest: int, cap: int) -> int:
    """The width bucket of rows whose longest sample has `longest` tokens (module doc)."""
    longest = max(int(longest), 1)
    return min(length_bucket(longest, ROW_MULTIPLE), length_bucket(longest), cap)


def row_count(n: int) -> int:
    """n rows rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (a few shapes per width, at most
    a third of them padding)."""
    size = 1
    while size < n:
        size = size + 1 if size < 2 else (size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return size


def order(lengths: np.ndarray, budget: int, caps) -> np.ndarray:
    """The samples ([n, sides] lengths) in first-fit-decreasing micro-batches (module doc):
    an order whose consecutive micro_ranges are those bins."""
    left, out = [int(i) for i in np.argsort(-lengths.max(axis=1), kind="stable")], []
    while left:   # a bin: the longest sample left, then every later one that still fits
        first, rest = left[0], []
        sides = [Rows([lengths[first, s]], budget, caps[s]) for s in range(lengths.shape[1])]
        taken = [first]
        for i in left[1:]:
            grown = [side.added(lengths[i, s]) for s, side in enumerate(sides)]
            if all(g is not None for g in grown):
                sides, taken = grown, taken + [i]
            else:
                rest.append(i)
        out += taken
        left = rest
    return np.asarray(out, np.int64)


def micro_ranges(lengths: np.ndarray, first: int, budget: int, caps) -> list[tuple[int, int]]:
    """Consecutive [start, stop) of samples `first`.. whose lengths ([n, sides]) each side's
    rows hold (place; `caps`: each side's padded length); a sample alone always fits."""
    ranges, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or any(place(lengths[start:i + 1, s], budget, caps[s]) is None
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
    return micro_ranges(lengths, first, budget, [round_up(side.seq_len, ROUNDING) for side in sides])


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


def pack_rows(batch: MicroBatch, budget: int | None) -> MicroBatch:
    """`batch` of one micro-batch (one sample per row) with both sides packed (module doc);
    budget None: a batch shard's part of a micro-batch, in rows enough for it (stacking the
    parts, step.shards.stack_shards, widens them to one width per side)."""
    sides, moves = {}, {}
    for side, (ids, mask) in side_tokens(batch).items():
        lengths = lengths_of(mask)
        placed = place(lengths, budget, ids.shape[1])
        if placed is None:
            raise PackingError(f"the {side} samples do not fit rows of {budget} tokens (micro_ranges)")
        rows, width, row, offset = placed
        packed, segments = np.zeros((rows, width), ids.dtype), np.zeros((rows, width), np.int32)
        for b, (r, at, n) in enumerate(zip(row, offset, lengths)):
            packed[r, at:at + n] = ids[b, :n]
            segments[r, at:at + n] = b + 1
        sides[side] = (packed, segments)
        moves[side] = (ids.shape[1], row * width + offset, lengths)
    moved = map_rows(batch, lambda x, side, name: move_rows(x, *moves[side], name) if side in moves else x)
    return with_side_tokens(moved, sides)
