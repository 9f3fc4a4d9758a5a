"""token_rows by row chunks: the forward keeps the two [R] results only, the backward recomputes
each chunk's logits (see api.py for the gradient formula)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ctopd_jax.kernels.token_rows import reference


def _layout(num_rows: int, chunk_rows: int):
    size = max(1, min(chunk_rows, max(num_rows, 1)))
    return size, num_rows // size, num_rows % size


@functools.lru_cache(maxsize=None)
def chunked(chunk_rows: int, inv_t: float):
    def forward(hidden, lm_head, targets):
        num_rows = hidden.shape[0]
        size, n_full, tail = _layout(num_rows, chunk_rows)

        def one(start, rows, carry):
            lp, lse = carry
            h = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)
            y = jax.lax.dynamic_slice_in_dim(targets, start, rows)
            c_lp, c_lse = reference.token_rows(h, lm_head, y, inv_t)
            return (jax.lax.dynamic_update_slice_in_dim(lp, c_lp, start, axis=0),
                    jax.lax.dynamic_update_slice_in_dim(lse, c_lse, start, axis=0))

        carry = (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows,), jnp.float32))
        if n_full:
            carry = jax.lax.fori_loop(0, n_full, lambda i, c: one(i * size, size, c), carry)
        if tail:
            carry = one(n_full * size, tail, carry)
        return carry

    def backward(hidden, lm_head, targets, lse, cot_lp, cot_lse):
        num_rows, hid = hidden.shape
        size, n_full, tail = _layout(num_rows, chunk_rows)
        cols = lm_head.shape[1]

        def one(start, rows, carry):
            g_hidden, g_head = carry
            h = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)
            y = jax.lax.dynamic_slice_in_dim(targets, start, rows)
            c_lse = jax.lax.dynamic_slice_in_dim(lse, start, rows)
            a = jax.lax.dynamic_slice_in_dim(cot_lp, start, rows)
            b = jax.lax.dynamic_slice_in_dim(cot_lse, start, rows)
            p = jnp.exp(reference.logits(h, lm_head, inv_t) - c_lse[:, None])
            onehot = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1) == y[:, None]
            dz = ((b - a)[:, None] * p + jnp.where(onehot, a[:, None], 0.0)) * inv_t
            dz = dz.astype(h.dtype)
            gh = jnp.dot(dz, lm_head.T.astype(h.dtype), preferred_element_type=jnp.float32)
            g_head = g_head + jnp.dot(h.T, dz, preferred_element_type=jnp.float32)
            return (jax.lax.dynamic_update_slice_in_dim(g_hidden, gh.astype(g_hidden.dtype),
                                                        start, axis=0), g_head)

        carry = (jnp.zeros_like(hidden), jnp.zeros((hid, cols), jnp.float32))
        if n_full:
            carry = jax.lax.fori_loop(0, n_full, lambda i, c: one(i * size, size, c), carry)
        if tail:
            carry = one(n_full * size, tail, carry)
        return carry[0], carry[1].astype(lm_head.dtype)

    @jax.custom_vjp
    def rows_fn(hidden, lm_head, targets):
        return forward(hidden, lm_head, targets)

    def fwd(hidden, lm_head, targets):
        lp, lse = forward(hidden, lm_head, targets)
        return (lp, lse), (hidden, lm_head, targets, lse)

    def bwd(res, cot):
        hidden, lm_head, targets, lse = res
        g_hidden, g_head = backward(hidden, lm_head, targets, lse, *cot)
        return g_hidden, g_head, None

    rows_fn.defvjp(fwd, bwd)
    return rows_fn
