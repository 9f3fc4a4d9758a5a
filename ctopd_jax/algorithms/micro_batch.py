"""The device micro-batch: what `Objective.prepare` returns and the step, the teacher and packing
read (docs/architecture.md, "The objective contract").

`MicroBatch` holds the fields every objective shares; `terms` holds the objective's own arrays,
a dataclass its module defines with `@terms_class` (strict.StrictPairs, span.SpanTerms,
simct.SimctTerms, ...). Both are JAX pytrees whose leaves are the arrays (None: absent), so
the step jits them, `to_global` places them, and `stack_shards` / `pack_rows` walk them with
jax.tree.map.

Row convention (pack.py): a sequence of one side is padded on the right to T; the hidden state
that predicts position p of sample b is FLAT row b·T + p − 1 of that side's [M·T] rows. A field
holding such flat row indices declares the side it indexes with `rows("student")` or
`rows("teacher")`: packing (algorithms/packed_rows.py) moves exactly those fields, recursively into
`terms`. A field named `*_rows` without a side is refused when packing (`map_rows`), never
silently read as a position of the wrong layout.

Padding: every array is padded to a bucketed size (pack.rows_bucket); padded entries carry
weight 0 and index 0, so zero padding (stack_shards) is inert.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

SIDES = ("student", "teacher")


class PackingError(ValueError):
    """Arrays that cannot be packed as declared (a programming error of an objective)."""


def rows(side: str, default=None):
    """A field of flat row indices into `side`'s hidden states ("student" | "teacher")."""
    if side not in SIDES:
        raise ValueError(f"rows({side!r}): the side is one of {SIDES}")
    return dataclasses.field(default=default, metadata={"rows": side})


def terms_class(cls):
    """Decorator of an objective's terms: a frozen dataclass registered as a JAX pytree whose
    fields are arrays (None: absent)."""
    return jax.tree_util.register_dataclass(dataclass(frozen=True)(cls))


@terms_class
class MicroBatch:
    """One micro-batch on its way to the step (host numpy arrays, then global jax arrays).

    M samples (rows), T_S / T_T padded lengths per side, R response rows (padded)."""
    # -- student side (pack.micro_batch) --
    student_ids: Any = None             # [M, T_S] int32 token ids, right-padded
    student_mask: Any = None            # [M, T_S] bool (int32 segment ids once packed: sample i + 1)
    response_rows: Any = rows("student")  # [R] int32: flat student rows predicting a response token
    response_targets: Any = None        # [R] int32: the response token each row predicts
    response_weight: Any = None         # [R] float32: 1 real, 0 padding (CE and most sums weight)
    rollout_logprobs: Any = None        # [R] float32: the engine's log π_old of the token (or 0)
    rollout_logprob_weight: Any = None  # [R] float32: 1 where the engine gave a log-prob
    # -- teacher side --
    teacher_ids: Any = None             # [M, T_T] int32 teacher token ids (same-tokenizer: = student)
    teacher_mask: Any = None            # [M, T_T] bool / segment ids, as student_mask
    teacher_rows: Any = rows("teacher")  # [R_T] int32: flat teacher rows whose hidden states the
    #                                      teacher hands back, in the order the objective reads them
    # -- optional, added by the host or the loop --
    teacher_token_logprobs: Any = None  # [R] float32: a served teacher's log π_T at response_rows
    base_hidden: Any = None             # [R_T, H_T]: a teacher base's hidden rows (teacher.add_teacher_base)
    # -- the objective's own arrays (its terms dataclass), or None --
    terms: Any = None


def side_tokens(batch: MicroBatch) -> dict[str, tuple]:
    """{side: (ids, mask)} of the sides the micro-batch holds."""
    both = {"student": (batch.student_ids, batch.student_mask), "teacher": (batch.teacher_ids, batch.teacher_mask)}
    return {side: pair for side, pair in both.items() if pair[0] is not None}


def with_side_tokens(batch: MicroBatch, tokens: dict[str, tuple]) -> MicroBatch:
    """`batch` with the sides' (ids, mask) of `tokens` (side_tokens' layout) in place."""
    s_ids, s_mask = tokens.get("student", (batch.student_ids, batch.student_mask))
    t_ids, t_mask = tokens.get("teacher", (batch.teacher_ids, batch.teacher_mask))
    return dataclasses.replace(batch, student_ids=s_ids, student_mask=s_mask, teacher_ids=t_ids, teacher_mask=t_mask)


def map_rows(node, move):
    """`node` (a MicroBatch or terms) with every declared row field x of side s replaced by
    move(x, s, name), recursing into nested terms; an undeclared `*_rows` field raises
    PackingError."""
    changes = {}
    for f in dataclasses.fields(node):
        value, side = getattr(node, f.name), f.metadata.get("rows")
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            changes[f.name] = map_rows(value, move)
        elif side is not None:
            changes[f.name] = move(value, side, f.name)
        elif f.name.endswith("_rows"):
            raise PackingError(f"{type(node).__name__}.{f.name}: row indices without a side; declare the "
                               "field with micro_batch.rows('student') or rows('teacher')")
    return dataclasses.replace(node, **changes)


def widened(batch: MicroBatch, widths: dict[str, int]) -> MicroBatch:
    """`batch` with each side's rows [M, T] right-padded to `widths[side]` (≥ T) and that side's
    declared row fields moved to match: flat row b·T + p becomes b·W + p (a packed row's
    offsets stay, as positions within their row). The batch shards' parts of one micro-batch
    are prepared on their own, so their widths differ when their samples fall in different
    length buckets; stacked as they are, every flat row index past each part's first row would
    point at another position (step.shards.stack_shards)."""
    tokens = side_tokens(batch)
    width = {side: ids.shape[1] for side, (ids, _) in tokens.items()}

    def move(x, side, name):
        x = np.asarray(x)
        return (x // width[side] * widths[side] + x % width[side]).astype(x.dtype) if side in width else x

    def pad(a, side):
        return np.pad(a, [(0, 0), (0, widths[side] - a.shape[1])])

    return with_side_tokens(map_rows(batch, move),
                            {side: (pad(ids, side), pad(mask, side)) for side, (ids, mask) in tokens.items()})
