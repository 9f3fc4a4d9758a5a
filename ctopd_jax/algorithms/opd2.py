"""OPD² (arXiv:2607.15161, "On-Policy Delta Distillation"): `algorithm.name: opd2`.

A third model, `model.teacher_base` (the teacher's own pre-tuning base π_B, same tokenizer).
Per response position t with sampled token y (SPEC §9):

    R^OPD(v) = log π_T(v) − log π_θ(v),   R^Δ(v) = log π_T(v) − log π_B(v)
    A^X_t = R^X(y) − E_{v∼p̃_θ}[R^X(v)]     over the student's top-k (k = `opd2_topk` 1024),
                                            p̃_θ = π_θ renormalised on those k (our choice, as
                                            SPEC says: the paper's is unverified)
    A_t = A^Δ_t where A^Δ_t · A^OPD_t > 0, else 0
          (`opd2_disagree: opd`, ours, off by default: else A^OPD_t)
    loss −Σ_t stop_grad(s · A_t) · log π_θ(y_t)

s = `opd2_reward_scale` 0.1 multiplies every reward (the gate is sign based, unchanged by s).
Every softmax (student, teacher, base) is taken at `opd2_temperature` 0.7, the paper's recipe,
which also samples the rollouts at 0.7 (configs/tiny_cpu_same.yaml sets rollout.temperature;
the loss does not see the rollout section). One completion per prompt, no group normalisation
(the paper's GRPO-clipped surrogate has this gradient at θ_old).

The trainer runs the base like the teacher (hidden rows at the same response rows), passed as
batch.base_hidden (split over batch shards like the rows) and overlap["base_lm_head"]
(replicated, teacher.add_teacher_base); the centring expectations are computed chunk by
chunk from the three models' hidden rows (kernels.full_rows.topk_centres).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.base import Needs, register
from ctopd_jax.algorithms.same_tokenizer import (SameTokenizerObjective, SameTokenizerSettings,
                                                 student_logprobs, teacher_logprobs)
from ctopd_jax.config import require
from ctopd_jax.kernels import full_rows


@dataclass(frozen=True)
class Opd2Settings(SameTokenizerSettings):
    opd2_topk: int = 1024                # the student's top-k that centres the rewards
    opd2_reward_scale: float = 0.1       # s: multiplies every reward
    opd2_temperature: float = 0.7        # of the student, teacher and base softmaxes
    # where A^Δ and A^OPD disagree in sign: "drop" (the paper's gate: A = 0) or "opd" (ours: A =
    # A^OPD, so a token the student already samples more than the teacher is still pulled back;
    # docs/recipes.md, benchmarks/RESULTS.md issue 23)
    opd2_disagree: Literal["drop", "opd"] = "drop"
    gap_logprobs: Literal["rollout", "recomputed"] = "recomputed"   # OPD² reads π_θ itself

    def validate(self) -> None:
        super().validate()
        require(self.opd2_topk >= 1, "algorithm.opd2_topk", "must be >= 1")
        require(self.opd2_reward_scale > 0, "algorithm.opd2_reward_scale", "must be > 0")
        require(self.opd2_temperature > 0, "algorithm.opd2_temperature", "must be > 0")


def opd2_advantages(lp_s, lp_t, lp_b, centre_opd, centre_delta, disagree="drop"):
    """(A_t, A^Δ_t, A^OPD_t) from the sampled-token log-probs and the centring expectations."""
    a_opd = (lp_t - lp_s) - centre_opd
    a_delta = (lp_t - lp_b) - centre_delta
    return jnp.where(a_delta * a_opd > 0, a_delta, 0.0 if disagree == "drop" else a_opd), a_delta, a_opd


@register("opd2")
class Opd2(SameTokenizerObjective):
    settings_class = Opd2Settings
    stale_responses = None   # −stop_grad(A)·log π_θ on-policy, no rollout log-probs to correct it
    demo_settings = {"rollout.temperature": 0.7}   # the paper's sampling temperature (SPEC §9)
    needs = Needs(responses="student", teacher=True, teacher_base=True, rollout_logprobs=False,
                  reuse_sampled_ids=True, episodes=True)
    response_logprob_grad = True

    def kd_weights(self):
        return {"opd2": 1.0}

    def kd_sums(self, x):
        s, b = self.settings, x.batch
        tau = s.opd2_temperature
        logp = student_logprobs(x, s, tau)
        lp_t = teacher_logprobs(x, s, tau)
        base = (b.base_hidden, x.overlap["base_lm_head"])
        lp_b = teacher_logprobs(x, s, tau, *base)
        rows = jnp.take(x.hidden, b.response_rows, axis=0)
        k = min(int(s.opd2_topk), x.lm_head.shape[1])
        centres = full_rows.row_stats(
            full_rows.topk_centres(k),
            [(rows, x.lm_head), (x.teacher_hidden, x.teacher_lm_head), base],
            temperature=tau, chunk_rows=s.chunked_loss_size)
        adv, a_delta, a_opd = opd2_advantages(jax.lax.stop_gradient(logp), lp_t, lp_b,
                                              centres[:, 0], centres[:, 1], s.opd2_disagree)
        adv = jax.lax.stop_gradient(s.opd2_reward_scale * adv)
        w = b.response_weight
        # opd2_unopposed_fraction: tokens the student already samples more than the teacher
        # (A^OPD < 0) while the teacher beats the base there (A^Δ > 0); the paper's gate (`drop`)
        # gives them no gradient, so nothing pulls them back down (benchmarks/RESULTS.md, issue 23)
        metrics = {"opd2_kept_fraction": (jnp.sum(w * (a_delta * a_opd > 0)), jnp.sum(w)),
                   "opd2_unopposed_fraction": (jnp.sum(w * ((a_delta > 0) & (a_opd < 0))), jnp.sum(w)),
                   "opd2_advantage": (jnp.sum(w * adv), jnp.sum(w))}
        return {"opd2": self.weighted(-adv * logp, x)}, metrics
