"""XLA chunk function for the strict full objective (used by kernels.row_chunks).

Per chunk: float32 log-softmax of both projected rows, the divergence, and its gradient via
jax.vjp inside the chunk, so the gradient is produced while the chunk is in cache and nothing of
size [R, V∩] outlives the chunk. Generic over every divergence of losses.DIVERGENCES.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ctopd_jax import losses


@functools.lru_cache(maxsize=None)
def make_chunk_fn(divergence: str, temperature: float, div_items: tuple):
    div_kwargs = dict(div_items)

    def chunk_fn(zs_bar, zt_bar, w):
        log_pt = jax.lax.stop_gradient(losses.log_softmax_f32(zt_bar, temperature))

        def loss_of(zs):
            log_ps = losses.log_softmax_f32(zs, temperature)
            per_row = losses.divergence_from_logprobs(divergence, log_ps, log_pt, **div_kwargs)
            return losses.masked_sum(per_row, w)

        loss, vjp = jax.vjp(loss_of, zs_bar)
        (grad,) = vjp(jnp.ones((), jnp.float32))
        return loss, grad

    return chunk_fn
