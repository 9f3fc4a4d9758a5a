"""`rollout.async_rollouts`: the background collection's order against the weight pushes (a fake
engine that records which weights each generation read), the truncated importance weights
against numpy. The trainer's numbers at staleness 0 against the synchronous run's:
tests/trainer/test_async_training.py."""
from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.common.metrics import StepTimer
from ctopd_jax.config import RolloutSection
from ctopd_jax.rollout.async_rollouts import Drawn, Rollouts
from ctopd_jax.rollout.staleness import TruncatedIS, truncated_weights


class FakeServer:
    """Weights version `version`; a generation takes a while and must never see a push."""

    def __init__(self):
        self.version, self.generating = 0, threading.Lock()

    def collect(self, drawn, timer):
        with self.generating:
            seen = self.version
            time.sleep(0.02)
            assert self.version == seen, "the weights changed under a generation"
        return {"index": drawn.index, "weights": seen}

    def push(self, version):
        assert not self.generating.locked(), "a push landed during a generation"
        self.version = version


def run_loop(rollout: RolloutSection, steps: int = 5):
    server = FakeServer()
    draws = []

    def draw(index):
        draws.append(index)
        return Drawn(index, [f"prompt {index}"], index, None, ("rng", {"position": index}))

    rollouts = Rollouts(draw, server.collect, rollout, steps)
    seen = []
    for k in range(steps):
        timer = StepTimer()
        collected, drawn, metrics = rollouts.take(k, timer)
        assert collected["index"] == drawn.index == k
        time.sleep(0.01)   # training
        rollouts.before_push(timer)
        server.push(k + 1)  # the weights after update k
        rollouts.after_push(k)
        seen.append((collected["weights"], metrics.get("rollout_staleness")))
    rollouts.close()
    assert draws == list(range(steps))   # each iteration drawn once, in order, none past the end
    return seen


def test_sync_and_staleness_0_generate_from_the_latest_weights_staleness_1_from_one_before():
    sync = RolloutSection()
    assert run_loop(sync) == [(k, None) for k in range(5)]
    stale0 = dataclasses.replace(sync, async_rollouts=True, async_staleness=0)
    assert run_loop(stale0) == [(0, 0.0)] + [(k, 0.0) for k in range(1, 5)]
    stale1 = dataclasses.replace(stale0, async_staleness=1)
    assert run_loop(stale1) == [(0, 0.0)] + [(k - 1, 1.0) for k in range(1, 5)]


def test_a_draw_made_ahead_is_where_a_resume_starts():
    rollouts = Rollouts(lambda i: Drawn(i, [], i, None, ("rng before", i)), lambda d, t: {},
                        RolloutSection(async_rollouts=True, async_staleness=1), steps=3)
    rollouts.take(0, StepTimer())
    assert rollouts.ahead().before == ("rng before", 1)
    rollouts.close()


def test_truncated_weights_against_numpy():
    rng = np.random.default_rng(0)
    train, rollout = rng.normal(-2, 1, 64), rng.normal(-2, 1, 64)
    have = rng.random(64) > 0.2
    for cap in (1.0, 2.0, 10.0):
        expected = np.where(have, np.minimum(np.exp(train - rollout), cap), 1.0)
        got = truncated_weights(jnp.asarray(train), jnp.asarray(rollout), jnp.asarray(have), cap)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


class WeightsSeen:
    """An objective stand-in whose sums are the response weights it was given."""
    settings = dataclasses.make_dataclass("S", [("chunked_loss_size", int, 3),
                                                ("implementation", str, "xla")])()

    def loss_sums(self, hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap):
        return {"weights": batch.response_weight}, {}


def test_the_step_weighs_each_response_token_by_the_truncated_ratio_numpy_reference():
    rng = np.random.default_rng(1)
    hidden, lm_head = rng.normal(size=(10, 4)), rng.normal(size=(4, 7))
    rows, targets = np.array([1, 2, 3, 5, 8]), np.array([0, 6, 2, 2, 4])
    rollout_lp = rng.normal(-2, 0.5, 5)
    have = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    base_weight = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
    logits = hidden[rows] @ lm_head
    train_lp = (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(5), targets]
    tis = np.where(have > 0, np.minimum(np.exp(train_lp - rollout_lp), 2.0), 1.0)
    batch = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else jnp.int32), MicroBatch(
        response_rows=rows, response_targets=targets, rollout_logprobs=rollout_lp,
        rollout_logprob_weight=have, response_weight=base_weight))
    sums, metrics = TruncatedIS(WeightsSeen(), 2.0).loss_sums(
        jnp.asarray(hidden, jnp.float32), jnp.asarray(lm_head, jnp.float32), None, None, batch, {})
    np.testing.assert_allclose(np.asarray(sums["weights"]), base_weight * tis, rtol=1e-5)
    num, den = metrics["tis_weight"]   # the mean weight over the tokens with a rollout log-prob
    assert float(den) == 4.0 and float(num) == pytest.approx(float(np.sum(have * tis)), rel=1e-5)


def test_the_step_corrects_only_tis_objectives_at_staleness_1():
    from ctopd_jax.algorithms import default_objective
    from ctopd_jax.algorithms.opd import OpdSampled, OpdSettings
    from ctopd_jax.rollout.staleness import step_objective

    recomputed = OpdSampled(OpdSettings(name="opd", gap_logprobs="recomputed"))
    stale1 = RolloutSection(async_rollouts=True, async_staleness=1, async_tis_cap=3.0)
    assert step_objective(recomputed, stale1) == TruncatedIS(recomputed, 3.0)
    for objective, rollout in [(recomputed, dataclasses.replace(stale1, async_staleness=0)),
                               (recomputed, RolloutSection()),
                               (default_objective("opd"), stale1),         # its own ratio
                               (default_objective("topk_strict"), stale1)]:  # a divergence per state
        assert step_objective(objective, rollout) is objective
