"""One entry point for the strict objectives: `strict_kd_rows(..., implementation=...)`.

Implementations, tried in this order from the one asked for (ordered fallback); "auto" first
picks one per kernel (strict full / top-k) and device from the kernel folder's table of measured
choices (kernels/choices.py):
  "pallas"    -> fused Pallas chunk kernels (interpret mode on CPU, compiled on GPU); akl is
                 not supported there and falls back to xla.
  "xla"       -> row-chunked custom-VJP driver (kernels/strict/row_chunks.py) with jnp chunk functions.
  "reference" -> plain jnp autodiff over the whole batch (the oracle; most memory).
All return the same numbers: the per-row values row_weight[r] · D_r [R] and their sum (float32
scalar), the sum differentiable w.r.t. the student logits (or hidden states and lm_head); the
per-row values are constants (metrics, per-row weights of other objectives).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import losses
from ctopd_jax.kernels.choices import choose
from ctopd_jax.kernels.pallas_shared.tiles import gpu_backend
from ctopd_jax.kernels.strict import row_chunks
from ctopd_jax.kernels.strict_full import pallas as full_pallas, reference as full_reference
from ctopd_jax.kernels.strict_full import xla as full_xla
from ctopd_jax.kernels.strict_topk import pallas as topk_pallas, reference as topk_reference
from ctopd_jax.kernels.strict_topk import xla as topk_xla

IMPLEMENTATIONS = ("pallas", "xla", "reference")
# Divergences whose value does not depend on the order of the shared columns (no tie-break by
# column): for them the chunked paths visit the columns in student-id order, which turns the
# random column gathers (student projection and the scatter back) into near-sequential ones.
ORDER_FREE = ("kl", "rkl", "jsd", "skl", "srkl", "tvd")
_log = logging.getLogger(__name__)


def _unsupported_reason(implementation: str, divergence: str, topk: int | None,
                        chunk_shape: tuple[int, int] | None = None,
                        interpret: bool | None = None) -> str | None:
    if implementation == "pallas":
        if divergence == "akl":
            return "akl needs a full sort of p_T per row"
        if chunk_shape is not None:
            return pallas_lowering_failure(divergence, topk, chunk_shape, interpret)
    return None


def resolve_implementation(implementation: str, divergence: str, topk: int | None = None, *,
                           chunk_shape: tuple[int, int] | None = None,
                           interpret: bool | None = None) -> str:
    """The implementation that will run: the asked one or the next supported one after it.

    With `chunk_shape` = (rows per chunk, |V∩|), a compiled (non-interpret) Pallas kernel is
    also lowered once for that shape on the current backend; if that fails it falls back too.
    """
    if implementation == "auto":
        implementation = choose("strict_full" if topk is None else "strict_topk")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; use auto or one of {IMPLEMENTATIONS}")
    for candidate in IMPLEMENTATIONS[IMPLEMENTATIONS.index(implementation):]:
        reason = _unsupported_reason(candidate, divergence, topk, chunk_shape, interpret)
        if reason is None:
            return candidate
        _log.info("implementation %s unsupported (%s); falling back", candidate, reason)
    return "reference"


def pallas_lowering_failure(divergence: str, topk: int | None, chunk_shape: tuple[int, int],
                            interpret: bool | None = None) -> str | None:
    """Why the compiled Pallas chunk kernel does not lower for this chunk shape, or None.

    Interpret mode lowers anywhere (None). Otherwise the kernel is lowered (`jax.jit(...).lower`,
    which runs the Mosaic GPU lowering and its shared-memory check) once per shape and backend;
    the answer is cached and a failure is logged as a warning.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if interpret:
        return None
    rows, cols = max(1, int(chunk_shape[0])), int(chunk_shape[1])
    return _pallas_lowering_error(divergence, topk, rows, cols,
                                  f"{jax.default_backend()}/{gpu_backend()}")


@functools.lru_cache(maxsize=None)
def _pallas_lowering_error(divergence, topk, rows, cols, backend) -> str | None:
    # temperature and divergence parameters are compile-time constants of the kernel that do
    # not change what lowers, so the defaults stand in for them
    div_items = (("akl_alpha", 0.5), ("jsd_beta", 0.5), ("skl_lambda", 0.1))
    fn = _chunk_fn("pallas", divergence, topk, 1.0, div_items, False)
    block = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    try:
        jax.jit(fn).lower(block, block, jax.ShapeDtypeStruct((rows,), jnp.float32))
    except Exception as err:  # noqa: BLE001  (any lowering error means: use the next one)
        reason = f"Pallas kernel does not lower on {backend} for chunk [{rows}, {cols}]: " \
                 f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        _log.warning("%s; falling back to xla", reason)
        return reason
    return None


