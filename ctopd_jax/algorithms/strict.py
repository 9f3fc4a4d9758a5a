"""Strict full (`strict`, byte_align_ctkd) and strict top-k (`topk_strict`) of SPEC §4.

Both gather the student hidden states at the strict pairs' student rows and hand (hidden rows,
lm_head) with the teacher's (hidden rows, lm_head) to the chunked kernel, so the lm_heads, the
V∩ projection and the divergence run per chunk of `chunked_loss_size` rows: no [R, V] logits
of either model exist.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import GradientComparison, Objective, register
from ctopd_jax.algorithms.micro_batch import MicroBatch, rows, terms_class
from ctopd_jax.config import AlgorithmSection, require
from ctopd_jax.config.catalog import objective_class
from ctopd_jax.kernels import strict_kd_rows


@dataclass(frozen=True)
class StrictSettings(AlgorithmSection):
    ctkd_topk: int = 128                 # k of strict top-k (topk_strict; span_base topk_strict)

    def validate(self) -> None:
        super().validate()
        require(self.ctkd_topk >= 1, "algorithm.ctkd_topk",
                 "must be >= 1 (and <= |V∩|, checked once the tokenizers are loaded)")


@terms_class
class StrictPairs:
    """The strict 1:1 pairs (SPEC §2) of a micro-batch, P of them padded: the terms of the strict
    family (span and the served top-k strict extend them)."""
    strict_student_rows: Any = rows("student")   # [P] int32: the student row of each pair
    strict_teacher_rows: Any = rows("teacher")   # [P] int32: the teacher row of each pair
    strict_weight: Any = None                    # [P] float32: 1 real pair, 0 padding


def strict_pairs(host, start: int, stop: int, student_len: int, teacher_len: int, min_rows: int = 64) -> dict:
    """The fields of StrictPairs for samples [start, stop) in micro-batch rows."""
    a = host.alignment
    sel = (a.pair_sample >= start) & (a.pair_sample < stop)
    size = padded_rows.rows_bucket(int(sel.sum()), min_rows)
    s_rows, weight = padded_rows.padded(padded_rows.rebase(a.student_rows[sel], host.student.seq_len, start, student_len), size)
    t_rows, _ = padded_rows.padded(padded_rows.rebase(a.teacher_rows[sel], host.teacher.seq_len, start, teacher_len), size)
    return dict(strict_student_rows=s_rows, strict_teacher_rows=t_rows, strict_weight=weight)


def strict_inputs(host, start: int, stop: int) -> MicroBatch:
    """Student and teacher tokens, response rows and strict pairs (the terms) of one
    micro-batch; the teacher hands back hidden states at the strict teacher rows. Objectives
    that extend the pairs build their terms from `vars(batch.terms)`."""
    batch = padded_rows.micro_batch(host, start, stop)
    pairs = strict_pairs(host, start, stop, batch.student_ids.shape[1], batch.teacher_ids.shape[1])
    return dataclasses.replace(batch, teacher_rows=pairs["strict_teacher_rows"], terms=StrictPairs(**pairs))


def strict_sum(settings, topk, x, teacher_hidden, weight=None):
    """(Σ_r w_r·D_r, per-row values) at the strict pairs; `teacher_hidden` [R, H_T] holds the
    teacher rows of the pairs in order; `weight` overrides the pairs' strict_weight."""
    s, pairs = settings, x.batch.terms
    rows = jnp.take(x.hidden, pairs.strict_student_rows, axis=0)
    weight = pairs.strict_weight if weight is None else weight
    return strict_kd_rows((rows, x.lm_head), (teacher_hidden, x.teacher_lm_head), x.overlap["s_ids"],
                          weight, t_ids=x.overlap["t_ids"], divergence=s.kd_loss_fn, topk=topk,
                          temperature=s.kd_temperature, implementation=s.implementation,
                          chunk_rows=s.chunked_loss_size, jsd_beta=s.jsd_beta,
                          skl_lambda=s.skl_lambda, akl_alpha=s.akl_alpha)


def span_comparison(settings, topk: int | None) -> GradientComparison:
    """SPEC §6 for an objective with a strict part (`settings`, top-k `topk`, None: full): its
    strict part (same divergence and kernel) against the span term, both from the span objective
    with the run's settings, so a `strict` run can be diagnosed too. The span objective comes
    from the registry: span.py builds on this module."""
    span = objective_class("span")
    own = {f.name for f in dataclasses.fields(span.settings_class)}
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name in own}
    fields.update(name="span", span_base="strict" if topk is None else "topk_strict")
    return GradientComparison(span(span.settings_class(**fields)), trained="strict", compared="span",
                              weight="strict_weight")


def check_topk(topk: int | None, shared_size: int) -> None:
    if topk is not None and topk > shared_size:
        raise ValueError(f"algorithm.ctkd_topk={topk} exceeds the shared vocabulary |V∩|="
                         f"{shared_size}; lower algorithm.ctkd_topk")


@register("strict")
class StrictFull(Objective):
    settings_class = StrictSettings
    stale_responses = "none"   # a divergence per state

    @property
    def topk(self) -> int | None:
        """k of the top-k (None: the full shared vocabulary)."""
        return None

    def gradient_comparison(self) -> GradientComparison:
        return span_comparison(self.settings, self.topk)

    def check(self, overlap) -> None:
        check_topk(self.topk, overlap.shared)

    def prepare(self, host, start, stop):
        return strict_inputs(host, start, stop)

    def kd_weights(self):
        return {"strict": 1.0}

    def kd_sums(self, x):
        total, _ = strict_sum(self.settings, self.topk, x, x.teacher_hidden)
        return {"strict": total}, {}


@register("topk_strict")
class StrictTopK(StrictFull):
    @property
    def topk(self) -> int | None:
        return int(self.settings.ctkd_topk)
