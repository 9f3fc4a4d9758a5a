"""Row-chunked loss driver with a custom VJP, shared by the xla and pallas implementations.

A "chunk function" maps one chunk of projected rows to its per-row weighted losses and the
gradient of their sum with respect to the projected student logits:

    chunk_fn(zs_bar [c, V∩] f32, zt_bar [c, V∩] f32, w [c] f32) -> (rows [c] f32, grad [c, V∩] f32)

`rows[r]` is w_r · D_r (exactly 0 where w_r == 0). The driver returns the differentiable sum
and the per-row values as constants (stop_gradient): the gradient is computed in the forward
for a uniform cotangent of the sum, so a per-row cotangent cannot be honoured. Objectives that
need a differentiable per-row quantity use `kernels.token_rows` (recomputing backward).

The driver walks the rows in chunks of `chunk_rows`, gathers the shared-vocabulary columns of
that chunk only (and the teacher columns when the teacher arrives over its full vocabulary),
calls the chunk function, and writes the gradient straight back into student-vocabulary layout.
So no [R, V∩] gathered copy, softmax or gradient of all rows exists at once: the working set is
O(chunk_rows · V) plus the gradient itself.

Why the forward computes the gradient: the loss is a scalar at the end of the graph, so its
cotangent is a scalar; computing the gradient while the chunk is hot in cache and scaling it in
the backward avoids a second pass over [R, V] inputs (the fused-cross-entropy pattern).

Memory decision for the logits path: the loop carry that receives the gradient is initialised
FROM the student logits and each chunk is read before its gradient overwrites it. Under
`jax.jit(..., donate_argnums=...)` of the student logits (or when the logits are an
intermediate of a larger jit, as in training) XLA updates that buffer in place, so the gradient
costs no memory beyond the logits. Without donation XLA makes one copy, the same as a zeros
buffer would cost.

Student columns outside the shared vocabulary get gradient 0 (SPEC §4). The column scatter is
done as a gather through the inverse map (`inverse_ids`, V∩ marks "not shared" and points at an
appended zero column): gathers are much cheaper than scatters on XLA:CPU.

Fused row gather: with row ids the aligned rows are gathered from the flat [B*T, V] logits
chunk by chunk as well (teacher on either path, student on the logits path), so not even the
[R, V] row copies exist; the student gradient is then accumulated into the flat layout.

Teacher as hidden states: `teacher = (hidden [R, H_T], lm_head [H_T, V_T])` with `t_ids`; the
shared columns of the teacher lm_head are gathered once and each chunk's teacher logits are one
matmul, so the teacher hands over hidden rows only and no [R, V∩] teacher array exists.

Hidden-state path (SPEC §1 chunked loss): `student = (hidden [R, H], lm_head [H, V_S])`. The
shared columns of the lm_head are gathered once ([H, V∩]); each chunk computes its logits with
float32 accumulation, so full student logits for all rows never exist. Gradients flow to hidden
and lm_head (returned in their dtypes). With a top-k chunk function (strict_topk/xla.py) only the
k selected columns of each row go on from there: the teacher's logits are computed at those
columns and the gradient returns through them (`_k_columns`), since the rest of
the [c, V∩] gradient is zero; where k columns of a head outweigh a row's V∩ logits the dense path
runs (`at_k_columns`).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ctopd_jax.kernels.strict_topk.reference import select_topk

ChunkFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def inverse_ids(s_ids, vocab_size: int):
    """inv[j] = position of student column j in s_ids, or len(s_ids) when j is not shared."""
    n = s_ids.shape[0]
    return jnp.full((vocab_size,), n, jnp.int32).at[s_ids].set(jnp.arange(n, dtype=jnp.int32))


def _to_student_layout(grad_bar, inv):
    """[c, V∩] shared-column gradient -> [c, V_S] via the inverse map (zero where not shared)."""
    padded = jnp.concatenate([grad_bar, jnp.zeros((grad_bar.shape[0], 1), grad_bar.dtype)], 1)
    return jnp.take(padded, inv, axis=1)


def _chunks(num_rows: int, chunk_rows: int):
    """(number of full chunks, tail size) for a static row count."""
    chunk_rows = max(1, min(chunk_rows, max(num_rows, 1)))
    return chunk_rows, num_rows // chunk_rows, num_rows % chunk_rows


def _rows_chunk(x, row_ids, start, size):
    """Rows [start, start+size) of the aligned rows: a slice, or a gather through row ids."""
    if row_ids is None:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)
    return jnp.take(x, jax.lax.dynamic_slice_in_dim(row_ids, start, size), axis=0)


def teacher_columns(teacher, t_ids):
    """The teacher as the driver reads it: logits [N, V] with optional column ids, or
    (hidden [N, H], lm_head columns [H, V∩]) with the shared columns gathered once."""
    if isinstance(teacher, tuple):
        hidden, lm_head = teacher
        return (hidden, lm_head if t_ids is None else jnp.take(lm_head, t_ids, axis=1)), None
    return teacher, t_ids


def _teacher_chunk(teacher, t_ids, start, size, t_rows=None):
    if isinstance(teacher, tuple):  # t_ids already applied to the lm_head (teacher_columns)
        hidden, w_cols = teacher
        h = _rows_chunk(hidden, t_rows, start, size)
        return jnp.dot(h, w_cols.astype(h.dtype), preferred_element_type=jnp.float32)
    rows = _rows_chunk(teacher, t_rows, start, size)
    if t_ids is not None:
        rows = jnp.take(rows, t_ids, axis=1)
    return rows.astype(jnp.float32)


def _logits_loss_and_grad(chunk_fn, chunk_rows, student, teacher, s_ids, t_ids, weight,
                          s_rows=None, t_rows=None):
    vocab = student.shape[1]
    num_rows = weight.shape[0]
    inv = inverse_ids(s_ids, vocab)
    size, n_full, tail = _chunks(num_rows, chunk_rows)
    gathered = s_rows is not None

    def one(start, rows, carry):
        loss, per_row, grad_buf = carry
        if gathered:  # fused row gather: the aligned rows are read straight from flat logits
            idx = jax.lax.dynamic_slice_in_dim(s_rows, start, rows)
            zs = jnp.take(student, idx, axis=0)
        else:
            zs = jax.lax.dynamic_slice_in_dim(grad_buf, start, rows, axis=0)  # still the logits
        zs_bar = jnp.take(zs, s_ids, axis=1).astype(jnp.float32)
        zt_bar = _teacher_chunk(teacher, t_ids, start, rows, t_rows)
        w = jax.lax.dynamic_slice_in_dim(weight, start, rows).astype(jnp.float32)
        chunk_rows_out, g_bar = chunk_fn(zs_bar, zt_bar, w)
        loss = loss + jnp.sum(chunk_rows_out)
        per_row = jax.lax.dynamic_update_slice_in_dim(per_row, chunk_rows_out, start, axis=0)
        g = _to_student_layout(g_bar, inv).astype(grad_buf.dtype)
        if gathered:  # rows may repeat in general: accumulate
            return loss, per_row, grad_buf.at[idx].add(g)
        return loss, per_row, jax.lax.dynamic_update_slice_in_dim(grad_buf, g, start, axis=0)

    carry = (jnp.zeros((), jnp.float32), jnp.zeros((num_rows,), jnp.float32),
             jnp.zeros_like(student) if gathered else student)
    if n_full:
        carry = jax.lax.fori_loop(0, n_full, lambda i, c: one(i * size, size, c), carry)
    if tail:
        carry = one(n_full * size, tail, carry)
    loss, per_row, grad = carry
    if num_rows == 0:
        grad = jnp.zeros_like(student)
    return loss, per_row, grad


def _all_columns(chunk_fn, w_bar, teacher, t_ids, t_rows):
    """A chunk's loss and gradients through every V∩ column: the teacher's [c, V∩] logits, the
    chunk function's dense gradient, two [c, V∩] matmuls back. Accumulates d/d w_bar as [H, V∩]."""
    def back(h, zs_bar, w, start, rows, g_cols):
        zt_bar = _teacher_chunk(teacher, t_ids, start, rows, t_rows)
        chunk_rows_out, g_bar = chunk_fn(zs_bar, zt_bar, w)
        g_bar = g_bar.astype(h.dtype)
        gh = jnp.dot(g_bar, w_bar.T.astype(h.dtype), preferred_element_type=jnp.float32)
        return chunk_rows_out, gh, g_cols + jnp.dot(h.T, g_bar, preferred_element_type=jnp.float32)

    return back, w_bar.shape


