"""Span loss (SPEC §6, paper Eqs. 7–9): `algorithm.name: span`.

Trained objective: L_strict + λ·L_span, with L_strict the strict full or top-k loss
(`algorithm.span_base`) and, over the mismatch groups r of the byte alignment (SPEC §2 step 3),

    L_span = Σ_r (log q_S(r) − log q_T(r))²,   log q_M(r) = Σ_j log π_M(v_j | prefix_j)

over that side's tokens of the group, with the FULL vocabulary softmax at τ = 1 (not the V∩
projection). The teacher side is a constant; the gradient reaches every student position of a
group. Both are normalised like the strict loss (÷ total student response tokens).

Decisions: the EOS pair is never part of a group (SPEC); a group with no token on one side
(possible only around byte-mismatched samples, which yield no groups here) is skipped; the
student log-probs are the ones the trainer computes at every response row anyway
(`StepInputs.response_logprobs`, differentiable here), so the span path adds only the teacher's
group rows to the teacher pass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import GradientComparison, Objective, register
from ctopd_jax.algorithms.micro_batch import rows, terms_class
from ctopd_jax.algorithms.strict import (StrictPairs, StrictSettings, check_topk, span_comparison,
                                         strict_inputs, strict_sum)
from ctopd_jax.config import require
from ctopd_jax.kernels.token_rows import token_rows


@dataclass(frozen=True)
class SpanSettings(StrictSettings):
    span_lambda: float = 1.0                               # λ
    span_base: Literal["strict", "topk_strict"] = "strict"  # the strict part of the objective

    def validate(self) -> None:
        super().validate()
        require(np.isfinite(self.span_lambda) and self.span_lambda >= 0, "algorithm.span_lambda",
                 f"{self.span_lambda} must be a finite number >= 0")


@terms_class
class SpanTerms(StrictPairs):
    """The strict pairs and the mismatch groups (G groups, N student and Q teacher tokens in
    them, each padded)."""
    span_student_index: Any = None       # [N] int32: each group token's index into response_rows
    span_student_group: Any = None       # [N] int32: its group
    span_student_weight: Any = None      # [N] float32: 1 real, 0 padding
    span_teacher_rows: Any = rows("teacher")  # [Q] int32: the groups' teacher rows
    span_teacher_targets: Any = None     # [Q] int32: the token each teacher row predicts
    span_teacher_group: Any = None       # [Q] int32: its group
    span_teacher_weight: Any = None      # [Q] float32: 1 real, 0 padding
    span_group_weight: Any = None        # [G] float32: 1 real group, 0 padding
    span_group_student_tokens: Any = None  # [G] float32: student tokens of each group


def group_arrays(host, start: int, stop: int, student_len: int, teacher_len: int,
                 response_rows: np.ndarray, response_weight: np.ndarray, min_rows: int = 64) -> dict[str, np.ndarray]:
    """SpanTerms' group fields for samples [start, stop): each student token as an index into
    the micro-batch's response rows, each teacher token as a teacher row + target, both with
    the group id."""
    g = host.alignment.mismatch_groups
    g = g[(g[:, 0] >= start) & (g[:, 0] < stop) & (g[:, 2] > g[:, 1]) & (g[:, 4] > g[:, 3])]
    s_len, t_len = g[:, 4] - g[:, 3], g[:, 2] - g[:, 1]
    ids = np.arange(len(g))

    def expand(first, count):  # every row of every group, and its group id
        group = np.repeat(ids, count)
        offset = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        return np.repeat(first, count) + offset, group

    s_batch_rows, s_group = expand(g[:, 3].astype(np.int64), s_len)
    t_batch_rows, t_group = expand(g[:, 1].astype(np.int64), t_len)
    s_rows = padded_rows.rebase(s_batch_rows, host.student.seq_len, start, student_len)
    real = response_rows[:int(response_weight.sum())]  # ascending: sample-major, then position
    s_index = np.searchsorted(real, s_rows)
    t_targets = host.teacher.labels.reshape(-1)[t_batch_rows]
    groups = padded_rows.rows_bucket(len(g), min_rows)
    s_size, t_size = padded_rows.rows_bucket(len(s_index), min_rows), padded_rows.rows_bucket(len(t_group), min_rows)
    return {
        "span_student_index": padded_rows.padded(s_index, s_size)[0],
        "span_student_group": padded_rows.padded(s_group, s_size)[0],
        "span_student_weight": padded_rows.padded(s_index, s_size)[1],
        "span_teacher_rows": padded_rows.padded(padded_rows.rebase(t_batch_rows, host.teacher.seq_len, start, teacher_len),
                                         t_size)[0],
        "span_teacher_targets": padded_rows.padded(t_targets, t_size)[0],
        "span_teacher_group": padded_rows.padded(t_group, t_size)[0],
        "span_teacher_weight": padded_rows.padded(t_group, t_size)[1],
        "span_group_weight": padded_rows.padded(ids, groups)[1],
        "span_group_student_tokens": padded_rows.padded(s_len, groups, np.float32)[0],
    }


def span_inputs(host, start: int, stop: int):
    batch = strict_inputs(host, start, stop)
    groups = group_arrays(host, start, stop, batch.student_ids.shape[1], batch.teacher_ids.shape[1],
                          batch.response_rows, batch.response_weight)
    terms = SpanTerms(**vars(batch.terms), **groups)
    # the teacher hands back the strict rows first, then the groups' rows
    return dataclasses.replace(batch, terms=terms, teacher_rows=np.concatenate(
        [terms.strict_teacher_rows, terms.span_teacher_rows]))


def span_sum(student_logprobs, teacher_logprobs, terms):
    """Σ_r (log q_S(r) − log q_T(r))² from per-token log-probs: student [N] at
    terms.span_student_index rows of `student_logprobs`, teacher [Q] in group-row order."""
    groups = terms.span_group_weight.shape[0]
    s_lp = jnp.take(student_logprobs, terms.span_student_index, axis=0) * terms.span_student_weight
    t_lp = jax.lax.stop_gradient(teacher_logprobs) * terms.span_teacher_weight
    q_s = jax.ops.segment_sum(s_lp, terms.span_student_group, num_segments=groups)
    q_t = jax.ops.segment_sum(t_lp, terms.span_teacher_group, num_segments=groups)
    return jnp.sum(terms.span_group_weight * (q_s - q_t) ** 2)


@register("span")
class SpanLoss(Objective):
    settings_class = SpanSettings
    stale_responses = "none"   # divergences per position and per span
    response_logprob_grad = True  # the span term differentiates the student's token log-probs

    @property
    def topk(self) -> int | None:
        return int(self.settings.ctkd_topk) if self.settings.span_base == "topk_strict" else None

    def gradient_comparison(self) -> GradientComparison:
        return span_comparison(self.settings, self.topk)

    def check(self, overlap) -> None:
        check_topk(self.topk, overlap.shared)

    def prepare(self, host, start, stop):
        return span_inputs(host, start, stop)

    def kd_weights(self):
        return {"strict": 1.0, "span": float(self.settings.span_lambda)}

    def kd_sums(self, x):
        s, terms = self.settings, x.batch.terms
        strict_rows = terms.strict_teacher_rows.shape[0]
        strict_total, _ = strict_sum(s, self.topk, x, x.teacher_hidden[:strict_rows])
        t_lp, _ = token_rows(x.teacher_hidden[strict_rows:], x.teacher_lm_head,
                             terms.span_teacher_targets, chunk_rows=s.chunked_loss_size,
                             implementation=s.implementation)
        span = span_sum(x.response_logprobs, t_lp, terms)
        metrics = {
            "mismatch_groups": (jnp.sum(terms.span_group_weight), None),  # a count
            "mismatch_token_fraction": (jnp.sum(terms.span_group_student_tokens),
                                        jnp.sum(x.batch.response_weight)),
        }
        return {"strict": strict_total, "span": span}, metrics
