"""Plain jnp oracle for the strict full objective: project, divergence, masked sum (autodiff)."""
from __future__ import annotations

import jax.numpy as jnp

from ctopd_jax.kernels import losses


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


def dead_rows_neutral(zs_bar, zt_bar, row_weight):
    """Rows of weight 0 replaced by zeros on both sides: their divergence is then 0 with a finite
    gradient, so an inf there (p_S > 0 where p_T = 0) cannot turn into 0 · inf = NaN."""
    live = (row_weight != 0)[:, None]
    return jnp.where(live, zs_bar, 0.0), jnp.where(live, zt_bar, 0.0)


def strict_full_rows(student, teacher, s_ids, row_weight, *, divergence, temperature=1.0,
                     t_ids=None, **div_kwargs):
    """Per-row w_r · D_r [R] (differentiable)."""
    zs_bar, zt_bar = dead_rows_neutral(jnp.take(student_logits_of(student), s_ids, axis=1),
                                       teacher_shared_of(teacher, t_ids), row_weight)
    per_row = losses.divergence(divergence, zs_bar, zt_bar, temperature=temperature, **div_kwargs)
    return losses.masked_rows(per_row, row_weight)
