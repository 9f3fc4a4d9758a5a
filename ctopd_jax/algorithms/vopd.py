"""vOPD (arXiv:2605.07865, "KL for a KL"; released code holi-lab/vOPD): `algorithm.name: vopd`.

The sampled OPD estimator with the closed-form value baseline −KL_t (SPEC §9):

    A_t = stop_grad(g_t + KL_t),   loss −Σ_t (π_θ(y_t)/π_old(y_t)) · A_t

KL_t = KL(π_θ ‖ π_T) at position t: exact over the full vocabulary (`vopd_baseline: full`) or on
the student's top-k columns with both rows renormalised there (`topk`, k = `vopd_topk` 100 as
the released top-k config). Since E_{y∼π_θ}[∇ log π_θ(y)] = 0, a per-state constant baseline
changes the variance of the estimator, not its expectation. The baseline is computed chunk by
chunk from hidden rows (kernels.full_rows), as a constant. `opd_clip` as in opd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax

from ctopd_jax.algorithms.base import register
from ctopd_jax.algorithms.opd import (OpdSampled, OpdSettings, gap_metrics, sampled_gap,
                                      sampled_terms)
from ctopd_jax.algorithms.same_tokenizer import SameTokenizerObjective
from ctopd_jax.config import require
from ctopd_jax.kernels import full_rows


@dataclass(frozen=True)
class VopdSettings(OpdSettings):
    vopd_baseline: Literal["full", "topk"] = "full"  # KL_t exact, or on the student's top-k
    vopd_topk: int = 100                 # k of the top-k baseline

    def validate(self) -> None:
        super().validate()
        require(self.vopd_topk >= 1, "algorithm.vopd_topk", "must be >= 1 (and <= the vocabulary)")


def kl_baseline(x, s):
    """KL_t per response row (a constant), exact or on the student's top-k."""
    rows = jax.numpy.take(x.hidden, x.batch.response_rows, axis=0)
    if s.vopd_baseline == "topk":
        k = min(int(s.vopd_topk), x.lm_head.shape[1])
        fn = full_rows.topk_reverse_kl(k)
    else:
        fn = full_rows.reverse_kl
    return full_rows.row_stats(fn, [(rows, x.lm_head), (x.teacher_hidden, x.teacher_lm_head)],
                               temperature=s.kd_temperature, chunk_rows=s.chunked_loss_size)[:, 0]


@register("vopd")
class Vopd(SameTokenizerObjective):
    settings_class = VopdSettings
    response_logprob_grad = True
    stale_responses = OpdSampled.stale_responses   # the same ratio as opd

    def kd_weights(self):
        return {"vopd": 1.0}

    def kd_sums(self, x):
        s = self.settings
        logp, old, gap = sampled_gap(x, s)
        kl = kl_baseline(x, s)
        terms, flags = sampled_terms(logp, old, jax.lax.stop_gradient(gap + kl), s)
        metrics = gap_metrics(x, gap, flags)
        w = x.batch.response_weight
        metrics["vopd_kl"] = (jax.numpy.sum(w * kl), jax.numpy.sum(w))
        return {"vopd": self.weighted(terms, x)}, metrics