def _rows_of(x):
    """Row count of logits [R, V] or of (hidden [R, H], lm_head [H, V])."""
    return x[0].shape[0] if isinstance(x, tuple) else x.shape[0]


def _width_of(x):
    return x[1].shape[1] if isinstance(x, tuple) else x.shape[1]


def _validate(student, teacher, s_ids, row_weight, topk, t_ids, s_rows, t_rows):
    if isinstance(student, tuple):
        if len(student) != 2 or student[0].ndim != 2 or student[1].ndim != 2:
            raise ValueError("student must be logits [R, V_S] or (hidden [R, H], lm_head [H, V_S])")
        hidden, lm_head = student
        if hidden.shape[1] != lm_head.shape[0]:
            raise ValueError(f"hidden {hidden.shape} and lm_head {lm_head.shape} disagree on H")
        if s_rows is not None:
            raise ValueError("student_row_ids is for flat student logits; with (hidden, lm_head) "
                             "gather the hidden rows first (gather_rows)")
        rows, vocab_s = hidden.shape[0], lm_head.shape[1]
    else:
        if student.ndim != 2:
            raise ValueError(f"student logits must be [R, V_S], got shape {student.shape}")
        rows, vocab_s = student.shape
    for name, ids in (("student_row_ids", s_rows), ("teacher_row_ids", t_rows)):
        if ids is not None and (ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"{name} must be a 1-D integer array of flat row indices")
    if s_rows is not None:
        rows = s_rows.shape[0]
    if s_ids.ndim != 1 or not jnp.issubdtype(s_ids.dtype, jnp.integer):
        raise ValueError("s_ids must be a 1-D integer array (student ids of the overlap map)")
    shared = s_ids.shape[0]
    if shared < 1 or shared > vocab_s:
        raise ValueError(f"|s_ids|={shared} must be in [1, V_S={vocab_s}]")
    want_cols = shared if t_ids is None else None
    teacher_rows = rows if t_rows is None else None
    if isinstance(teacher, tuple):
        if len(teacher) != 2 or teacher[0].ndim != 2 or teacher[1].ndim != 2 or \
                teacher[0].shape[1] != teacher[1].shape[0]:
            raise ValueError("teacher must be logits or (hidden [R, H_T], lm_head [H_T, V_T])")
    elif teacher.ndim != 2:
        raise ValueError(f"teacher must be 2-D logits; got shape {teacher.shape}")
    if (teacher_rows is not None and _rows_of(teacher) != teacher_rows) or (
            want_cols is not None and _width_of(teacher) != want_cols):
        raise ValueError(f"teacher must be [R={rows}, V∩={shared}] (projected) or [R, V_T] with "
                         f"t_ids (or flat rows with teacher_row_ids); got "
                         f"{(teacher[0].shape, teacher[1].shape) if isinstance(teacher, tuple) else teacher.shape}")
    if t_rows is not None and t_rows.shape[0] != rows:
        raise ValueError(f"teacher_row_ids must have R={rows} entries, got {t_rows.shape[0]}")
    if t_ids is not None and (t_ids.ndim != 1 or t_ids.shape[0] != shared):
        raise ValueError(f"t_ids must be 1-D of length |s_ids|={shared}")
    if row_weight.shape != (rows,):
        raise ValueError(f"row_weight must be [R={rows}], got {row_weight.shape}")
    if topk is not None and not (isinstance(topk, int) and 1 <= topk <= shared):
        raise ValueError(f"ctkd_topk={topk} must be an integer in [1, |V∩|={shared}]")


def _chunk_fn(implementation, divergence, topk, temperature, div_items, interpret):
    if implementation == "pallas":
        if topk is None:
            return full_pallas.make_chunk_fn(divergence, temperature, div_items, interpret)
        return topk_pallas.make_chunk_fn(divergence, topk, temperature, div_items, interpret)
    if topk is None:
        return full_xla.make_chunk_fn(divergence, temperature, div_items)
    return topk_xla.make_chunk_fn(divergence, topk, temperature, div_items)


def strict_kd_sum(student, teacher_shared, s_ids, row_weight, **kwargs):
    """Σ_r row_weight[r] · D(p̄_S[r], p̄_T[r]) (the total of `strict_kd_rows`)."""
    return strict_kd_rows(student, teacher_shared, s_ids, row_weight, **kwargs)[0]


