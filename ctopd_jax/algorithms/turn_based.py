"""Shared ground of the turn-structured objectives (SPEC §9): tcod, sod, sage_opd.

They train on episodes (episode_collector.EpisodeCollector: multi-turn with an environment, or one
response split into paragraph turns), reuse the sampled ids like the rest of the same-tokenizer
family, and see each response row's TURN: their terms (`TurnTerms`) hold, per response row,
the row's turn, its sample's first turn, outcome advantage and judgment.

Padding rows take segment 0 with weight 0, so every weighted segment sum ignores them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import Needs
from ctopd_jax.algorithms.micro_batch import terms_class
from ctopd_jax.algorithms.opd import OpdSampled
from ctopd_jax.algorithms.same_tokenizer import same_inputs


@terms_class
class TurnTerms:
    """Per response row [R] (aligned with MicroBatch.response_rows)."""
    turn_segment: Any = None       # int32: a dense id of the row's (sample, turn) (segment sums)
    first_segment: Any = None      # int32: the id of the first turn of the row's sample (SOD's d_1)
    outcome_advantage: Any = None  # float32: the sample's group-normalised outcome advantage (SOD's Â)
    turn_judgment: Any = None      # float32: a judge's weight of the row's turn (SAGE-OPD; -1 where
    #                                the judge is the on-device proxy)


def turn_terms(host, start: int, stop: int, size: int) -> TurnTerms:
    lens = host.student.response_lens
    lo, hi = int(lens[:start].sum()), int(lens[:stop].sum())
    turn = host.turns.turn[lo:hi]
    sample = np.repeat(np.arange(start, stop), lens[start:stop])
    new = np.r_[True, (turn[1:] != turn[:-1]) | (sample[1:] != sample[:-1])] if len(turn) else np.zeros(0, bool)
    seg = np.cumsum(new) - 1
    opens = np.r_[True, sample[1:] != sample[:-1]] if len(turn) else np.zeros(0, bool)
    first = seg[opens][np.cumsum(opens) - 1]
    judgment = host.turns.judgment[lo:hi] if host.turns.judgment is not None else np.full(hi - lo, -1.0)
    return TurnTerms(turn_segment=padded_rows.padded(seg, size)[0], first_segment=padded_rows.padded(first, size)[0],
                     outcome_advantage=padded_rows.padded(host.turns.outcome[sample], size, np.float32)[0],
                     turn_judgment=padded_rows.padded(judgment, size, np.float32)[0])


def segment_means(values, x):
    """[rows] → [segments]: the weighted mean of `values` over each turn of the micro-batch."""
    w = x.batch.response_weight
    seg = x.batch.terms.turn_segment
    n = w.shape[0]
    total = jax.ops.segment_sum(values * w, seg, num_segments=n)
    count = jax.ops.segment_sum(w, seg, num_segments=n)
    return total / jnp.maximum(count, 1e-9)


class TurnObjective(OpdSampled):
    """OPD's sampled surrogate over turn-structured episodes; subclasses shape the advantage,
    the weights or the curriculum."""
    needs = Needs(responses="student", teacher=True, rollout_logprobs=True, reuse_sampled_ids=True,
                  turns=True, episodes=True, teacher_scores="token_logprobs")

    def prepare(self, host, start, stop):
        batch = same_inputs(host, start, stop)
        return dataclasses.replace(batch, terms=turn_terms(host, start, stop, batch.response_weight.shape[0]))

