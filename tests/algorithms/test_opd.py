"""Sampled OPD and OPD-full (SPEC §9) against the PyTorch reference, and a Monte-Carlo test
that the sampled estimator's expected gradient is OPD-full's on a tiny model."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from same_helpers import objective_sum, random_logits, step_inputs
import torch_opd

from ctopd_jax.algorithms.base import StepInputs
from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.algorithms.opd import OpdSampled, OpdSettings
from ctopd_jax.algorithms.opd_full import OpdFull
from ctopd_jax.algorithms.same_tokenizer import SameTokenizerSettings


@pytest.mark.parametrize("clip", ["none", "ppo", "icepop"])
def test_sampled_matches_torch(clip):
    rows, vocab = 12, 7
    s, t = random_logits(10, rows, vocab), random_logits(11, rows, vocab)
    rng = np.random.default_rng(12)
    y = rng.integers(0, vocab, rows)
    lp_now = torch.log_softmax(torch.tensor(s, dtype=torch.float64), -1)[torch.arange(rows), y]
    old = (lp_now + torch.tensor(rng.normal(0, 0.6, rows))).float().numpy()  # ratios spread over [0.3, 3]
    obj = OpdSampled(OpdSettings(name="opd", opd_clip=clip, implementation="reference"))
    value, grad = objective_sum(obj, s, t, y, "opd", old=old)
    zs = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    ref = torch_opd.opd_sampled(zs, torch.tensor(t, dtype=torch.float64), y,
                                torch.tensor(old, dtype=torch.float64), clip=clip)
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=1e-4, abs=1e-5)
    np.testing.assert_allclose(grad, zs.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_recomputed_and_missing_rollout_logprobs():
    """gap_logprobs=recomputed ignores the engine values; a row without one (weight 0) uses the
    recomputed value even with gap_logprobs=rollout (ratio 1 there)."""
    rows, vocab = 4, 5
    s, t = random_logits(13, rows, vocab), random_logits(14, rows, vocab)
    y = np.array([0, 1, 2, 3])
    lp = jax.nn.log_softmax(jnp.asarray(s), -1)[jnp.arange(rows), y]
    junk = np.full(rows, -9.0, np.float32)
    rec = OpdSampled(OpdSettings(name="opd", gap_logprobs="recomputed", implementation="reference"))
    roll = OpdSampled(OpdSettings(name="opd", implementation="reference"))
    v_rec, _ = objective_sum(rec, s, t, y, "opd", old=junk)
    v_mask, _ = objective_sum(roll, s, t, y, "opd", old=junk, old_weight=np.zeros(rows))
    v_true, _ = objective_sum(roll, s, t, y, "opd", old=np.asarray(lp))
    lt = jax.nn.log_softmax(jnp.asarray(t), -1)[jnp.arange(rows), y]
    want = -float(jnp.sum(lt - lp))  # ratio 1: −Σ g_t
    assert v_rec == pytest.approx(want, rel=1e-5) and v_mask == pytest.approx(want, rel=1e-5)
    assert v_true == pytest.approx(want, rel=1e-5)


def test_full_matches_torch():
    s, t = random_logits(15, 10, 9), random_logits(16, 10, 9)
    obj = OpdFull(SameTokenizerSettings(name="opd_full", chunked_loss_size=3))
    value, grad = objective_sum(obj, s, t, np.zeros(10), "opd_full")
    zs = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    ref = torch_opd.reverse_kl(zs, torch.tensor(t, dtype=torch.float64)).sum()
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=1e-5)
    np.testing.assert_allclose(grad, zs.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_bad_temperature_with_rollout_logprobs_is_one_line():
    from ctopd_jax.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=r"^algorithm\.gap_logprobs: .*set gap_logprobs=recomputed"):
        from_dict({"algorithm": {"name": "opd", "kd_temperature": 0.7}})


@pytest.mark.slow
def test_monte_carlo_expected_gradient_equals_opd_full():
    """Tiny model: student logits = h_r @ W (W [H, V] and the hidden rows trainable), a fixed
    teacher. y_r ~ π_θ(·|r) for N draws per state; the mean of the sampled objective's gradient
    (at θ = θ_old: rollout log-probs = current ones) must equal OPD-full's exact gradient.

    Tolerance: the per-element standard error SE is estimated from B = 40 independent batch
    means of N/B draws each; every element must lie within 5·SE (+1e-6): for Gaussian batch
    means a false alarm has probability < 6e-7 per element, < 1e-4 over the ~200 elements."""
    rows, hid, vocab, draws, batches = 3, 4, 6, 4000, 40
    rng = np.random.default_rng(20)
    h = jnp.asarray(rng.standard_normal((rows, hid)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((hid, vocab)), jnp.float32)
    ht = jnp.asarray(rng.standard_normal((rows, hid)), jnp.float32)
    wt = jnp.asarray(rng.standard_normal((hid, vocab)), jnp.float32)
    full = OpdFull(SameTokenizerSettings(name="opd_full", implementation="reference"))
    sampled = OpdSampled(OpdSettings(name="opd", implementation="reference"))

    def loss(obj, name, hh, ww, y, rep):
        hr, htr = jnp.repeat(hh, rep, 0), jnp.repeat(ht, rep, 0)
        n = hr.shape[0]
        lp = jax.nn.log_softmax(hr @ ww, -1)[jnp.arange(n), y]
        batch = MicroBatch(response_rows=jnp.arange(n), response_targets=y, response_weight=jnp.ones(n),
                           rollout_logprobs=jax.lax.stop_gradient(lp), rollout_logprob_weight=jnp.ones(n))
        return obj.kd_sums(StepInputs(hr, ww, htr, wt, batch, {}, lp))[0][name]

    exact = jax.grad(lambda hh, ww: loss(full, "opd_full", hh, ww, jnp.zeros(rows, jnp.int32), 1),
                     argnums=(0, 1))(h, w)
    per = draws // batches
    grad_fn = jax.jit(jax.grad(lambda hh, ww, y: loss(sampled, "opd", hh, ww, y, per) / per, argnums=(0, 1)))
    probs = np.asarray(jax.nn.softmax(h @ w, -1))
    means = []
    for b in range(batches):
        y = np.concatenate([rng.choice(vocab, per, p=probs[r] / probs[r].sum()) for r in range(rows)])
        means.append([np.asarray(g) for g in grad_fn(h, w, jnp.asarray(y, jnp.int32))])
    for i, e in enumerate(exact):
        m = np.stack([mb[i] for mb in means])
        se = m.std(0, ddof=1) / np.sqrt(batches)
        assert np.all(np.abs(m.mean(0) - np.asarray(e)) <= 5 * se + 1e-6), (i, m.mean(0), e, se)
        assert np.abs(np.asarray(e)).max() > 10 * se.max() / 5  # the test is not vacuous