def _teacher_k_columns(teacher, t_ids, idx, start, size, t_rows=None):
    """The teacher's logits [c, k] at the shared columns `idx` [c, k] of each row only: from
    (hidden, lm_head [H_T, V_T]) a dot with the k gathered columns, from logits a gather."""
    cols = idx if t_ids is None else jnp.take(t_ids, idx)
    if isinstance(teacher, tuple):
        hidden, lm_head = teacher
        h = _rows_chunk(hidden, t_rows, start, size)
        w_k = jnp.take(lm_head, cols, axis=1).astype(h.dtype)           # [H_T, c, k]
        return jnp.einsum("rh,hrk->rk", h, w_k, preferred_element_type=jnp.float32)
    return jnp.take_along_axis(_rows_chunk(teacher, t_rows, start, size), cols, axis=1).astype(jnp.float32)


def _k_columns(chunk_fn, w_bar, teacher, t_ids, t_rows):
    """A chunk's loss and gradients through each row's k selected columns only (a top-k chunk
    function's `topk` and `on_k_columns`): the teacher's logits are a dot with its k gathered
    columns, and the gradient returns through the k columns of the lm_head (a gather and a
    scatter-add, not two [c, V∩] matmuls with a mostly-zero gradient): the same numbers as
    `_all_columns` up to float summation order, ~3 · c · H · |V∩| FLOPs fewer a chunk.
    Accumulates d/d w_bar as [V∩, H], each selected column one row."""
    w_rows = w_bar.T   # [V∩, H]: each selected column one row to gather

    def back(h, zs_bar, w, start, rows, g_cols):
        vals, idx = select_topk(zs_bar, chunk_fn.topk)
        zt_k = _teacher_k_columns(teacher, t_ids, idx, start, rows, t_rows)
        chunk_rows_out, g_k = chunk_fn.on_k_columns(vals, zt_k, w)
        g_k = g_k.astype(h.dtype)
        gh = jnp.einsum("rk,rkh->rh", g_k, jnp.take(w_rows, idx, axis=0).astype(h.dtype),
                        preferred_element_type=jnp.float32)
        outer = (g_k[:, :, None] * h[:, None, :]).astype(jnp.float32).reshape(-1, h.shape[1])
        return chunk_rows_out, gh, g_cols.at[idx.reshape(-1)].add(outer)

    return back, (w_bar.shape[1], w_bar.shape[0])


