"""GKD (arXiv:2306.13649): `algorithm.name: gkd`.

Loss per response position (SPEC §9): the generalised JSD with β weighting the TEACHER,

    M = β p_T + (1−β) p_S,   JSD_β = β KL(p_T‖M) + (1−β) KL(p_S‖M),

with β = 0 REPLACED by forward KL(p_T‖p_S) and β = 1 by reverse KL(p_S‖p_T) (substitutions, not
limits: JSD_β itself → 0 at both ends). SPEC §5's `jsd` (KDFlow) weights the student, so
JSD_β = kdflow_jsd(b = 1 − β): the full-vocabulary kernel runs `jsd` with jsd_beta = 1 − β,
chunked from hidden rows (same_tokenizer.full_vocab_sum).

Responses: one seeded draw u ~ U(0, 1); u ≤ λ → the current student samples them (on-policy);
else the teacher (`seq_kd: true`, a second engine over the teacher) or the dataset's responses.
`gkd_lambda_granularity: step` draws once per optimizer step (the paper's Algorithm 1),
`micro_batch` once per accumulation micro-batch (each micro-batch its own mix). The generator is
numpy's PCG64 seeded by `gkd_seed`; its state travels with checkpoints (state_dict), so a
resumed run draws what an uninterrupted one would.

Temperature: sampling only by default (rollout.temperature); set `algorithm.kd_temperature` to
apply one in the loss too (both distributions divided by it before the divergence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms.base import Needs, register
from ctopd_jax.algorithms.same_tokenizer import (SameTokenizerObjective, SameTokenizerSettings,
                                                 full_vocab_sum)
from ctopd_jax.config import require


@dataclass(frozen=True)
class GkdSettings(SameTokenizerSettings):
    gkd_beta: float = 0.5                 # β ∈ [0, 1]: 0 → forward KL, 1 → reverse KL
    gkd_lambda: float = 0.5               # probability of on-policy (student) responses
    seq_kd: bool = False                  # off-policy responses from the teacher, else the dataset
    # one λ draw per optimizer step (the paper) or per accumulation micro-batch
    gkd_lambda_granularity: Literal["step", "micro_batch"] = "step"
    gkd_seed: int = 0                     # seed of the λ draws

    def validate(self) -> None:
        super().validate()
        require(0.0 <= self.gkd_beta <= 1.0, "algorithm.gkd_beta", f"{self.gkd_beta} must be in [0, 1]")
        require(0.0 <= self.gkd_lambda <= 1.0, "algorithm.gkd_lambda",
                 f"{self.gkd_lambda} must be in [0, 1] (1 = always on-policy)")


def gkd_divergence(beta: float) -> tuple[str, float]:
    """(SPEC §5 divergence name, its jsd_beta) that computes GKD's JSD_β with the substitutions."""
    if beta == 0.0:
        return "kl", 0.5
    if beta == 1.0:
        return "rkl", 0.5
    return "jsd", 1.0 - beta


@register("gkd")
class Gkd(SameTokenizerObjective):
    settings_class = GkdSettings

    def __init__(self, settings):
        super().__init__(settings)
        self._rng = np.random.Generator(np.random.PCG64(int(settings.gkd_seed)))

    @property
    def needs(self) -> Needs:  # the off-policy source depends on seq_kd
        off = "teacher" if self.settings.seq_kd else "dataset"
        return Needs(responses="student" if self.settings.gkd_lambda >= 1.0 else off, teacher=True,
                     rollout_logprobs=False, reuse_sampled_ids=True, teacher_engine=self.settings.seq_kd)

    # -- the λ draw (host side) ----------------------------------------------------------------
    def off_policy_source(self) -> str:
        return "teacher" if self.settings.seq_kd else "dataset"

    def response_sources(self, micro_batches: int) -> list[str]:
        """The response source of each micro-batch of one optimizer step."""
        s = self.settings
        draws = 1 if s.gkd_lambda_granularity == "step" else micro_batches
        picked = ["student" if self._rng.uniform() <= s.gkd_lambda else self.off_policy_source()
                  for _ in range(draws)]
        return picked * micro_batches if draws == 1 else picked

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rng"):
            self._rng.bit_generator.state = state["rng"]

    # -- device side -----------------------------------------------------------------------------
    def kd_weights(self):
        return {"gkd": 1.0}

    def kd_sums(self, x):
        s = self.settings
        name, b = gkd_divergence(float(s.gkd_beta))
        total, _ = full_vocab_sum(x, s, name, s.kd_temperature, jsd_beta=b)
        return {"gkd": total}, {}
