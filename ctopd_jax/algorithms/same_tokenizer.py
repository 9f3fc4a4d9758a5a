"""Shared ground of the same-tokenizer OPD family (SPEC §9): gkd, opd, opd_full, vopd, opd2.

Teacher and student share one tokenizer and chat template (tokenization.same_pair.same_tokenizer_mismatch refuses
any other pair before a model loads), the sampled ids are reused (collector.SameTokenizerCollector),
so the student's response rows and the teacher's rows are the same positions of the same ids:
`prepare` asks the teacher for hidden states at exactly the student's response rows, and every
teacher quantity (sampled-token log-prob, full-vocabulary KL, top-k centring) is computed from
those rows beside the student's (kernels.token_rows, kernels.full_rows, kernels.strict).

Decisions where SPEC is silent (documented here once for the family):
- Log-probs of the OPD family are taken at `algorithm.kd_temperature` (student and teacher
  alike; set it to rollout.temperature, as SPEC asks for the teacher). The engines report π_old
  at τ = 1 (rollout.base), so `gap_logprobs: rollout` with kd_temperature ≠ 1 is refused; use
  `recomputed` there.
- π_old on rows without an engine log-prob (the EOS appended to a truncated sample, SPEC §1;
  responses not sampled by the student) is the recomputed value: the ratio is 1 there.
- Full-vocabulary per-row divergences use every column of the lm_head (a model's padded
  vocabulary included), so both models must have the same lm_head width (checked at build).
- Normalisation is SPEC §1's (÷ the optimizer batch's response tokens, EOS included); tinker
  sums without normalising and TCOD/SOD take token means: scale lr accordingly when comparing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import Needs, Objective
from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.config import AlgorithmSection, require
from ctopd_jax.kernels import strict_kd_rows
from ctopd_jax.kernels.token_rows import token_rows


@dataclass(frozen=True)
class SameTokenizerSettings(AlgorithmSection):
    # π_old of the sampled gap g_t: the engine's rollout-time log-probs (tinker) or the
    # trainer's own recomputation before the update (NeMo-RL, slime, SOD)
    gap_logprobs: Literal["rollout", "recomputed"] = "rollout"

    def validate(self) -> None:
        super().validate()
        require(self.gap_logprobs == "recomputed" or self.kd_temperature == 1.0,
                 "algorithm.gap_logprobs",
                 f"'rollout' log-probs are engine log-probs at temperature 1, but "
                 f"algorithm.kd_temperature={self.kd_temperature}; set gap_logprobs=recomputed "
                 "or kd_temperature=1.0")


def same_inputs(host, start: int, stop: int) -> MicroBatch:
    """Student tokens and response rows; the teacher (and a teacher base) read the
    same ids and hand back hidden states at the same rows."""
    batch = padded_rows.micro_batch(host, start, stop)
    if batch.teacher_ids.shape != batch.student_ids.shape:
        raise ValueError("same-tokenizer objectives need a host batch whose teacher side is the "
                         "student side (collector.SameTokenizerCollector)")
    served = None
    if host.served_teacher_rows is not None:   # a served teacher: log π_T(y) already scored
        served = padded_rows.served_token_logprobs(host, padded_rows.response_batch_rows(host.teacher, start, stop),
                                            batch.response_rows.shape[0])
    return dataclasses.replace(batch, teacher_rows=batch.response_rows, teacher_token_logprobs=served)


def student_logprobs(x, s, temperature: float):
    """log π_θ(y) at the response rows at `temperature` (differentiable)."""
    if temperature == 1.0:
        return x.response_logprobs
    rows = jnp.take(x.hidden, x.batch.response_rows, axis=0)
    return token_rows(rows, x.lm_head, x.batch.response_targets, temperature=temperature,
                      chunk_rows=s.chunked_loss_size, implementation=s.implementation)[0]


def teacher_logprobs(x, s, temperature: float, hidden=None, lm_head=None):
    """log π_T(y) at the response rows (a constant); `hidden`/`lm_head` for another model.
    A served teacher (no hidden rows) scored them on the host, at temperature 1 (preflight
    refuses another kd_temperature with a served teacher)."""
    if hidden is None and x.teacher_hidden is None:
        return x.batch.teacher_token_logprobs
    hidden = x.teacher_hidden if hidden is None else hidden
    lm_head = x.teacher_lm_head if lm_head is None else lm_head
    lp, _ = token_rows(jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(lm_head),
                       x.batch.response_targets, temperature=temperature,
                       chunk_rows=s.chunked_loss_size, implementation=s.implementation)
    return jax.lax.stop_gradient(lp)


def old_logprobs(x, s, logp):
    """π_old per response row (a constant): rollout-time where the engine gave one (and
    gap_logprobs is 'rollout'), else the recomputed value."""
    recomputed = jax.lax.stop_gradient(logp)
    if s.gap_logprobs == "recomputed":
        return recomputed
    have = x.batch.rollout_logprob_weight > 0
    return jnp.where(have, x.batch.rollout_logprobs, recomputed)


def full_vocab_sum(x, s, divergence: str, temperature: float, jsd_beta: float = 0.5, weights=None):
    """(Σ_r w_r D_r, per-row D_r) of a SPEC §5 divergence over the full vocabulary at the
    response rows, chunked from hidden rows with the recomputing gradient (s_ids = t_ids =
    arange(V): the shared-vocabulary kernel with every column shared). w_r: `weights`, by
    default the response rows' own weights."""
    vocab = x.lm_head.shape[1]
    if x.teacher_lm_head.shape[1] != vocab:
        raise ValueError(f"student lm_head has {vocab} columns, the teacher's "
                         f"{x.teacher_lm_head.shape[1]}; same-tokenizer objectives need one vocabulary")
    ids = jnp.arange(vocab, dtype=jnp.int32)
    rows = jnp.take(x.hidden, x.batch.response_rows, axis=0)
    return strict_kd_rows((rows, x.lm_head), (x.teacher_hidden, x.teacher_lm_head), ids,
                          x.batch.response_weight if weights is None else weights, t_ids=ids,
                          divergence=divergence,
                          temperature=temperature, implementation=s.implementation,
                          chunk_rows=s.chunked_loss_size, jsd_beta=jsd_beta)


class SameTokenizerObjective(Objective):
    """Base of the family: sampled ids reused, rollout log-probs collected."""
    settings_class = SameTokenizerSettings
    needs = Needs(responses="student", teacher=True, rollout_logprobs=True, reuse_sampled_ids=True,
                  episodes=True)
    stale_responses = "none"   # full-vocabulary divergences per state; the sampled ones override

    def check(self, overlap) -> None:
        if overlap.teacher_vocab_size != overlap.student_vocab_size:
            raise ValueError(
                f"algorithm.name={self.name}: a same-tokenizer objective, but the teacher "
                f"vocabulary has {overlap.teacher_vocab_size} tokens and the student's "
                f"{overlap.student_vocab_size}; use one tokenizer for both (or a cross-tokenizer "
                "objective such as topk_strict)")

    def prepare(self, host, start, stop):
        return same_inputs(host, start, stop)

    @staticmethod
    def weighted(values, x):
        return jnp.sum(values * x.batch.response_weight)
