"""GKD (SPEC §9) against an independent PyTorch generalised JSD: values and gradients for
β ∈ {0, 0.1, 0.5, 0.9, 1}, SPEC's check values, the relation to §5's `jsd` (b ↔ 1 − β), the
seeded λ draw and its checkpointed state, and that the full-vocabulary path is chunked (no
[R, V] intermediate)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from same_helpers import objective_sum, random_logits, step_inputs
import torch_opd

from ctopd_jax.algorithms.gkd import Gkd, GkdSettings, gkd_divergence
from ctopd_jax.algorithms.micro_batch import MicroBatch

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


def gkd(beta, **kw):
    return Gkd(GkdSettings(name="gkd", gkd_beta=beta, **kw))


@pytest.mark.parametrize("beta,implementation", [
    pytest.param(b, "xla") for b in BETAS] + [
    pytest.param(b, "reference", marks=[pytest.mark.slow]) for b in BETAS])
def test_values_and_gradients_match_torch(beta, implementation):
    s, t = random_logits(0, 9, 11), random_logits(1, 9, 11)
    obj = gkd(beta, implementation=implementation, chunked_loss_size=4, kd_temperature=1.5)
    value, grad = objective_sum(obj, s, t, np.zeros(9), "gkd")
    zs = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    ref = torch_opd.gkd_jsd(zs, torch.tensor(t, dtype=torch.float64), beta, temperature=1.5).sum()
    ref.backward()
    assert value == pytest.approx(ref.item(), rel=2e-5, abs=1e-6)
    np.testing.assert_allclose(grad, zs.grad.numpy(), rtol=2e-4, atol=2e-6)


def test_spec_check_values():
    ps, pt = np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]])
    expected = {0.0: 0.192745, 1.0: 0.223144, 0.5: 0.050672, 0.1: 0.017473, 0.9: 0.019599}
    for beta, want in expected.items():
        value, _ = objective_sum(gkd(beta, implementation="reference"), ps, pt, [0], "gkd")
        assert value == pytest.approx(want, abs=2e-6), beta
        ref = torch_opd.gkd_jsd(torch.tensor(ps), torch.tensor(pt), beta)
        assert float(ref) == pytest.approx(want, abs=2e-6), beta


@pytest.mark.parametrize("beta", (0.1, pytest.param(0.5, marks=pytest.mark.slow),
                                  pytest.param(0.9, marks=pytest.mark.slow)))
def test_relation_to_kdflow_jsd(beta):
    """gkd_jsd(β) = kdflow_jsd(b = 1 − β): the objective against §5's formula (torch), and the
    interpolant alone → 0 at both ends (so β = 0 / 1 are substitutions, not limits)."""
    s, t = random_logits(2, 5, 6), random_logits(3, 5, 6)
    value, _ = objective_sum(gkd(beta, implementation="reference"), s, t, np.zeros(5), "gkd")
    kdflow = torch_opd.kdflow_jsd(torch.tensor(s, dtype=torch.float64),
                                  torch.tensor(t, dtype=torch.float64), 1.0 - beta).sum()
    assert value == pytest.approx(float(kdflow), rel=2e-5)
    assert gkd_divergence(beta) == ("jsd", pytest.approx(1.0 - beta))
    zs, zt = torch.tensor(s, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    m_end = lambda b: (b * zt.softmax(-1) + (1 - b) * zs.softmax(-1)).log()
    for b in (1e-9, 1 - 1e-9):  # the interpolant near the ends is ~0, the substitutes are not
        jsd = b * torch_opd.kl(zt.log_softmax(-1), m_end(b)) + \
            (1 - b) * torch_opd.kl(zs.log_softmax(-1), m_end(b))
        assert float(jsd.sum()) < 1e-6
    assert float(torch_opd.reverse_kl(zs, zt).sum()) > 0.1


@pytest.mark.slow
def test_padding_rows_add_nothing():
    s, t = random_logits(4, 6, 5), random_logits(5, 6, 5)
    w = np.array([1, 1, 1, 0, 0, 0], np.float32)
    full, _ = objective_sum(gkd(0.5), s[:3], t[:3], np.zeros(3), "gkd")
    padded, grad = objective_sum(gkd(0.5), s, t, np.zeros(6), "gkd", weight=w)
    assert padded == pytest.approx(full, rel=1e-6)
    assert np.all(grad[3:] == 0)


def test_lambda_draw_is_seeded_and_resumable():
    a, b = gkd(0.5, gkd_lambda=0.5, gkd_seed=7), gkd(0.5, gkd_lambda=0.5, gkd_seed=7)
    first = [a.response_sources(1)[0] for _ in range(5)]
    state = a.state_dict()
    rest_a = [a.response_sources(1)[0] for _ in range(20)]
    assert first == [b.response_sources(1)[0] for _ in range(5)]
    b.load_state_dict(state)
    assert rest_a == [b.response_sources(1)[0] for _ in range(20)]
    assert set(first + rest_a) == {"student", "dataset"}
    # numpy's PCG64 stream is the documented draw: u ≤ λ → on-policy
    u = np.random.Generator(np.random.PCG64(7)).uniform(size=25)
    assert first + rest_a == ["student" if x <= 0.5 else "dataset" for x in u]


def test_lambda_granularity():
    step = gkd(0.5, gkd_lambda=0.5, seq_kd=True, gkd_seed=3)
    micro = gkd(0.5, gkd_lambda=0.5, seq_kd=True, gkd_seed=3, gkd_lambda_granularity="micro_batch")
    draws = [step.response_sources(4) for _ in range(10)]
    assert all(len(set(d)) == 1 for d in draws)  # one draw per optimizer step
    u = np.random.Generator(np.random.PCG64(3)).uniform(size=8)
    assert micro.response_sources(8) == ["student" if x <= 0.5 else "teacher" for x in u]
    assert gkd(0.5, gkd_lambda=1.0).response_sources(3) == ["student"] * 3


def test_bad_beta_is_one_line():
    from ctopd_jax.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=r"^algorithm\.gkd_beta: 1\.5 must be in \[0, 1\]$"):
        from_dict({"algorithm": {"name": "gkd", "gkd_beta": 1.5}})


def test_full_vocabulary_path_is_chunked():
    """No intermediate of the xla path (value and gradient) has R rows and V columns at once:
    hidden [R, H] with H ≪ V, chunks of 8 rows."""
    from ctopd_jax.algorithms.base import StepInputs

    rows, hid, vocab = 64, 8, 300
    rng = np.random.default_rng(6)
    hs, ht = (jnp.asarray(rng.standard_normal((rows, hid)), jnp.float32) for _ in range(2))
    ws, wt = (jnp.asarray(rng.standard_normal((hid, vocab)), jnp.float32) for _ in range(2))
    obj = gkd(0.5, chunked_loss_size=8)
    batch = MicroBatch(response_rows=jnp.arange(rows), response_weight=jnp.ones(rows))

    def f(h, w):
        return obj.kd_sums(StepInputs(h, w, ht, wt, batch, {}, None))[0]["gkd"]

    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(hs, ws)
    shapes = []

    def walk(jp):
        for eqn in jp.eqns:
            shapes.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for p in eqn.params.values():
                for q in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(q, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))
    walk(jaxpr.jaxpr)
    assert (8, vocab) in shapes                     # the chunks exist
    assert not [sh for sh in shapes if len(sh) >= 2 and sh[0] >= rows and sh[-1] >= vocab]
