"""OPD, sampled (the tinker recipe; SPEC §9): `algorithm.name: opd`.

With g_t = log π_T(y_t) − log π_old(y_t) and A_t = stop_grad(g_t), the loss is

    −Σ_t (π_θ(y_t) / π_old(y_t)) · A_t          (no discount)

whose gradient at θ = θ_old is that of −Σ A_t log π_θ(y_t): a score-function estimator of the
gradient of Σ_t KL(π_θ‖π_T) at the visited states (opd_full has the same expectation, see
tests/algorithms/test_opd.py). It needs only the teacher's log-prob of the sampled tokens.

`opd_clip` (default none, as tinker):
- `ppo`: PPO's pessimistic surrogate −min(r·A, clip(r, 1−ε, 1+ε)·A), ε = `opd_clip_eps` 0.2 (slime);
- `icepop`: tokens whose ratio lies outside [`icepop_low`, `icepop_high`] = [0.5, 2] are masked
  (the IcePop rule NeMo-RL applies); the mask is a constant.
π_old: see same_tokenizer (`gap_logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.base import Needs, register
from ctopd_jax.algorithms.same_tokenizer import (SameTokenizerObjective, SameTokenizerSettings,
                                                 old_logprobs, student_logprobs, teacher_logprobs)
from ctopd_jax.config import require


@dataclass(frozen=True)
class OpdSettings(SameTokenizerSettings):
    # the ratio π_θ/π_old: used as is, clipped (ppo) or its outliers masked (icepop)
    opd_clip: Literal["none", "ppo", "icepop"] = "none"
    opd_clip_eps: float = 0.2            # ppo: the ratio is clipped at 1 ± this
    icepop_low: float = 0.5              # icepop: tokens whose ratio is below this are masked
    icepop_high: float = 2.0             # icepop: ... or above this

    def validate(self) -> None:
        super().validate()
        require(0.0 < self.opd_clip_eps < 1.0, "algorithm.opd_clip_eps", f"{self.opd_clip_eps} must be in (0, 1)")
        require(0.0 < self.icepop_low < 1.0, "algorithm.icepop_low",
                 f"{self.icepop_low} must be in (0, 1) (below 1 < icepop_high)")
        require(self.icepop_high > 1.0, "algorithm.icepop_high",
                 f"{self.icepop_high} must be > 1 (above icepop_low < 1)")


def sampled_terms(logp, old, advantage, settings):
    """Per-row surrogate −(π_θ/π_old)·A with the configured clip, and the clipped-row flags."""
    ratio = jnp.exp(logp - old)
    surrogate = ratio * advantage
    s = settings
    clip = getattr(s, "opd_clip", "none")
    if clip == "ppo":
        clipped = jnp.clip(ratio, 1.0 - s.opd_clip_eps, 1.0 + s.opd_clip_eps) * advantage
        flags = jax.lax.stop_gradient((clipped < surrogate).astype(jnp.float32))
        return -jnp.minimum(surrogate, clipped), flags
    if clip == "icepop":
        r = jax.lax.stop_gradient(ratio)
        keep = ((r >= s.icepop_low) & (r <= s.icepop_high)).astype(jnp.float32)
        return -keep * surrogate, 1.0 - keep
    return -surrogate, jnp.zeros_like(surrogate)


def sampled_gap(x, s):
    """(log π_θ(y), π_old(y), g = stop_grad(log π_T(y) − log π_old(y))) at the response rows."""
    logp = student_logprobs(x, s, s.kd_temperature)
    old = old_logprobs(x, s, logp)
    return logp, old, jax.lax.stop_gradient(teacher_logprobs(x, s, s.kd_temperature) - old)


def gap_metrics(x, gap, flags):
    w = x.batch.response_weight
    return {"opd_gap": (jnp.sum(w * gap), jnp.sum(w)),
            "opd_clipped_fraction": (jnp.sum(w * flags), jnp.sum(w))}


@register("opd")
class OpdSampled(SameTokenizerObjective):
    settings_class = OpdSettings
    response_logprob_grad = True
    # g_t reads only log π_T(y_t): a teacher behind a server can supply it
    needs = Needs(responses="student", teacher=True, rollout_logprobs=True, reuse_sampled_ids=True,
                  episodes=True, teacher_scores="token_logprobs")

    @property
    def stale_responses(self):   # π_old from the rollout: the ratio is the importance weight
        return "ratio" if self.settings.gap_logprobs == "rollout" else "tis"

    def kd_weights(self):
        return {"opd": 1.0}

    def kd_sums(self, x):
        s = self.settings
        logp, old, gap = sampled_gap(x, s)
        terms, flags = sampled_terms(logp, old, gap, s)
        return {"opd": self.weighted(terms, x)}, gap_metrics(x, gap, flags)
