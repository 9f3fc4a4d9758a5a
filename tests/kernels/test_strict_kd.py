"""strict_kd_sum (reference / xla implementations) against the independent PyTorch reference:
values and gradients of every divergence for strict full and strict top-k, plus edge cases."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from _strict_case import Case, assert_close, make_case, torch_strict, torch_value_and_grad
from ctopd_jax.kernels.losses import DIVERGENCES
from ctopd_jax.kernels.strict import api
from ctopd_jax.kernels.strict.row_chunks import at_k_columns
from ctopd_jax.kernels.strict_topk import xla as topk_xla

IMPLS = ("reference", "xla")


def ours(case: Case, divergence, topk=None, implementation="xla", chunk_rows=4, fused=True,
         dtype=jnp.float32, **kw):
    """(value, grad w.r.t. the student rows) of strict_kd_sum for one divergence."""
    return ours_many(case, [divergence], topk, implementation, chunk_rows, fused, dtype,
                     **kw)[divergence]


def ours_many(case: Case, divergences, topk=None, implementation="xla", chunk_rows=4, fused=True,
              dtype=jnp.float32, **kw):
    """Several divergences under ONE jit: compiling is most of the cost of these small tests."""
    teacher = jnp.asarray(case.zt, dtype)
    if not fused:  # the caller projected the teacher already
        teacher = jnp.take(teacher, jnp.asarray(case.t_ids), axis=1)
    t_ids = jnp.asarray(case.t_ids) if fused else None

    def all_losses(zs):
        out = {}
        for name in divergences:
            out[name] = jax.value_and_grad(lambda z, name=name: api.strict_kd_sum(
                z, teacher, jnp.asarray(case.s_ids), jnp.asarray(case.w), divergence=name,
                topk=topk, implementation=implementation, chunk_rows=chunk_rows, t_ids=t_ids,
                **kw))(zs)
        return out

    return jax.jit(all_losses)(jnp.asarray(case.zs, dtype))


def check_against_torch(case, divergences, topk, implementation, **kw):
    got = ours_many(case, divergences, topk, implementation, **kw)
    for name in divergences:
        value, grad = got[name]
        ref_value, ref_grad = torch_value_and_grad(case, name, topk, **kw)
        try:
            assert_close(value, grad, ref_value, ref_grad)
        except AssertionError as err:
            raise AssertionError(f"{name} (topk={topk}, {implementation}): {err}") from None
    return got


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 7])
def test_every_divergence_matches_torch_reference(topk, implementation):
    check_against_torch(make_case(seed=1 if topk else 2), DIVERGENCES, topk, implementation)


@pytest.mark.parametrize("implementation", IMPLS)
def test_divergence_parameters_and_temperature(implementation):
    kw = dict(temperature=1.7, jsd_beta=0.3, skl_lambda=0.25, akl_alpha=0.35)
    check_against_torch(make_case(seed=3), ["jsd", "skl", "srkl", "akl", "rkl"], None,
                        implementation, **kw)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [1, 40])  # k = 1 and k = |V∩|
def test_topk_extremes(topk, implementation):
    check_against_torch(make_case(seed=5, shared=40), ["rkl", "kl", "jsd", "tvd"], topk,
                        implementation)


def test_topk_all_columns_equals_full():
    case = make_case(seed=6, shared=40)
    names = ["rkl", "kl", "tvd"]
    full, k_all = ours_many(case, names, None), ours_many(case, names, 40)
    for name in names:
        np.testing.assert_allclose(float(full[name][0]), float(k_all[name][0]), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(full[name][1]), np.asarray(k_all[name][1]),
                                   atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLS)
def test_topk_ties_lower_column_wins(implementation):
    case = make_case(seed=7, ties=True)
    # the data really has ties at the top-k boundary (and -0.0 next to +0.0)
    zbar = case.zs[:, case.s_ids]
    kth = -np.sort(-zbar, axis=1)
    assert np.any(kth[:, 6] == kth[:, 7])
    check_against_torch(case, ["rkl", "kl", "tvd", "top1_ce"], 7, implementation)


def test_reference_selection_equals_torch_topk_without_ties():
    case = make_case(seed=8)
    zbar = torch.tensor(case.zs[:, case.s_ids])
    for k in (1, 5, 40):
        assert torch_strict.topk_indices_agree_with_torch_topk(zbar, k)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 5])
def test_neg_inf_outside_support(topk, implementation):
    got = check_against_torch(make_case(seed=9, neg_inf=True), DIVERGENCES, topk,
                              implementation)
    assert all(np.all(np.isfinite(np.asarray(g))) for _, g in got.values())


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 5])
def test_empty_batch_and_single_row(topk, implementation):
    empty = make_case(rows=0)
    value, grad = ours(empty, "rkl", topk, implementation)
    assert float(value) == 0.0 and grad.shape == (0, empty.zs.shape[1])
    single = make_case(rows=1, seed=11, pad_rows=False)
    value, grad = ours(single, "rkl", topk, implementation)
    assert_close(value, grad, *torch_value_and_grad(single, "rkl", topk))


@pytest.mark.parametrize("chunk_rows, fused, topk", [(1, True, None), (2, False, 3), (64, True, 3)])
def test_chunking_and_projection_do_not_change_the_result(chunk_rows, fused, topk):
    case = make_case(rows=9, seed=12)
    value, grad = ours(case, "jsd", topk, "xla", chunk_rows=chunk_rows, fused=fused)
    assert_close(value, grad, *torch_value_and_grad(case, "jsd", topk))


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 4])
def test_bf16_inputs_are_computed_in_float32(topk, implementation):
    case = make_case(seed=13)
    bf = jnp.asarray(case.zs, jnp.bfloat16)
    rounded = Case(np.asarray(bf.astype(jnp.float32)),
                   np.asarray(jnp.asarray(case.zt, jnp.bfloat16).astype(jnp.float32)),
                   case.s_ids, case.t_ids, case.w)
    value, grad = ours(case, "rkl", topk, implementation, dtype=jnp.bfloat16)
    assert value.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    ref_value, ref_grad = torch_value_and_grad(rounded, "rkl", topk)
    # the value is computed in float32 from the same bf16 numbers; the gradient is returned in
    # the input dtype (bf16: 8 mantissa bits)
    assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value)
    np.testing.assert_allclose(np.asarray(grad, np.float32), ref_grad, rtol=1e-2,
                               atol=1e-2 * np.abs(ref_grad).max())


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 6])
def test_from_hidden_states_matches_torch(topk, implementation):
    rng = np.random.default_rng(14)
    case = make_case(seed=14)
    hidden = rng.normal(size=(case.zs.shape[0], 16)).astype(np.float32)
    lm_head = (rng.normal(size=(16, case.zs.shape[1])) * 0.5).astype(np.float32)

    h_t = torch.tensor(hidden, requires_grad=True)
    w_t = torch.tensor(lm_head, requires_grad=True)
    per_row = torch_strict.strict_rows("rkl", h_t @ w_t, torch.tensor(case.zt), case.s_ids,
                                       case.t_ids, topk=topk)
    ref = (per_row * torch.tensor(case.w)).sum()
    ref.backward()

    def loss(h, w):
        return api.strict_kd_sum((h, w), jnp.asarray(case.zt), jnp.asarray(case.s_ids),
                                 jnp.asarray(case.w), divergence="rkl", topk=topk,
                                 implementation=implementation, chunk_rows=4,
                                 t_ids=jnp.asarray(case.t_ids))

    value, (g_h, g_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, lm_head)
    assert_close(value, g_h, float(ref.detach()), h_t.grad.numpy(), rtol=2e-5)
    assert_close(value, g_w, float(ref.detach()), w_t.grad.numpy(), rtol=2e-5)


@pytest.mark.parametrize("fused, topk", [(False, 5), (True, 5), (True, None)])
def test_flat_alignment_row_indices_match_torch_strict_sum(fused, topk):
    rng = np.random.default_rng(15)
    case = make_case(rows=12, seed=15)
    s_rows = rng.choice(12, size=7, replace=False).astype(np.int32)
    t_rows = rng.choice(12, size=7, replace=False).astype(np.int32)
    zs_t = torch.tensor(case.zs, requires_grad=True)
    ref = torch_strict.strict_sum("rkl", zs_t, torch.tensor(case.zt), s_rows, t_rows,
                                  case.s_ids, case.t_ids, topk=topk)
    ref.backward()
    zt = jnp.asarray(case.zt)

    def loss(zs):
        if fused:  # rows gathered chunk by chunk inside the kernel driver
            return api.strict_kd_sum(zs, zt, jnp.asarray(case.s_ids), jnp.ones(7),
                                     divergence="rkl", topk=topk,
                                     t_ids=jnp.asarray(case.t_ids), student_row_ids=jnp.asarray(s_rows),
                                     teacher_row_ids=jnp.asarray(t_rows), chunk_rows=3)
        rows = api.gather_rows(zs, jnp.asarray(s_rows))
        teacher = api.gather_rows(zt, jnp.asarray(t_rows))
        return api.strict_kd_sum(rows, teacher, jnp.asarray(case.s_ids), jnp.ones(7),
                                 divergence="rkl", topk=topk, t_ids=jnp.asarray(case.t_ids))

    value, grad = jax.jit(jax.value_and_grad(loss))(jnp.asarray(case.zs))
    assert_close(value, grad, float(ref.detach()), zs_t.grad.numpy())


def test_donated_logits_give_the_same_gradient():
    case = make_case(seed=16)
    expect = ours(case, "rkl", None, "xla")

    def loss(zs):
        return api.strict_kd_sum(zs, jnp.asarray(case.zt), jnp.asarray(case.s_ids),
                                 jnp.asarray(case.w), divergence="rkl",
                                 t_ids=jnp.asarray(case.t_ids), chunk_rows=4)

    fn = jax.jit(jax.value_and_grad(loss), donate_argnums=0)
    value, grad = fn(jnp.asarray(case.zs))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(expect[1]))


def test_fallback_order():
    assert api.resolve_implementation("pallas", "akl") == "xla"
    for topk in (16, 1024):  # XLA selects for the top-k kernel: any k
        assert api.resolve_implementation("pallas", "rkl", topk=topk) == "pallas"
    assert api.resolve_implementation("xla", "akl") == "xla"
    assert api.resolve_implementation("reference", "rkl") == "reference"


@pytest.mark.parametrize("kwargs, field", [
    (dict(topk=0), "ctkd_topk"), (dict(topk=41), "ctkd_topk"), (dict(topk=2.0), "ctkd_topk"),
    (dict(implementation="cuda"), "implementation"), (dict(divergence="kld"), "kd_loss_fn"),
    (dict(jsd_beta=1.0), "jsd_beta"), (dict(temperature=0.0), "temperature"),
    (dict(chunk_rows=0), "chunk_rows"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, field):
    case = make_case(seed=17)
    args = dict(divergence="rkl") | kwargs
    with pytest.raises(ValueError, match=field):
        api.strict_kd_sum(jnp.asarray(case.zs), jnp.asarray(case.zt), jnp.asarray(case.s_ids),
                          jnp.asarray(case.w), t_ids=jnp.asarray(case.t_ids), **args)


def test_shape_errors_name_the_field():
    case = make_case(seed=18)
    with pytest.raises(ValueError, match="teacher"):
        api.strict_kd_sum(jnp.asarray(case.zs), jnp.asarray(case.zt), jnp.asarray(case.s_ids),
                          jnp.asarray(case.w), divergence="rkl")  # unprojected, no t_ids
    with pytest.raises(ValueError, match="row_weight"):
        api.strict_kd_sum(jnp.asarray(case.zs), jnp.asarray(case.zt), jnp.asarray(case.s_ids),
                          jnp.ones(3), divergence="rkl", t_ids=jnp.asarray(case.t_ids))


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("topk", [None, 7])
def test_teacher_from_hidden_rows_and_per_row_values_match_torch(topk, implementation):
    """The one teacher path: the teacher arrives as (hidden rows, lm_head) and its V∩ columns are
    computed chunk by chunk; the per-row values are each row's weighted divergence."""
    rng = np.random.default_rng(21)
    case = make_case(seed=21)
    t_hidden = rng.normal(size=(case.zs.shape[0], 12)).astype(np.float32)
    t_head = (rng.normal(size=(12, case.zt.shape[1])) * 0.7).astype(np.float32)
    zs = torch.tensor(case.zs, requires_grad=True)
    per_row = torch_strict.strict_rows("rkl", zs, torch.tensor(t_hidden @ t_head), case.s_ids, case.t_ids,
                                       topk=topk) * torch.tensor(case.w)
    per_row.sum().backward()

    def loss(z):
        return api.strict_kd_rows(z, (jnp.asarray(t_hidden), jnp.asarray(t_head)), jnp.asarray(case.s_ids),
                                  jnp.asarray(case.w), divergence="rkl", topk=topk, chunk_rows=4,
                                  implementation=implementation, t_ids=jnp.asarray(case.t_ids))

    (total, rows), grad = jax.jit(lambda z: (loss(z), jax.grad(lambda x: loss(x)[0])(z)))(
        jnp.asarray(case.zs))
    np.testing.assert_allclose(np.asarray(rows), per_row.detach().numpy(), rtol=2e-5, atol=1e-6)
    assert_close(total, grad, float(per_row.sum().detach()), zs.grad.numpy(), rtol=2e-5)


