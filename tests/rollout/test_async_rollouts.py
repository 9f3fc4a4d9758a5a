"""`rollout.async_rollouts`: the background collection's order against the weight pushes (a fake
engine that records which weights each generation read), the truncated importance weights
against numpy, and their correction of a real objective's loss and gradient (opd, stale
responses with ratios far from 1) against a torch computation of SPEC §1's formula. The
trainer's numbers at staleness 0 against the synchronous run's, and its stale batches
reweighted: tests/trainer/test_async_training.py."""
from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

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


def torch_tis_opd_loss(h, w, ht, wt, rows, targets, weight, old, have, cap, tokens, correct=True):
    """SPEC §1 ("stale responses", tis) and §9 (OPD, sampled, gap_logprobs recomputed), written
    from the page in float64 torch: with lp = log π_θ(y_t), A_t = sg(log π_T(y_t) − lp_t), the
    ratio π_θ/π_old = exp(lp − sg lp) (π_old recomputed: ratio 1, gradient ∇lp) and
    w_t = min(sg π_θ(y_t) / π_rollout(y_t), C) where the engine gave a log-prob, else 1:
        loss = Σ_t weight_t · w_t · (−exp(lp_t − sg lp_t) · A_t) / tokens
    (the normaliser stays the response-token count, not Σ w)."""
    lp = torch.log_softmax(h[rows] @ w, -1).gather(1, targets[:, None])[:, 0]
    lt = torch.log_softmax(ht @ wt, -1).gather(1, targets[:, None])[:, 0]
    tis = torch.where(have, torch.clamp(torch.exp(lp.detach() - old), max=cap), torch.ones_like(lp))
    surrogate = -torch.exp(lp - lp.detach()) * (lt - lp).detach()
    return (weight * (tis if correct else 1.0) * surrogate).sum() / tokens


def test_tis_reweights_the_opd_gradient_of_stale_responses_as_spec_says_torch_reference():
    """opd with gap_logprobs=recomputed declares "tis": through the step's own path (the wrapped
    objective's loss_sums, its loss weights, SPEC §1's normalisation), stale responses whose
    rollout log-probs put π_θ/π_rollout on both sides of the cap (and of 1) give the loss and the
    gradient of the torch formula above; the uncorrected gradient differs, so the weights matter."""
    from ctopd_jax.kernels import losses
    from ctopd_jax.algorithms.opd import OpdSampled, OpdSettings
    from ctopd_jax.step.grad import weighted_sum

    rng = np.random.default_rng(1)
    flat, hid, vocab, cap = 12, 5, 9, 2.0
    h, w = rng.normal(size=(flat, hid)), rng.normal(size=(hid, vocab))
    rows, targets = np.array([1, 2, 3, 5, 8, 9, 10, 11]), rng.integers(0, vocab, 8)
    ht, wt = rng.normal(size=(8, 6)), rng.normal(size=(6, vocab))   # teacher rows per response row
    logits = h[rows] @ w
    lp_now = (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(8), targets]
    # log π_θ − log π_rollout: ratios 0.22, 0.61, 1.0, 1.65, 3.3 (capped), 7.4 (capped), 0.37, 2.7
    log_ratio = np.array([-1.5, -0.5, 0.0, 0.5, 1.2, 2.0, -1.0, 1.0])
    old = lp_now - log_ratio
    have = np.array([1, 1, 1, 1, 1, 1, 0, 1], bool)      # row 6: no engine log-prob (an EOS)
    weight = np.array([1, 1, 1, 1, 1, 1, 1, 0.0])          # row 11: padding
    tokens = 7.0                                            # response tokens of the batch
    batch = MicroBatch(response_rows=jnp.asarray(rows, jnp.int32),
                       response_targets=jnp.asarray(targets, jnp.int32),
                       response_weight=jnp.asarray(weight, jnp.float32),
                       rollout_logprobs=jnp.asarray(np.where(have, old, 0.0), jnp.float32),
                       rollout_logprob_weight=jnp.asarray(have, jnp.float32))
    opd = OpdSampled(OpdSettings(name="opd", gap_logprobs="recomputed", implementation="reference"))
    assert opd.stale_responses == "tis"

    def loss(objective, hh, ww):
        sums, metrics = objective.loss_sums(hh, ww, jnp.asarray(ht, jnp.float32),
                                            jnp.asarray(wt, jnp.float32), batch, {})
        return losses.normalized_loss(weighted_sum(sums, objective.loss_weights()), tokens), metrics

    f32 = lambda a: jnp.asarray(a, jnp.float32)
    (value, metrics), grads = jax.value_and_grad(lambda hh, ww: loss(TruncatedIS(opd, cap), hh, ww),
                                                 argnums=(0, 1), has_aux=True)(f32(h), f32(w))
    plain = jax.grad(lambda hh, ww: loss(opd, hh, ww)[0], argnums=(0, 1))(f32(h), f32(w))

    t = lambda a: torch.tensor(a, dtype=torch.float64)
    th, tw = t(h).requires_grad_(), t(w).requires_grad_()
    ref = torch_tis_opd_loss(th, tw, t(ht), t(wt), torch.as_tensor(rows), torch.as_tensor(targets),
                             t(weight), t(old), torch.as_tensor(have), cap, tokens)
    ref.backward()
    assert float(value) == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    for got, want in zip(grads, (th.grad, tw.grad)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=1e-6)
    # not vacuous: without the weights the gradient is another one
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(grads, plain)) > 0.05
    # the logged mean weight: over the rows with an engine log-prob (padding row 11 included)
    num, den = metrics["tis_weight"]
    want_weights = np.minimum(np.exp(log_ratio), cap)[have]
    assert float(den) == have.sum() and float(num) == pytest.approx(want_weights.sum(), rel=1e-5)


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
