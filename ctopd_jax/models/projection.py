"""The decoder's projections: one 2-D matmul over the flattened tokens, and on the CPU, for
bfloat16 compute, a matmul that sums in float32 forward and backward."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def project(x: jax.Array, w: jax.Array, dims: int = 1) -> jax.Array:
    """x [..., *in] @ w [*in, *out] (`in`: the last `dims` axes of x) as ONE 2-D matmul over the
    flattened tokens. Why not an einsum over [B, T, ...]: its weight gradient contracts two
    token axes, and XLA CPU then writes the activation gradient transposed inside an
    elementwise fusion, a cache-hostile copy that took a third of the student step
    (benchmarks/cpu_passes.py); the 2-D form's gradients are plain matmuls."""
    lead, inner = x.shape[:x.ndim - dims], math.prod(x.shape[x.ndim - dims:])
    x2, w2 = x.reshape(-1, inner), w.reshape(inner, -1)
    narrow_on_cpu = x.dtype != jnp.float32 and jax.default_backend() == "cpu"
    y = matmul_float32_sums(x2, w2) if narrow_on_cpu else x2 @ w2
    return y.reshape(*lead, *w.shape[dims:])


@jax.custom_vjp
def matmul_float32_sums(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for bfloat16 (or float16) x and w, summed in float32 and rounded to x's dtype, and
    the same form for the two matmuls of its gradient. Why: XLA CPU runs a bfloat16 GEMM at the
    AVX512-BF16 rate (about twice the float32 rate) only when it accumulates into float32; a
    GEMM with a bfloat16 result runs below the float32 rate, and jax's own gradient of this
    function contracts float32 cotangents with the weights upcast, float32 GEMMs
    (benchmarks/RESULTS.md, "bfloat16 compute on the CPU"). Same values as a bfloat16 GEMM
    that sums in float32, which is what a GPU's does; the GPU path keeps plain `@`."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_forward(x, w):
    return matmul_float32_sums(x, w), (x, w)


def _matmul_backward(residuals, g):
    x, w = residuals
    dx = jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(x.T, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


matmul_float32_sums.defvjp(_matmul_forward, _matmul_backward)
