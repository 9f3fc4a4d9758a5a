"""The compiled Pallas strict kernels lower for CUDA (Mosaic GPU) at the real workload width.

`jax.export.export(jax.jit(f), platforms=["cuda"])` runs the Pallas -> Mosaic GPU lowering on
this CPU, including Mosaic GPU's shared-memory check ("Mosaic GPU kernel exceeds available
shared memory"), so a kernel whose tiles do not fit a Hopper SM fails here. The shapes are one
chunk of the reference workload: 2,048 rows (chunked_loss_size) × V∩ = 109,567 shared columns.
The chunk function returns the per-row loss and the gradient, so both outputs are lowered.
The Triton backend (CTOPD_PALLAS_GPU_BACKEND=triton) is lowered too; Triton's resource checks
happen only when XLA compiles on a GPU. This proves lowering only (what ran compiled on an H200
is in benchmarks/RESULTS.md).
"""
from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.kernels.pallas_shared import passes
from ctopd_jax.kernels.strict import api
from ctopd_jax.kernels.strict_full import pallas as full_pallas
from ctopd_jax.kernels.strict_topk import pallas as topk_pallas

from gpu_target import abstract_gpu

ROWS, SHARED = 2048, 109_567
DIV_ITEMS = (("akl_alpha", 0.5), ("jsd_beta", 0.5), ("skl_lambda", 0.1))
DIVS = list(passes.PALLAS_DIVERGENCES)


def _export_cuda(fn, rows=ROWS, cols=SHARED):
    block = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        block, block, jax.ShapeDtypeStruct((rows,), jnp.float32))
    assert exported.platforms == ("cuda",)
    assert [a.shape for a in exported.out_avals] == [(rows,), (rows, cols)]
    assert all(a.dtype == jnp.float32 for a in exported.out_avals)
    targets = set(re.findall(r"custom_call @([\w$.]+)", exported.mlir_module()))
    assert any(t.startswith("mosaic_gpu") for t in targets), targets
    return exported


@pytest.mark.parametrize("divergence", DIVS)  # ~1-3 s each
def test_strict_full_lowers_for_cuda(divergence):
    _export_cuda(full_pallas.make_chunk_fn(divergence, 1.0, DIV_ITEMS, False))


@pytest.mark.parametrize("topk", [16, pytest.param(128, marks=pytest.mark.slow)])  # ~0.5 s each
@pytest.mark.parametrize("divergence", DIVS)
def test_strict_topk_lowers_for_cuda(divergence, topk):
    # XLA's top_k selects (lowered beside the kernel); the Mosaic GPU kernel sees [rows, k]
    _export_cuda(topk_pallas.make_chunk_fn(divergence, topk, 1.0, DIV_ITEMS, False))


def _lower_cuda_triton(make_fn, monkeypatch):
    # jax.export refuses to serialise Triton custom calls (no compatibility guarantee), so the
    # Triton path is checked by lowering for the cuda platform instead. The backend is read
    # when the chunk function is made.
    monkeypatch.setenv("CTOPD_PALLAS_GPU_BACKEND", "triton")
    fn = make_fn()
    block = jax.ShapeDtypeStruct((ROWS, SHARED), jnp.float32)
    with abstract_gpu():
        lowered = jax.jit(fn).trace(block, block, jax.ShapeDtypeStruct((ROWS,), jnp.float32)
                                    ).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text


@pytest.mark.parametrize("divergence", ["rkl", "jsd", "top1_ce"])
def test_strict_full_lowers_with_triton_too(divergence, monkeypatch):
    _lower_cuda_triton(lambda: full_pallas.make_chunk_fn(divergence, 1.0, DIV_ITEMS, False),
                       monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("topk", [16, 128])
def test_strict_topk_lowers_with_triton_too(topk, monkeypatch):
    _lower_cuda_triton(lambda: topk_pallas.make_chunk_fn("rkl", topk, 1.0, DIV_ITEMS, False),
                       monkeypatch)


def test_oversized_tiles_fail_the_shared_memory_check():
    # The same kernel with 1,024-column tiles asks 2 stages x 3 tiles x 64 x 1024 x 4 B = 1.5 MiB
    # of shared memory: the export must refuse it (the check the tests above rely on is live).
    fn = full_pallas.make_chunk_fn("rkl", 1.0, DIV_ITEMS, False, 1024)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _export_cuda(fn, rows=64, cols=4096)


def test_compiled_pallas_that_cannot_lower_is_resolved_to_xla(caplog):
    # On this CPU a compiled (interpret=False) Pallas kernel cannot lower: resolving must notice
    # at trace time and log why; interpret mode (or no shape to try) keeps pallas.
    assert api.resolve_implementation("pallas", "rkl", chunk_shape=(64, 300),
                                      interpret=True) == "pallas"
    assert api.resolve_implementation("pallas", "rkl") == "pallas"
    for topk in (None, 5):
        caplog.clear()
        api._pallas_lowering_error.cache_clear()
        with caplog.at_level(logging.WARNING, logger="ctopd_jax.kernels.strict.api"):
            assert api.resolve_implementation("pallas", "rkl", topk, chunk_shape=(6, 40),
                                              interpret=False) == "xla"
        assert any("does not lower on cpu" in r.getMessage() and
                   "Only interpret mode" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_compiled_pallas_that_cannot_lower_runs_the_xla_chunks():
    # ... and strict_kd_sum then gives implementation="xla"'s value and gradient
    rng = np.random.default_rng(3)
    zs = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    zt = jnp.asarray(rng.normal(size=(6, 40)), jnp.float32)
    s_ids = jnp.asarray(rng.permutation(50)[:40], jnp.int32)
    w = jnp.asarray([1, 1, 0, 1, 1, 1], jnp.float32)
    for topk in (None, 5):
        kw = dict(divergence="rkl", topk=topk)
        got = jax.value_and_grad(lambda z: api.strict_kd_sum(
            z, zt, s_ids, w, implementation="pallas", interpret=False, **kw))(zs)
        want = jax.value_and_grad(lambda z: api.strict_kd_sum(
            z, zt, s_ids, w, implementation="xla", **kw))(zs)
        assert float(want[0]) > 0
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-7)
