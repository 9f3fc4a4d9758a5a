"""TCOD (SPEC §9): a depth curriculum over turns, trained with OPD's sampled advantage.
`algorithm.name: tcod`.

With n the rollout batch index and P = `tcod_period`:
- F2B (`tcod_mode: f2b`): the student plays only the first k(n) = 1 + ⌊n/P⌋ turns (at most
  `tcod_turn_cap`, 30 in the released configs) and all of them are distilled;
- B2F (`tcod_mode: b2f`): the expert path (L turns) is replayed up to turn
  c(n) = clip(L − 1 − ⌊n/P⌋, 0, L − 1) as context, the student continues to the end, and only
  its own tokens are distilled.
Expert paths come from the dataset row (`expert_turns`, or `expert_actions` for an environment,
or the `response` split into paragraphs); a row without one gets a teacher rollout (ours,
labelled `teacher_expert_samples` in the metrics). Single-turn responses are split into paragraph
turns (ours). The loss is OPD's (algorithms/opd.py, its clip options included).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ctopd_jax.algorithms.base import Needs, TurnCurriculum, register
from ctopd_jax.algorithms.opd import OpdSettings
from ctopd_jax.algorithms.turn_based import TurnObjective
from ctopd_jax.config import require


@dataclass(frozen=True)
class TcodSettings(OpdSettings):
    tcod_mode: Literal["f2b", "b2f"] = "f2b"  # front-to-back or back-to-front curriculum
    tcod_period: int = 5                 # P: rollout batches per curriculum stage
    tcod_turn_cap: int = 30              # the most turns f2b lets the student play

    def validate(self) -> None:
        super().validate()
        require(self.tcod_period >= 1, "algorithm.tcod_period", f"{self.tcod_period} must be >= 1 rollout batches")
        require(self.tcod_turn_cap >= 1, "algorithm.tcod_turn_cap", f"{self.tcod_turn_cap} must be >= 1 turn")


def f2b_turns(n: int, period: int, cap: int) -> int:
    """k(n) = min(1 + ⌊n/P⌋, cap): the turns the student plays at rollout batch n."""
    return min(1 + n // period, cap)


def b2f_prefix(n: int, period: int, length: int) -> int:
    """c(n) = clip(L − 1 − ⌊n/P⌋, 0, L − 1): expert turns replayed before the student starts."""
    return max(0, min(length - 1 - n // period, length - 1))


@register("tcod")
class Tcod(TurnObjective, TurnCurriculum):
    settings_class = TcodSettings

    def kd_weights(self):
        return {"tcod": 1.0}

    def kd_sums(self, x):
        sums, metrics = super().kd_sums(x)
        return {"tcod": sums["opd"]}, metrics

    @property
    def needs(self) -> Needs:   # B2F: the teacher plays the expert paths rows lack
        return dataclasses.replace(TurnObjective.needs, teacher_engine=self.uses_expert())

    def uses_expert(self) -> bool:
        return self.settings.tcod_mode == "b2f"

    def turn_limit(self, rollout_index):
        s = self.settings
        return f2b_turns(rollout_index, s.tcod_period, s.tcod_turn_cap) if s.tcod_mode == "f2b" else None

    def expert_prefix(self, rollout_index, length):
        return b2f_prefix(rollout_index, self.settings.tcod_period, length)