def _hidden_loss_and_grad(chunk_fn, chunk_rows, hidden, lm_head, teacher, s_ids, t_ids, weight,
                          t_rows=None):
    num_rows = hidden.shape[0]
    w_bar = jnp.take(lm_head, s_ids, axis=1)  # [H, V∩], gathered once
    k_columns = at_k_columns(chunk_fn, (hidden, lm_head), teacher, s_ids)
    back, g_shape = (_k_columns if k_columns else _all_columns)(chunk_fn, w_bar, teacher, t_ids, t_rows)
    size, n_full, tail = _chunks(num_rows, chunk_rows)

    def one(start, rows, carry):
        loss, per_row, g_hidden, g_cols = carry
        h = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)
        # matmuls in the compute dtype of the hidden states, accumulated in float32
        zs_bar = jnp.dot(h, w_bar.astype(h.dtype), preferred_element_type=jnp.float32)
        w = jax.lax.dynamic_slice_in_dim(weight, start, rows).astype(jnp.float32)
        chunk_rows_out, gh, g_cols = back(h, zs_bar, w, start, rows, g_cols)
        g_hidden = jax.lax.dynamic_update_slice_in_dim(g_hidden, gh.astype(g_hidden.dtype),
                                                       start, axis=0)
        per_row = jax.lax.dynamic_update_slice_in_dim(per_row, chunk_rows_out, start, axis=0)
        return loss + jnp.sum(chunk_rows_out), per_row, g_hidden, g_cols

    carry = (jnp.zeros((), jnp.float32), jnp.zeros((num_rows,), jnp.float32),
             jnp.zeros_like(hidden), jnp.zeros(g_shape, jnp.float32))
    if n_full:
        carry = jax.lax.fori_loop(0, n_full, lambda i, c: one(i * size, size, c), carry)
    if tail:
        carry = one(n_full * size, tail, carry)
    loss, per_row, g_hidden, g_cols = carry
    g_wbar = g_cols.T if k_columns else g_cols
    g_lm_head = _to_student_layout(g_wbar, inverse_ids(s_ids, lm_head.shape[1]))
    return loss, per_row, g_hidden, g_lm_head.astype(lm_head.dtype)


