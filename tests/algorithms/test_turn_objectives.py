"""tcod, sod, sage_opd (SPEC §9): the check values, judge parsing, and kd_sums against numpy
references written from SPEC §9 (student and teacher logits given directly, same_helpers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.algorithms import get_objective
from ctopd_jax.algorithms.sage_opd import parse_judgment
from ctopd_jax.algorithms.sod import step_weights
from ctopd_jax.algorithms.tcod import b2f_prefix, f2b_turns
from ctopd_jax.algorithms.turn_based import TurnTerms
from ctopd_jax.algorithms.turns import group_advantage
from ctopd_jax.config import ConfigError, from_dict

from divergences import log_softmax
from same_helpers import random_logits, step_inputs

# two samples of 6 rows; turns within each sample
TURNS = np.array([0, 0, 0, 1, 1, 2, 0, 0, 1, 1, 1, 1])
SAMPLE = np.array([0] * 6 + [1] * 6)
SEGMENT = np.array([0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4, 4])
FIRST = np.array([0] * 6 + [3] * 6)


def objective(name, **settings):
    return get_objective(from_dict({"algorithm": {"name": name, **settings}}).algorithm)


def inputs(s_logits, t_logits, targets, old, outcome=None, judgment=None):
    rows = len(targets)
    terms = TurnTerms(turn_segment=jnp.asarray(SEGMENT, jnp.int32), first_segment=jnp.asarray(FIRST, jnp.int32),
                      outcome_advantage=jnp.asarray(np.zeros(rows) if outcome is None else outcome, jnp.float32),
                      turn_judgment=jnp.asarray(np.full(rows, -1.0) if judgment is None else judgment, jnp.float32))
    return step_inputs(s_logits, t_logits, targets, old=old, terms=terms)


def value_and_grad(obj, name, s, t, targets, old, **kw):
    def f(z):
        x = inputs(z, t, targets, old, **kw)
        lp = jax.nn.log_softmax(z, -1)[jnp.arange(len(targets)), targets]
        x = type(x)(x.hidden, x.lm_head, x.teacher_hidden, x.teacher_lm_head, x.batch, x.overlap, lp)
        return obj.kd_sums(x)[0][name]
    v, g = jax.value_and_grad(f)(jnp.asarray(s))
    return float(v), np.asarray(g)


# -- SPEC §9 check values ------------------------------------------------------------------------
def test_tcod_schedule_check_values():
    assert (f2b_turns(0, 5, 30), b2f_prefix(0, 5, 8)) == (1, 7)
    assert (f2b_turns(12, 5, 30), b2f_prefix(12, 5, 8)) == (3, 5)
    assert all(b2f_prefix(n, 5, 8) == 0 for n in (35, 36, 100))
    assert b2f_prefix(34, 5, 8) == 1
    assert f2b_turns(144, 5, 30) == 29 and f2b_turns(145, 5, 30) == 30 and f2b_turns(10_000, 5, 30) == 30


def test_sod_step_weight_check_values():
    d = jnp.array([0.5, 1.0, 0.25])
    np.testing.assert_allclose(step_weights(d, d[0], 1e-6, 0.2), [1.0, 0.5, 1.2], rtol=1e-5)


def test_group_advantage_is_grpo():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    a = group_advantage(r, 3)
    np.testing.assert_allclose(a[:3], (r[:3] - 1 / 3) / (np.std(r[:3]) + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(a[3:], 0.0)
    np.testing.assert_allclose(group_advantage(r, 1), 0.0)


@pytest.mark.parametrize("answer,label", [
    ("Skip", "skip"), ("weak.", "weak"), ("STRONG", "strong"), ("I would say Weak", "weak"),
    ("Skip, definitely skip", "skip"), ("", "strong"), ("no idea", "strong"),
    ("not Strong but Weak", "strong"), ("skipping weakly", "strong"), ("Skip/Weak/Strong", "strong"),
    ("strongly", "strong"), ("<|end|>Skip", "skip")])
def test_judge_parsing(answer, label):
    assert parse_judgment(answer) == label


@pytest.mark.parametrize("name,field,value", [
    ("tcod", "tcod_mode", "both"), ("tcod", "tcod_period", 0), ("sod", "sod_delta", -1.0),
    ("sage_opd", "sage_judge", "oracle"), ("sage_opd", "sage_alpha", 1.5),
    ("sage_opd", "sage_proxy_skip_above", 1.2)])
def test_bad_settings_name_the_field(name, field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        from_dict({"algorithm": {"name": name, field: value}})


# -- kd_sums against numpy references --------------------------------------------------------------
def sampled_reference(s, t, targets, old, advantage):
    """−Σ (π_θ/π_old)·A and its gradient w.r.t. the student logits (A constant)."""
    lp_all = log_softmax(s.astype(np.float64))
    lp = lp_all[np.arange(len(targets)), targets]
    ratio = np.exp(lp - old)
    onehot = np.eye(s.shape[1])[targets]
    grad = -(advantage * ratio)[:, None] * (onehot - np.exp(lp_all))
    return float(-(ratio * advantage).sum()), grad


def test_sod_matches_reference():
    rows, vocab = 12, 9
    s, t = random_logits(0, rows, vocab), random_logits(1, rows, vocab)
    targets = np.random.default_rng(2).integers(0, vocab, rows)
    old = log_softmax(s.astype(np.float64))[np.arange(rows), targets] + np.random.default_rng(3).normal(0, .1, rows)
    outcome = np.where(SAMPLE == 0, 0.7, -0.7)
    gap = log_softmax(t.astype(np.float64))[np.arange(rows), targets] - old
    d = np.array([np.abs(gap[SEGMENT == k]).mean() for k in range(5)])
    w = np.minimum((d[FIRST] + 1e-6) / (d[SEGMENT] + 1e-6), 1.2)
    want, want_grad = sampled_reference(s, t, targets, old, outcome + w * gap)
    got, grad = value_and_grad(objective("sod"), "sod", s, t, targets, old, outcome=outcome)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-5)
    # sod_outcome: false drops Â
    want_off, _ = sampled_reference(s, t, targets, old, w * gap)
    got_off, _ = value_and_grad(objective("sod", sod_outcome=False), "sod", s, t, targets, old, outcome=outcome)
    np.testing.assert_allclose(got_off, want_off, rtol=1e-4, atol=1e-5)


def test_tcod_is_opd_sampled():
    rows, vocab = 12, 9
    s, t = random_logits(4, rows, vocab), random_logits(5, rows, vocab)
    targets = np.random.default_rng(6).integers(0, vocab, rows)
    old = log_softmax(s.astype(np.float64))[np.arange(rows), targets] - 0.05
    gap = log_softmax(t.astype(np.float64))[np.arange(rows), targets] - old
    want, want_grad = sampled_reference(s, t, targets, old, gap)
    got, grad = value_and_grad(objective("tcod"), "tcod", s, t, targets, old)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-5)


def sage_reference(s, t, judged):
    ps, pt = log_softmax(s.astype(np.float64)), log_softmax(t.astype(np.float64))
    kl = (np.exp(ps) * (ps - pt)).sum(-1)
    top1 = np.exp(pt.max(-1))
    c = np.array([top1[SEGMENT == k].mean() for k in range(5)])[SEGMENT]
    score = judged * c
    w = score / score.mean()
    grad = w[:, None] * np.exp(ps) * (ps - pt - kl[:, None])
    return float((w * kl).sum()), grad, w


@pytest.mark.parametrize("judge,skip_above", [("teacher", 0.8), ("proxy", 0.8), ("proxy", 1.0)])
def test_sage_matches_reference(judge, skip_above):
    rows, vocab = 12, 9
    s, t = random_logits(7, rows, vocab), random_logits(8, rows, vocab)
    t[:3] = s[:3] * 3            # turn 0 of sample 0: the same argmax (proxy: Skip)
    t[3, :] = s[3]               # turn 1 of sample 0: half agree (proxy: Weak)
    targets = np.random.default_rng(9).integers(0, vocab, rows)
    if judge == "teacher":
        judged = np.array([1, 1, 1, .5, .5, 0, 0, 0, 1, 1, 1, 1], float)
    else:
        agree = (s.argmax(-1) == t.argmax(-1)).astype(float)
        a = np.array([agree[SEGMENT == k].mean() for k in range(5)])[SEGMENT]
        judged = np.where(a > skip_above, 0.0, np.where(a > 0, 0.5, 1.0))
        assert len(set(judged)) >= 2   # the case exercises more than one label
        assert (0.0 in judged) == (skip_above < 1.0)   # 1.0: turn 0 agrees fully, yet is not skipped
    want, want_grad, w = sage_reference(s, t, judged)
    np.testing.assert_allclose(w.mean(), 1.0, rtol=1e-9)     # the weights have mean 1
    got, grad = value_and_grad(objective("sage_opd", sage_judge=judge, sage_proxy_skip_above=skip_above),
                               "sage_opd", s, t, targets, None,
                               judgment=judged if judge == "teacher" else None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-5)
