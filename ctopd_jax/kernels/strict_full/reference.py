"""Plain jnp oracle for the strict full objective: project, divergence, masked sum (autodiff)."""
from __future__ import annotations

import jax.numpy as jnp

from ctopd_jax import losses


def student_logits_of(student):
    """Logits [R, V_S] from logits or from (hidden [R, H], lm_head [H, V_S]) in one matmul."""
    if isinstance(student, tuple):
        hidden, lm_head = student
        return jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    return student


def teacher_shared_of(teacher, t_ids):
    """Teacher logits [R, V∩] from projected logits, full logits with t_ids, or (hidden, lm_head)."""
    logits = student_logits_of(teacher)
    return logits if t_ids is None else jnp.take(logits, t_ids, axis=1)


def strict_full_rows(student, teacher, s_ids, row_weight, *, divergence, temperature=1.0,
                     t_ids=None, **div_kwargs):
    """Per-row w_r · D_r [R] (differentiable)."""
    zs_bar = jnp.take(student_logits_of(student), s_ids, axis=1)
    zt_bar = teacher_shared_of(teacher, t_ids)
    per_row = losses.divergence(divergence, zs_bar, zt_bar, temperature=temperature, **div_kwargs)
    return losses.masked_rows(per_row, row_weight)
