"""XLA chunk function for the strict full objective (used by kernels/strict/row_chunks.py).

Elementwise divergences (all but akl) use the closed-form row gradient of
kernels/strict/row_terms.py:
two log-sum-exps, Σ f and Σ f_a, then (w/τ)(f_a − p_S Σ f_a). That is a few fused streaming
passes over the chunk instead of the many [c, V∩] temporaries that reverse-mode autodiff of the
log-softmax keeps alive; kl and rkl (the paper's choice) use their simplified closed forms
(p_S − p_T and p_S(a − b − RKL)). akl (a sort of p_T per row) uses jax.vjp inside the chunk.
Either way the gradient is produced while the chunk is in cache and nothing of size [R, V∩]
outlives the chunk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import losses
from ctopd_jax.kernels.strict import row_terms


def autodiff_chunk(divergence, temperature, div_kwargs):
    """(weighted per-row losses, d Σ / d zs_bar) of the divergence on whole rows, by autodiff."""
    def chunk_fn(zs_bar, zt_bar, w):
        log_pt = jax.lax.stop_gradient(losses.log_softmax_f32(zt_bar, temperature))

        def rows_of(zs):
            log_ps = losses.log_softmax_f32(zs, temperature)
            per_row = losses.divergence_from_logprobs(divergence, log_ps, log_pt, **div_kwargs)
            return losses.masked_rows(per_row, w)

        rows, vjp = jax.vjp(rows_of, zs_bar)
        (grad,) = vjp(jnp.ones_like(rows))
        return rows, grad

    return chunk_fn


def _closed_form_chunk(divergence, temperature, div_kwargs):
    kw = dict(jsd_beta=div_kwargs["jsd_beta"], skl_lambda=div_kwargs["skl_lambda"])
    inv_t = 1.0 / temperature

    def chunk_fn(zs_bar, zt_bar, w):
        s = zs_bar.astype(jnp.float32) * inv_t
        t = zt_bar.astype(jnp.float32) * inv_t
        a = s - jax.nn.logsumexp(s, axis=-1, keepdims=True)
        b = t - jax.nn.logsumexp(t, axis=-1, keepdims=True)
        is_top = None
        if divergence == "top1_ce":  # argmax takes the lowest column among ties
            cols = jax.lax.broadcasted_iota(jnp.int32, t.shape, 1)
            is_top = cols == jnp.argmax(t, axis=-1)[:, None]
        live = w != 0
        scale = (jnp.where(live, w, 0.0) * inv_t)[:, None]
        if divergence == "rkl":  # Σ f_a = RKL + 1, so the gradient is p_S (a − b − RKL)
            p = jnp.exp(a)
            support = p > 0
            d = jnp.where(support, a - jnp.where(support, b, 0.0), 0.0)
            row = jnp.sum(p * d, axis=-1, keepdims=True)
            loss, grad = losses.masked_rows(row[:, 0], w), scale * p * (d - row)
        elif divergence == "kl":  # Σ f_a = −1, so the gradient is p_S − p_T
            pt = jnp.exp(b)
            support = pt > 0
            terms = jnp.where(support, pt * (b - jnp.where(support, a, 0.0)), 0.0)
            loss, grad = losses.masked_rows(jnp.sum(terms, -1), w), scale * (jnp.exp(a) - pt)
        else:
            f, f_a = row_terms.terms_and_partials(divergence, a, b, is_top, **kw)
            loss = losses.masked_rows(jnp.sum(f, axis=-1), w)
            grad = scale * (f_a - jnp.exp(a) * jnp.sum(f_a, axis=-1, keepdims=True))
        return loss, jnp.where(live[:, None], grad, 0.0)

    return chunk_fn


@functools.lru_cache(maxsize=None)
def make_chunk_fn(divergence: str, temperature: float, div_items: tuple):
    div_kwargs = dict(div_items)
    if divergence in row_terms.ELEMENTWISE_DIVERGENCES:
        return _closed_form_chunk(divergence, temperature, div_kwargs)
    return autodiff_chunk(divergence, temperature, div_kwargs)
