"""Per-row full-vocabulary statistics from hidden rows: realised-token log-prob and logsumexp.

    token_rows(hidden [R, H], lm_head [H, V], targets [R]) -> (logprob [R], logsumexp [R])

with logits = hidden @ lm_head / τ over the FULL vocabulary (SPEC §6 span paths, the CE of
kd_ratio, MP-OPD's atom log-probs, OPD's sampled log-probs, the log-prob gap), float32.

Both outputs are differentiable with ANY per-row cotangent (a span loss squares a sum of
log-probs, so its cotangent differs per row). The "xla" path walks row chunks: the forward keeps
only the two [R] results, the backward recomputes each chunk's logits and forms

    dL/dz = (cot_lp · (onehot(y) − p) + cot_lse · p) / τ

then the hidden and lm_head gradients with two matmuls (the fused cross-entropy pattern). So no
[R, V] array exists at once. Matmuls run in the hidden states' dtype with float32 accumulation.
"reference" is plain jnp autodiff over all rows (the oracle); "pallas" has no kernel of its own
here and runs "xla".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("pallas", "xla", "reference")


def _chunk_logits(h, lm_head, inv_t):
    z = jnp.dot(h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
    return z * inv_t if inv_t != 1.0 else z


def _reference(hidden, lm_head, targets, inv_t):
    z = _chunk_logits(hidden, lm_head, inv_t)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - lse, lse


def _layout(num_rows: int, chunk_rows: int):
    size = max(1, min(chunk_rows, max(num_rows, 1)))
    return size, num_rows // size, num_rows % size


@functools.lru_cache(maxsize=None)
def _chunked(chunk_rows: int, inv_t: float):
    def forward(hidden, lm_head, targets):
        num_rows = hidden.shape[0]
        size, n_full, tail = _layout(num_rows, chunk_rows)

        def one(start, rows, carry):
            lp, lse = carry
            h = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)
            y = jax.lax.dynamic_slice_in_dim(targets, start, rows)
            c_lp, c_lse = _reference(h, lm_head, y, inv_t)
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
            p = jnp.exp(_chunk_logits(h, lm_head, inv_t) - c_lse[:, None])
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


def token_rows(hidden, lm_head, targets, *, temperature: float = 1.0, chunk_rows: int = 2048,
               implementation: str = "xla"):
    """(log p(target) [R], logsumexp [R]) of hidden @ lm_head / τ over the full vocabulary."""
    if implementation not in IMPLEMENTATIONS + ("auto",):   # no Pallas kernel here: auto is xla
        raise ValueError(f"implementation={implementation!r}; use auto or one of {IMPLEMENTATIONS}")
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"hidden [R, H] and lm_head [H, V] disagree: {hidden.shape}, {lm_head.shape}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [R={hidden.shape[0]}], got {targets.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1 (chunked_loss_size)")
    targets = targets.astype(jnp.int32)
    inv_t = 1.0 / float(temperature)
    if implementation == "reference":
        return _reference(hidden, lm_head, targets, inv_t)
    return _chunked(int(chunk_rows), inv_t)(hidden, lm_head, targets)
