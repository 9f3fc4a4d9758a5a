"""ctopd_jax.kernels.losses against the independent PyTorch reference (tests/reference/torch_strict.py):
per-row divergences (values and gradients), edge cases, normalization, CE and kd_ratio mixing."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "reference"))
import torch_strict  # noqa: E402

from ctopd_jax.kernels import losses  # noqa: E402

KW = dict(temperature=1.3, jsd_beta=0.4, skl_lambda=0.2, akl_alpha=0.45)


def _rows(seed, rows=6, cols=33, neg_inf=False):
    rng = np.random.default_rng(seed)
    zs = (rng.normal(size=(rows, cols)) * 2).astype(np.float32)
    zt = (rng.normal(size=(rows, cols)) * 2).astype(np.float32)
    if neg_inf:  # common support smaller than the columns, different per row
        for r in range(rows):
            drop = rng.choice(cols, size=cols // 3, replace=False)
            zs[r, drop] = -np.inf
            zt[r, drop] = -np.inf
    return zs, zt


def _torch_rows(name, zs, zt, **kw):
    zs_t = torch.tensor(zs, requires_grad=True)
    per_row = torch_strict.divergence(name, zs_t, torch.tensor(zt), **kw)
    weights = torch.arange(1, zs.shape[0] + 1, dtype=torch.float32)  # distinct row cotangents
    (per_row * weights).sum().backward()
    return per_row.detach().numpy(), zs_t.grad.numpy()


def _ours_rows(name, zs, zt, **kw):
    weights = jnp.arange(1, zs.shape[0] + 1, dtype=jnp.float32)

    def f(z):
        per_row = losses.divergence(name, z, jnp.asarray(zt), **kw)
        return jnp.sum(per_row * weights), per_row

    (_, per_row), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(zs))
    return np.asarray(per_row), np.asarray(grad)


@pytest.mark.parametrize("neg_inf", [False, True])
@pytest.mark.parametrize("name", losses.DIVERGENCES)
def test_divergence_values_and_gradients_match_torch(name, neg_inf):
    zs, zt = _rows(losses.DIVERGENCES.index(name), neg_inf=neg_inf)
    kw = KW if not neg_inf else {}
    ref_rows, ref_grad = _torch_rows(name, zs, zt, **kw)
    rows, grad = _ours_rows(name, zs, zt, **kw)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-5 * np.abs(ref_grad).max())


def test_identical_rows_give_zero_and_known_values():
    z = jnp.asarray(_rows(1)[0])
    for name in ("kl", "rkl", "jsd", "skl", "srkl", "akl", "tvd"):
        np.testing.assert_allclose(np.asarray(losses.divergence(name, z, z)), 0.0, atol=1e-6)
    # disjoint one-hot-like rows: TVD = 1, JSD(0.5) = log 2
    big = 1e4
    a = jnp.asarray([[big, 0.0, 0.0]])
    b = jnp.asarray([[0.0, 0.0, big]])
    np.testing.assert_allclose(float(losses.divergence("tvd", a, b)[0]), 1.0, atol=1e-6)
    np.testing.assert_allclose(float(losses.divergence("jsd", a, b)[0]), np.log(2), rtol=1e-5)


def test_zero_log_zero_and_infinite_kl():
    ninf = -jnp.inf
    zs = jnp.asarray([[0.0, ninf, 1.0]])
    zt = jnp.asarray([[0.5, ninf, ninf]])
    # student puts mass where the teacher has none: RKL infinite, FKL finite
    assert np.isinf(float(losses.divergence("rkl", zs, zt)[0]))
    fkl = float(losses.divergence("kl", zs, zt)[0])
    assert fkl == pytest.approx(np.log1p(np.e), rel=1e-6)  # p_T = [1,0,0], p_S(0) = 1/(1+e)


def test_bf16_inputs_are_float32_inside():
    zs, zt = _rows(2)
    bs, bt = jnp.asarray(zs, jnp.bfloat16), jnp.asarray(zt, jnp.bfloat16)
    got = losses.divergence("rkl", bs, bt)
    assert got.dtype == jnp.float32
    ref, _ = _torch_rows("rkl", np.asarray(bs.astype(jnp.float32)),
                         np.asarray(bt.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_top1_ce_and_akl_tie_breaks_match_reference():
    zs = np.asarray([[1.0, 2.0, 0.5, 0.3]], np.float32)
    zt = np.asarray([[3.0, 1.0, 3.0, 0.0]], np.float32)  # teacher argmax tie at columns 0 and 2
    for name in ("top1_ce", "akl"):
        ref, ref_grad = _torch_rows(name, zs, zt)
        got, grad = _ours_rows(name, zs, zt)
        np.testing.assert_allclose(got, ref, rtol=1e-6)
        np.testing.assert_allclose(grad, ref_grad, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(name="fkl"), dict(jsd_beta=0.0), dict(jsd_beta=1.0),
                                 dict(temperature=-1.0), dict(skl_lambda=1.0),
                                 dict(akl_alpha=1.5)])
def test_bad_divergence_arguments(bad):
    name = bad.pop("name", "rkl")
    z = jnp.zeros((1, 3))
    with pytest.raises(ValueError):
        losses.divergence(name, z, z, **bad)
    with pytest.raises(ValueError, match="same shape"):
        losses.divergence("rkl", jnp.zeros((1, 3)), jnp.zeros((1, 4)))


def test_normalization_global_and_micro_batches_agree_with_torch():
    rng = np.random.default_rng(3)
    per_pos = rng.random(24).astype(np.float32)
    aligned = rng.random(24) < 0.8  # unaligned positions stay in the denominator
    total = 24
    global_ref = torch_strict.normalize(float(per_pos[aligned].sum()), total)
    assert float(losses.normalized_loss(per_pos[aligned].sum(), total)) == pytest.approx(
        global_ref, rel=1e-6)
    micro = 4
    parts = []
    for m in range(micro):
        sl = slice(m * 6, (m + 1) * 6)
        part_sum = per_pos[sl][aligned[sl]].sum()
        ours = float(losses.normalized_loss(part_sum, total, micro, micro))
        assert ours == pytest.approx(torch_strict.normalize(float(part_sum), total, micro, micro),
                                     rel=1e-6)
        parts.append(ours)
    assert sum(parts) == pytest.approx(global_ref, rel=1e-5)
    assert float(losses.normalized_loss(0.0, 0)) == 0.0
    with pytest.raises(ValueError):
        losses.normalized_loss(1.0, 4, num_micro_batches=0)


def test_ce_sum_and_kd_ratio_mix_match_torch():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 5))
    mask = rng.random((2, 5)) < 0.7
    ref = float(torch_strict.ce_sum(torch.tensor(logits), targets, mask))
    ours = float(losses.token_ce_sum(jnp.asarray(logits), jnp.asarray(targets),
                                     jnp.asarray(mask)))
    assert ours == pytest.approx(ref, rel=1e-6)
    assert float(losses.mix_kd_ce(2.0, 4.0, 0.25)) == pytest.approx(0.75 * 4.0 + 0.25 * 2.0)
    assert losses.mix_kd_ce(2.0, float("nan"), 1.0) == 2.0  # CE not computed when kd_ratio = 1
    with pytest.raises(ValueError, match="kd_ratio"):
        losses.mix_kd_ce(1.0, 1.0, 1.5)


def test_masked_sum_ignores_padding_rows_even_if_infinite():
    per_row = jnp.asarray([1.0, jnp.inf, 2.0, jnp.nan])
    w = jnp.asarray([1.0, 0.0, 0.5, 0.0])
    assert float(losses.masked_sum(per_row, w)) == 2.0
    grad = jax.grad(lambda x: losses.masked_sum(x, w))(per_row)
    np.testing.assert_array_equal(np.asarray(grad), [1.0, 0.0, 0.5, 0.0])