@pytest.mark.parametrize("divergence, shared, k_columns", [("rkl", 160, True), ("jsd", 160, True),
                                                        ("rkl", 40, False)])
@pytest.mark.parametrize("implementation", IMPLS)
def test_both_sides_from_hidden_states_match_torch(divergence, shared, k_columns, implementation):
    """The training path: student and teacher both as (hidden rows, lm_head), strict top-5; with
    160 shared columns the xla path computes the teacher and the gradient at each row's 5 columns
    only, with 40 (5 columns of 16 outweigh a row's 40 logits) it runs dense. Chunks of 4 over 9
    rows (a tail), a zero-weight row."""
    rng = np.random.default_rng(31)
    case = make_case(vs=200, vt=220, shared=shared, seed=31)
    rows, h_s, h_t = case.zs.shape[0], 16, 12
    hidden = rng.normal(size=(rows, h_s)).astype(np.float32)
    lm_head = (rng.normal(size=(h_s, case.zs.shape[1])) * 0.5).astype(np.float32)
    t_hidden = rng.normal(size=(rows, h_t)).astype(np.float32)
    t_head = (rng.normal(size=(h_t, case.zt.shape[1])) * 0.7).astype(np.float32)
    weight = case.w.copy()
    weight[1] = 0.0
    h_ref, w_ref = torch.tensor(hidden, requires_grad=True), torch.tensor(lm_head, requires_grad=True)
    per_row = torch_strict.strict_rows(divergence, h_ref @ w_ref, torch.tensor(t_hidden @ t_head),
                                       case.s_ids, case.t_ids, topk=5) * torch.tensor(weight)
    per_row.sum().backward()

    def loss(h, w):
        return api.strict_kd_rows((h, w), (jnp.asarray(t_hidden), jnp.asarray(t_head)),
                                  jnp.asarray(case.s_ids), jnp.asarray(weight), divergence=divergence,
                                  topk=5, chunk_rows=4, implementation=implementation,
                                  t_ids=jnp.asarray(case.t_ids))

    (total, rows_out), (g_h, g_w) = jax.jit(lambda h, w: (
        loss(h, w), jax.grad(lambda a, b: loss(a, b)[0], argnums=(0, 1))(h, w)))(hidden, lm_head)
    np.testing.assert_allclose(np.asarray(rows_out), per_row.detach().numpy(), rtol=2e-5, atol=1e-6)
    assert_close(total, g_h, float(per_row.sum().detach()), h_ref.grad.numpy(), rtol=2e-5)
    assert_close(total, g_w, float(per_row.sum().detach()), w_ref.grad.numpy(), rtol=2e-5)
    assert not np.any(np.asarray(g_h)[1])   # the zero-weight row gets no gradient
    assert at_k_columns(topk_xla.make_chunk_fn(divergence, 5, 1.0, ()), (hidden, lm_head),
                        (t_hidden, t_head), case.s_ids) == k_columns


@pytest.mark.parametrize("implementation", ("reference", "xla", "pallas"))
def test_zero_weight_row_with_infinite_divergence_has_zero_gradient(implementation):
    """p_S > 0 where p_T = 0 makes a row's rkl +inf; with weight 0 it adds exactly nothing."""
    zs = jnp.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    zt = jnp.array([[0.0, -jnp.inf, 2.0], [0.5, 1.0, 2.0]])
    w = jnp.array([0.0, 1.0])
    value, grad = jax.value_and_grad(lambda z: api.strict_kd_sum(
        z, zt, jnp.arange(3), w, divergence="rkl", implementation=implementation))(zs)
    assert np.isfinite(float(value)) and np.all(np.asarray(grad[0]) == 0.0)
    assert np.all(np.isfinite(np.asarray(grad))) and np.any(np.asarray(grad[1]) != 0.0)
