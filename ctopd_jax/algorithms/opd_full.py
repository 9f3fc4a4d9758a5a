"""OPD, full (SPEC §9): `algorithm.name: opd_full`.

Σ_t KL_t with KL_t = KL(π_θ ‖ π_T) over the FULL vocabulary at every response position
(reverse KL, at `kd_temperature`), chunked from hidden rows with the recomputing gradient
(same_tokenizer.full_vocab_sum). Same expected per-state gradient as sampled OPD, no sampling
noise in the per-position term.
"""
from __future__ import annotations

from ctopd_jax.algorithms.base import Needs, register
from ctopd_jax.algorithms.same_tokenizer import SameTokenizerObjective, full_vocab_sum


@register("opd_full")
class OpdFull(SameTokenizerObjective):
    needs = Needs(responses="student", teacher=True, rollout_logprobs=False, reuse_sampled_ids=True,
                  episodes=True)

    def kd_weights(self):
        return {"opd_full": 1.0}

    def kd_sums(self, x):
        total, _ = full_vocab_sum(x, self.settings, "rkl", self.settings.kd_temperature)
        return {"opd_full": total}, {}
