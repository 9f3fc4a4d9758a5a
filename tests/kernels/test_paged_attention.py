"""Ragged paged decode attention: XLA and Pallas (interpret) against the numpy oracle, and the
Pallas kernel's CUDA lowering (jax.export)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.kernels.paged_attention import api, pallas, reference, xla

from gpu_target import abstract_gpu


def _case(rng, rows=5, hq=4, hkv=2, d=16, page=8, pool=24, lengths=(1, 8, 9, 30, 0)):
    maxp = -(-max(lengths) // page) + 1
    perm = rng.permutation(pool)   # rows own disjoint, shuffled pages
    table = np.zeros((rows, maxp), np.int32)
    used = 0
    for r, n in enumerate(lengths):
        k = -(-n // page)
        table[r, :k] = perm[used:used + k]
        used += k
    q = rng.normal(size=(rows, hq, d)).astype(np.float32)
    k = rng.normal(size=(hkv, pool, page, d)).astype(np.float32)
    v = rng.normal(size=(hkv, pool, page, d)).astype(np.float32)
    return q, k, v, table, np.asarray(lengths, np.int32)


@pytest.mark.parametrize("hq,hkv,page", [(4, 2, 8), (4, 4, 16), (8, 1, 4)])
def test_xla_equals_numpy_reference(hq, hkv, page):
    q, k, v, table, lengths = _case(np.random.default_rng(0), hq=hq, hkv=hkv, page=page)
    want = reference.decode_attention(q, k, v, table, lengths)
    got = jax.jit(xla.decode_attention)(q, k, v, table, lengths)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


def test_tokens_past_a_rows_length_do_not_count():
    # Every pool position a row must not see holds a huge value: the result is unchanged.
    q, k, v, table, lengths = _case(np.random.default_rng(1), lengths=(3, 8, 5, 1, 2))
    want = reference.decode_attention(q, k, v, table, lengths)
    seen = np.zeros(k.shape[1:3], bool)
    for r, n in enumerate(lengths):
        idx = np.arange(n)
        seen[table[r, idx // 8], idx % 8] = True
    for a in (k, v):
        a[:, ~seen] = 1e4
    impls = [jax.jit(xla.decode_attention)]
    if pallas.AVAILABLE:
        impls.append(lambda *a: pallas.decode_attention(*a, interpret=True))
    for impl in impls:
        got = np.asarray(impl(q, k, v, table, lengths))
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


needs_op = pytest.mark.skipif(not pallas.AVAILABLE, reason=pallas.MISSING)


@needs_op
@pytest.mark.parametrize("page", [4, 16])
def test_pallas_interpret_equals_numpy_reference(page):
    q, k, v, table, lengths = _case(np.random.default_rng(2), hq=4, hkv=2, page=page,
                                    lengths=(1, 17, 33, 6, 0))
    want = reference.decode_attention(q, k, v, table, lengths)
    got = pallas.decode_attention(q, k, v, table, lengths, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


def test_auto_is_xla_on_cpu_and_bad_names_fail():
    assert api.resolve("auto") == "xla"
    with pytest.raises(ValueError, match="paged attention must be one of"):
        api.resolve("flash")


def test_without_the_op_auto_is_xla_and_pallas_says_why(monkeypatch):
    monkeypatch.setattr(pallas, "AVAILABLE", False)
    assert api.resolve("auto") == "xla"
    with pytest.raises(NotImplementedError, match="removed in jax 0.12.1"):
        pallas.decode_attention(*_case(np.random.default_rng(3)), interpret=True)


@needs_op
def test_pallas_lowers_for_cuda():
    # A 3B-sized decode step: 64 rows, 24 query / 8 kv heads of 128, 16-token pages.
    rows, hq, hkv, d, page, pool, maxp = 64, 24, 8, 128, 16, 4096, 256
    shapes = (jax.ShapeDtypeStruct((rows, hq, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((hkv, pool, page, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((hkv, pool, page, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((rows, maxp), jnp.int32),
              jax.ShapeDtypeStruct((rows,), jnp.int32))
    # jax.export refuses Triton custom calls by default (no serialisation guarantee); the
    # check is lifted for this one target so the lowering itself is exercised.
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with abstract_gpu():
        exported = jax.export.export(jax.jit(pallas.decode_attention), platforms=["cuda"],
                                     disabled_checks=[triton])(*shapes)
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == (rows, hq, d)
    assert re.search(r"__gpu\$xla\.gpu\.triton", exported.mlir_module())
