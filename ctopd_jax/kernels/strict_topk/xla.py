"""XLA chunk function for the strict top-k objective (used by kernels/strict/row_chunks.py).

Per chunk: lax.top_k on the student's projected rows (lower column first among ties), teacher
gathered at the same columns, divergence on the k entries, gradient into the k selected student
logits only (placed back into the chunk's [c, V∩] layout with one small scatter). From hidden
states the driver uses the function's `topk` and `on_k_columns` directly and never forms the
teacher's [c, V∩] logits or that dense gradient (row_chunks.py).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from ctopd_jax.kernels.strict_full.xla import autodiff_chunk
from ctopd_jax.kernels.strict_topk.reference import select_topk


@functools.lru_cache(maxsize=None)
def make_chunk_fn(divergence: str, topk: int, temperature: float, div_items: tuple):
    div_kwargs = dict(div_items)
    on_k_columns = autodiff_chunk(divergence, temperature, div_kwargs)

    def chunk_fn(zs_bar, zt_bar, w):
        vals, idx = select_topk(zs_bar, topk)
        zt_k = jnp.take_along_axis(zt_bar, idx, axis=1)
        loss, g_k = on_k_columns(vals, zt_k, w)
        rows = jnp.arange(zs_bar.shape[0])[:, None]
        grad = jnp.zeros_like(zs_bar).at[rows, idx].set(g_k, unique_indices=True)
        return loss, grad

    # what the hidden-state driver reads instead of calling chunk_fn (row_chunks: the teacher's
    # logits and the gradient at the k selected columns only)
    chunk_fn.topk, chunk_fn.on_k_columns = topk, on_k_columns
    return chunk_fn
