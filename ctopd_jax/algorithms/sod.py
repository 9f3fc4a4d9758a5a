"""SOD (SPEC §9): step-weighted OPD. `algorithm.name: sod`.

Steps are the turns of the episode (maximal runs of assistant tokens between tool
observations; paragraphs of a single-turn response, ours). With g_t the sampled gap
log π_T(y_t) − log π_old(y_t):

    d_k = mean over step k of |g_t|  (detached)
    w_k = min((d_1 + ε) / (d_k + ε), 1 + δ)        (no lower bound; ε 1e-6, δ 0.2)
    A_t = Â_i + c · w_{k(t)} · g_t                  (c = 1)

and OPD's surrogate −Σ_t (π_θ/π_old)·A_t (algorithms/opd.py, clip options included). Â_i is the
sample's group-normalised outcome advantage (GRPO over its prompt's n samples; the reward is the
environment's, or the answer grader's on a single-turn task). `sod_outcome`: unset → on (Â is 0
for n_samples_per_prompt 1, which gives pure step-weighted distillation), false → off, true →
required, so n_samples_per_prompt must be > 1.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.base import Needs, register
from ctopd_jax.algorithms.opd import OpdSettings, gap_metrics, sampled_gap, sampled_terms
from ctopd_jax.algorithms.turn_based import TurnObjective, segment_means
from ctopd_jax.config import require


@dataclass(frozen=True)
class SodSettings(OpdSettings):
    sod_epsilon: float = 1e-6            # ε of the step weights
    sod_delta: float = 0.2               # step weights are capped at 1 + δ
    sod_coef: float = 1.0                # c: the weight of the distillation term
    sod_outcome: bool | None = None      # add the outcome advantage; null = when n_samples > 1

    def validate(self) -> None:
        super().validate()
        require(self.sod_epsilon > 0, "algorithm.sod_epsilon", f"{self.sod_epsilon} must be > 0")
        require(self.sod_delta >= 0, "algorithm.sod_delta", f"{self.sod_delta} must be >= 0")
        require(self.sod_coef >= 0, "algorithm.sod_coef", f"{self.sod_coef} must be >= 0")


def step_weights(d, d_first, epsilon: float, delta: float):
    """w_k = min((d_1 + ε) / (d_k + ε), 1 + δ)."""
    return jnp.minimum((d_first + epsilon) / (d + epsilon), 1.0 + delta)


@register("sod")
class Sod(TurnObjective):
    settings_class = SodSettings

    @property
    def needs(self) -> Needs:   # the outcome advantage needs rewards (unset sod_outcome: on)
        return dataclasses.replace(TurnObjective.needs,
                                   outcome_rewards=self.settings.sod_outcome is not False)

    def check_run(self, config) -> None:
        if self.settings.sod_outcome and config.rollout.n_samples_per_prompt < 2:
            raise ValueError("algorithm.sod_outcome: true needs rollout.n_samples_per_prompt > 1 (the "
                             "outcome advantage is normalised over each prompt's samples); raise it or "
                             "leave sod_outcome unset")

    def kd_weights(self):
        return {"sod": 1.0}

    def kd_sums(self, x):
        s = self.settings
        logp, old, gap = sampled_gap(x, s)
        d = segment_means(jnp.abs(gap), x)
        w = step_weights(d[x.batch.terms.turn_segment], d[x.batch.terms.first_segment], s.sod_epsilon, s.sod_delta)
        outcome = x.batch.terms.outcome_advantage if s.sod_outcome is not False else 0.0
        advantage = jax.lax.stop_gradient(outcome + s.sod_coef * w * gap)
        terms, flags = sampled_terms(logp, old, advantage, s)
        metrics = gap_metrics(x, gap, flags)
        rw = x.batch.response_weight
        metrics["sod_step_weight"] = (jnp.sum(rw * w), jnp.sum(rw))
        return {"sod": self.weighted(terms, x)}, metrics
