"""Plain jnp oracle for the strict top-k objective.

Selection: `lax.top_k` on the student's shared-vocabulary row, which puts the lower column first
among equal logits (the documented tie-break of this project). The indices are constants
(stop_gradient); both sides are renormalised on the k entries by the divergence's log-softmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ctopd_jax import losses
from ctopd_jax.kernels.strict_full.reference import student_logits_of, teacher_shared_of


def strict_topk_sum(student, teacher, s_ids, row_weight, *, divergence, topk, temperature=1.0,
                    t_ids=None, **div_kwargs):
    zs_bar = jnp.take(student_logits_of(student), s_ids, axis=1)
    zt_bar = teacher_shared_of(teacher, t_ids)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(zs_bar), topk)
    zs_k = jnp.take_along_axis(zs_bar, idx, axis=1)
    zt_k = jnp.take_along_axis(zt_bar, idx, axis=1)
    per_row = losses.divergence(divergence, zs_k, zt_k, temperature=temperature, **div_kwargs)
    return losses.masked_sum(per_row, row_weight)
