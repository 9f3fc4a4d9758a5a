"""Pallas implementation (interpret mode on CPU) against the independent PyTorch reference.

On CPU Pallas runs in interpret mode. Shapes stay tiny: interpret mode evaluates the kernel op by op. The kernel-level tests use a
16-column tile so that several vocabulary tiles, padding columns and padded rows are exercised.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _strict_case import Case, assert_close, make_case, torch_value_and_grad
from ctopd_jax.kernels import pallas_common
from ctopd_jax.kernels.strict_full import pallas as full_pallas
from ctopd_jax.kernels.strict_topk import pallas as topk_pallas
from test_strict_kd import check_against_torch, ours

PALLAS_DIVS = list(pallas_common.PALLAS_DIVERGENCES)
DIV_ITEMS = (("akl_alpha", 0.5), ("jsd_beta", 0.5), ("skl_lambda", 0.1))
# scripts/gpu_check.sh sets CTOPD_PALLAS_INTERPRET=0 to compile the kernel-level tests on GPU;
# the api-level tests pick interpret mode from the backend by themselves.
INTERPRET = os.environ.get("CTOPD_PALLAS_INTERPRET", "1") != "0"


@pytest.mark.parametrize("topk", [None, 7])
def test_every_divergence_matches_torch_reference(topk):
    # akl is listed too: it resolves to the xla fallback, and must still be right
    check_against_torch(make_case(seed=21), PALLAS_DIVS + ["akl"], topk, "pallas")


def _kernel_level(case: Case, divergences, topk):
    zs = jnp.asarray(case.zs)[:, case.s_ids]
    zt = jnp.asarray(case.zt)[:, case.t_ids]

    @jax.jit
    def run(zs, zt, w):
        out = {}
        for name in divergences:
            if topk is None:
                fn = full_pallas.make_chunk_fn(name, 1.0, DIV_ITEMS, INTERPRET, 16)
            else:
                fn = topk_pallas.make_chunk_fn(name, topk, 1.0, DIV_ITEMS, INTERPRET, 16)
            out[name] = fn(zs, zt, w)
        return out

    for name, (loss, grad_bar) in run(zs, zt, jnp.asarray(case.w)).items():
        grad = np.zeros_like(case.zs)
        grad[:, case.s_ids] = np.asarray(grad_bar)
        assert_close(loss, grad, *torch_value_and_grad(case, name, topk))


@pytest.mark.parametrize("topk", [None, 7])
def test_multi_tile_with_neg_inf_support(topk):
    _kernel_level(make_case(rows=9, seed=22, neg_inf=True), ["rkl", "kl", "jsd", "top1_ce"],
                  topk)


def test_topk_ties_and_extremes_multi_tile():
    _kernel_level(make_case(rows=9, seed=23, ties=True), ["rkl", "tvd"], 7)
    _kernel_level(make_case(rows=5, seed=24), ["rkl", "skl"], 1)
    _kernel_level(make_case(rows=5, seed=25, shared=40), ["rkl", "srkl"], 40)


@pytest.mark.parametrize("topk", [None, 5])
def test_empty_batch_single_row_and_bf16(topk):
    value, grad = ours(make_case(rows=0), "rkl", topk, "pallas")
    assert float(value) == 0.0 and grad.shape[0] == 0
    single = make_case(rows=1, seed=26, pad_rows=False)
    value, grad = ours(single, "rkl", topk, "pallas")
    assert_close(value, grad, *torch_value_and_grad(single, "rkl", topk))
    case = make_case(seed=27)
    value, grad = ours(case, "rkl", topk, "pallas", dtype=jnp.bfloat16)
    rounded = Case(np.asarray(jnp.asarray(case.zs, jnp.bfloat16).astype(jnp.float32)),
                   np.asarray(jnp.asarray(case.zt, jnp.bfloat16).astype(jnp.float32)),
                   case.s_ids, case.t_ids, case.w)
    ref_value, ref_grad = torch_value_and_grad(rounded, "rkl", topk)
    assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value)
    np.testing.assert_allclose(np.asarray(grad, np.float32), ref_grad, rtol=1e-2,
                               atol=1e-2 * np.abs(ref_grad).max())
