"""Pallas chunk kernel for the strict top-k objective: selection, teacher gather, renormalised
divergence and its gradient into the k selected student logits, all inside the kernel.

Selection without sorting: k streaming passes over the row's vocabulary tiles, pass j picking
the best entry that comes strictly after pick j−1 in the order (logit descending, column
ascending). That order is exactly lax.top_k's (lower column first among equal logits; -0.0 and
+0.0 compare equal here, matching the canonicalisation in strict_topk.reference.select_topk).
Each pass carries the teacher logit of its winner, so the teacher row is "gathered" on the fly
with no dynamic indexing. Cost k·V∩ reads per row: meant for small k (16, 128).
Outputs per row: weighted loss, gradient [k] and the k column indices; the XLA side places the
gradient into the chunk's [c, V∩] layout (indices carry no gradient).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ctopd_jax.kernels import pallas_common as pc

BLOCK_ROWS = 8
BLOCK_COLS = 512
_NO_COL = jnp.iinfo(jnp.int32).max


def _kernel(zs_ref, zt_ref, w_ref, loss_ref, grad_ref, idx_ref, *, name, temperature, k,
            n_tiles, tile, kw):
    rows = zs_ref.shape[0]
    kcols = jax.lax.broadcasted_iota(jnp.int32, (rows, k), 1)

    def pick(j, carry):
        prev_v, prev_i, vals_s, vals_t, picks = carry

        def scan_tile(c, best):
            best_v, best_i, best_t = best
            s = zs_ref[:, pl.ds(c * tile, tile)].astype(jnp.float32)
            t = zt_ref[:, pl.ds(c * tile, tile)].astype(jnp.float32)
            cols = c * tile + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            after_prev = (s < prev_v[:, None]) | ((s == prev_v[:, None]) & (cols > prev_i[:, None]))
            tile_v = jnp.max(jnp.where(after_prev, s, -jnp.inf), axis=-1)
            hit = after_prev & (s == tile_v[:, None])
            tile_i = jnp.min(jnp.where(hit, cols, _NO_COL), axis=-1)
            tile_t = jnp.max(jnp.where(cols == tile_i[:, None], t, -jnp.inf), axis=-1)
            better = (tile_i != _NO_COL) & ((tile_v > best_v) | ((tile_v == best_v) &
                                                                 (tile_i < best_i)))
            return (jnp.where(better, tile_v, best_v), jnp.where(better, tile_i, best_i),
                    jnp.where(better, tile_t, best_t))

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.full((rows,), _NO_COL, jnp.int32),
                jnp.full((rows,), -jnp.inf, jnp.float32))
        v, i, t = jax.lax.fori_loop(0, n_tiles, scan_tile, init)
        at_j = kcols == j
        return (v, i, jnp.where(at_j, v[:, None], vals_s), jnp.where(at_j, t[:, None], vals_t),
                jnp.where(at_j, i[:, None], picks))

    init = (jnp.full((rows,), jnp.inf, jnp.float32), jnp.full((rows,), -1, jnp.int32),
            jnp.zeros((rows, k), jnp.float32), jnp.zeros((rows, k), jnp.float32),
            jnp.zeros((rows, k), jnp.int32))
    _, _, vals_s, vals_t, picks = jax.lax.fori_loop(0, k, pick, init)

    inv_t = 1.0 / temperature
    a = jax.nn.log_softmax(vals_s * inv_t, axis=-1)
    b = jax.nn.log_softmax(vals_t * inv_t, axis=-1)
    top_t = jnp.max(b, axis=-1)
    first_top = jnp.min(jnp.where(b == top_t[:, None], kcols, k), axis=-1)
    f, f_a = pc.terms_and_partials(name, a, b, kcols == first_top[:, None], **kw)
    w = w_ref[...].astype(jnp.float32)
    live = w != 0
    loss_ref[...] = jnp.where(live, w * jnp.where(live, jnp.sum(f, axis=-1), 0.0), 0.0)
    scale = jnp.where(live, w, 0.0) * inv_t
    g = scale[:, None] * (f_a - jnp.exp(a) * jnp.sum(f_a, axis=-1)[:, None])
    grad_ref[...] = jnp.where(live[:, None], g, 0.0)
    idx_ref[...] = picks


def strict_topk_rows(zs_bar, zt_bar, w, *, divergence, topk, temperature=1.0, jsd_beta=0.5,
                     skl_lambda=0.1, interpret=True, block_rows=BLOCK_ROWS,
                     block_cols=BLOCK_COLS):
    """(per-row weighted loss [c], gradient [c, k], column indices [c, k]) for projected rows."""
    rows = zs_bar.shape[0]
    zs, zt, wp, tile = pc.pad_blocks(zs_bar, zt_bar, w, block_rows, block_cols)
    rows_p, cols_p = zs.shape
    kernel = functools.partial(
        _kernel, name=divergence, temperature=float(temperature), k=topk, n_tiles=cols_p // tile,
        tile=tile, kw=dict(jsd_beta=jsd_beta, skl_lambda=skl_lambda))
    row_vec = pl.BlockSpec((block_rows,), lambda i: (i,))
    row_k = pl.BlockSpec((block_rows, topk), lambda i: (i, 0))
    row_block = pl.BlockSpec((block_rows, cols_p), lambda i: (i, 0))
    loss, grad, idx = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows_p,), jnp.float32),
                   jax.ShapeDtypeStruct((rows_p, topk), jnp.float32),
                   jax.ShapeDtypeStruct((rows_p, topk), jnp.int32)),
        grid=(rows_p // block_rows,),
        in_specs=[row_block, row_block, row_vec],
        out_specs=(row_vec, row_k, row_k),
        interpret=interpret,
        compiler_params=None if interpret else pc.gpu_compiler_params(),
        name=f"strict_topk_{divergence}",
    )(zs, zt, wp)
    return loss[:rows], grad[:rows], idx[:rows]


@functools.lru_cache(maxsize=None)
def make_chunk_fn(divergence: str, topk: int, temperature: float, div_items: tuple,
                  interpret: bool, block_cols: int = BLOCK_COLS):
    kw = dict(div_items)

    def chunk_fn(zs_bar, zt_bar, w):
        loss_rows, g_k, idx = strict_topk_rows(
            zs_bar, zt_bar, w, divergence=divergence, topk=topk, temperature=temperature,
            jsd_beta=kw["jsd_beta"], skl_lambda=kw["skl_lambda"], interpret=interpret,
            block_cols=block_cols)
        rows = jnp.arange(zs_bar.shape[0])[:, None]
        grad = jnp.zeros(zs_bar.shape, jnp.float32).at[rows, idx].set(g_k, unique_indices=True)
        return loss_rows, grad

    return chunk_fn