def strict_kd_rows(student, teacher_shared, s_ids, row_weight, *, divergence: str,
                   topk: int | None = None, temperature: float = 1.0,
                   implementation: str = "xla", chunk_rows: int = 2048,
                   t_ids=None, student_row_ids=None, teacher_row_ids=None,
                   interpret: bool | None = None, jsd_beta: float = 0.5,
                   skl_lambda: float = 0.1, akl_alpha: float = 0.5):
    """(Σ_r w_r · D_r, per-row w_r · D_r [R]) over aligned rows (SPEC §4), float32.

    The sum is differentiable; the per-row values are constants.

    student:        logits [R, V_S], or (hidden [R, H], lm_head [H, V_S]) for the chunked
                    from-hidden path (lm_head applied per chunk of `chunk_rows`).
    teacher_shared: teacher logits projected to V∩ [R, V∩] (a constant), or full [R, V_T] together
                    with `t_ids` to project per chunk (never materialising [R, V∩]), or the
                    teacher's (hidden [R, H_T], lm_head [H_T, V_T]) with `t_ids`: its logits are
                    then computed chunk by chunk beside the student's.
    s_ids:          int [V∩] student column of each shared entry (same order as the teacher).
    row_weight:     [R] (0 for padding rows; 1 for strict pairs).
    topk:           None for strict full; k for strict top-k (1 <= k <= |V∩|).
    student_row_ids / teacher_row_ids: optional int [R] flat row indices of the strict pairs;
                    then `student` / `teacher_shared` are the flat [B*T, V] logits and the rows
                    are gathered chunk by chunk (fused gather; the student gradient has the flat
                    shape). Without them the rows are already gathered (see `gather_rows`).
    interpret:      Pallas interpret mode; default True unless running on GPU.
    """
    losses.check_divergence_args(divergence, temperature=temperature, jsd_beta=jsd_beta,
                                 skl_lambda=skl_lambda, akl_alpha=akl_alpha)
    _validate(student, teacher_shared, s_ids, row_weight, topk, t_ids, student_row_ids,
              teacher_row_ids)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1 (chunked_loss_size)")
    impl = resolve_implementation(
        implementation, divergence, topk, interpret=interpret,
        chunk_shape=(min(int(chunk_rows), row_weight.shape[0]), s_ids.shape[0]))
    div_kwargs = dict(jsd_beta=jsd_beta, skl_lambda=skl_lambda, akl_alpha=akl_alpha)
    if impl == "reference":  # the oracle gathers the rows up front
        if student_row_ids is not None:
            student = gather_rows(student, student_row_ids)
        if teacher_row_ids is not None:
            teacher_shared = gather_rows(teacher_shared, teacher_row_ids)
        if topk is None:
            rows = full_reference.strict_full_rows(student, teacher_shared, s_ids, row_weight,
                                                   divergence=divergence, temperature=temperature,
                                                   t_ids=t_ids, **div_kwargs)
        else:
            rows = topk_reference.strict_topk_rows(student, teacher_shared, s_ids, row_weight,
                                                   divergence=divergence, topk=topk,
                                                   temperature=temperature, t_ids=t_ids, **div_kwargs)
        return jnp.sum(rows), jax.lax.stop_gradient(rows)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    chunk_fn = _chunk_fn(impl, divergence, topk, float(temperature),
                         tuple(sorted(div_kwargs.items())), bool(interpret))
    loss_fn = row_chunks.make_chunked_loss(chunk_fn, int(chunk_rows), isinstance(student, tuple))
    s_ids = s_ids.astype(jnp.int32)
    t_ids = None if t_ids is None else t_ids.astype(jnp.int32)
    if topk is None and divergence in ORDER_FREE:
        order = jnp.argsort(s_ids)
        s_ids = s_ids[order]
        # a pre-projected teacher is then read through `order` chunk by chunk (no [R, V∩] copy)
        t_ids = order.astype(jnp.int32) if t_ids is None else t_ids[order]
    s_rows = None if student_row_ids is None else student_row_ids.astype(jnp.int32)
    t_rows = None if teacher_row_ids is None else teacher_row_ids.astype(jnp.int32)
    return loss_fn(student, jax.lax.stop_gradient(teacher_shared), s_ids, t_ids, row_weight,
                   s_rows, t_rows)


def gather_rows(logits_flat, row_index):
    """Rows of flat [B*T, V] logits (or of (hidden, lm_head)) at int32 flat row indices."""
    if isinstance(logits_flat, tuple):
        return jnp.take(logits_flat[0], row_index.astype(jnp.int32), axis=0), logits_flat[1]
    return jnp.take(logits_flat, row_index.astype(jnp.int32), axis=0)
