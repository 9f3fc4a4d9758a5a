"""Plain jnp oracle for the strict top-k objective.

Selection: `lax.top_k` on the student's shared-vocabulary row, which puts the lower column first
among equal logits (the documented tie-break of this project). lax.top_k orders -0.0 below +0.0
while they are equal numbers, so zeros are made +0.0 before selecting (`select_topk`). The indices are constants
(stop_gradient); both sides are renormalised on the k entries by the divergence's log-softmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import losses
from ctopd_jax.kernels.strict_full.reference import dead_rows_neutral, student_logits_of, teacher_shared_of


def select_topk(zs_bar, k: int):
    """(values, int32 indices) of the k largest entries per row; lower column first among ties."""
    z = jax.lax.stop_gradient(zs_bar)
    _, idx = jax.lax.top_k(jnp.where(z == 0, jnp.zeros_like(z), z), k)
    return jnp.take_along_axis(zs_bar, idx, axis=-1), idx


def strict_topk_rows(student, teacher, s_ids, row_weight, *, divergence, topk, temperature=1.0,
                    t_ids=None, **div_kwargs):
    zs_bar, zt_bar = dead_rows_neutral(jnp.take(student_logits_of(student), s_ids, axis=1),
                                       teacher_shared_of(teacher, t_ids), row_weight)
    zs_k, idx = select_topk(zs_bar, topk)
    zt_k = jnp.take_along_axis(zt_bar, idx, axis=1)
    per_row = losses.divergence(divergence, zs_k, zt_k, temperature=temperature, **div_kwargs)
    return losses.masked_rows(per_row, row_weight)