def at_k_columns(chunk_fn, student, teacher, s_ids) -> bool:
    """Whether the hidden-state path runs at each row's k columns (`_k_columns`):
    for a top-k chunk function, when the k gathered lm_head columns of a row, [k, H] of either
    model, are no larger than the dense path's [V∩] logits of that row (a large k over a wide
    teacher, 128 columns of 3,584 against 109,567, would hold more than the dense path)."""
    if not (isinstance(student, tuple) and hasattr(chunk_fn, "on_k_columns")):
        return False
    widths = [student[0].shape[1]] + ([teacher[0].shape[1]] if isinstance(teacher, tuple) else [])
    return chunk_fn.topk * max(widths) <= s_ids.shape[0]


@functools.lru_cache(maxsize=None)
def make_chunked_loss(chunk_fn: ChunkFn, chunk_rows: int, from_hidden: bool):
    """f(student, teacher, s_ids, t_ids, weight, s_rows, t_rows) -> (loss sum, per-row values).

    The sum is differentiable; the per-row values [R] are constants (see the module docstring).

    s_rows / t_rows (optional int [R]) gather the aligned rows from flat [N, V] logits chunk by
    chunk (the fused row gather); the student gradient then has the flat shape, zero elsewhere.

    `student` is logits [R, V_S] or, with from_hidden, a tuple (hidden, lm_head). Only `student`
    receives gradient; the teacher, index arrays and weights get none (the teacher is a constant
    by SPEC §4; weights are masks).
    """

    def run(student, teacher, s_ids, t_ids, weight, s_rows, t_rows):
        if from_hidden:
            loss, per_row, gh, gw = _hidden_loss_and_grad(chunk_fn, chunk_rows, *student, teacher,
                                                          s_ids, t_ids, weight, t_rows)
            return (loss, per_row), (gh, gw)
        loss, per_row, grad = _logits_loss_and_grad(chunk_fn, chunk_rows, student, teacher, s_ids,
                                                    t_ids, weight, s_rows, t_rows)
        return (loss, per_row), grad

    @jax.custom_vjp
    def sum_and_rows(student, teacher, s_ids, t_ids, weight, s_rows=None, t_rows=None):
        return run(student, teacher, s_ids, t_ids, weight, s_rows, t_rows)[0]

    def fwd(student, teacher, s_ids, t_ids, weight, s_rows=None, t_rows=None):
        return run(student, teacher, s_ids, t_ids, weight, s_rows, t_rows)

    def bwd(grads, cot):
        cot_sum, _ = cot  # the per-row output is a constant (stop_gradient below)
        scaled = jax.tree.map(lambda g: (g * cot_sum.astype(g.dtype)), grads)
        return scaled, None, None, None, None, None, None

    sum_and_rows.defvjp(fwd, bwd)

    def loss_fn(student, teacher, s_ids, t_ids, weight, s_rows=None, t_rows=None):
        if not at_k_columns(chunk_fn, student, teacher, s_ids):   # else read per row's k columns
            teacher, t_ids = teacher_columns(teacher, t_ids)
        total, per_row = sum_and_rows(student, teacher, s_ids, t_ids, weight, s_rows, t_rows)
        return total, jax.lax.stop_gradient(per_row)

    return loss_fn
