"""Pallas chunk kernel for the strict full objective: divergence and its gradient in 3 passes
over vocabulary tiles per block of rows (see kernels/pallas_common.py for the math).

Grid: one program per block of `BLOCK_ROWS` rows. Columns are padded to a multiple of the tile
with -inf on both sides (probability 0 there, so padding changes nothing); padded rows get
weight 0. The XLA side (kernels.row_chunks) gathers the shared columns of a row chunk before
calling this and puts the gradient back into student layout after.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ctopd_jax.kernels import pallas_common as pc

BLOCK_ROWS = 8
BLOCK_COLS = 512


def _kernel(zs_ref, zt_ref, w_ref, loss_ref, grad_ref, *, name, temperature, top1, n_tiles,
            tile, kw):
    rows = zs_ref.shape[0]
    inv_t = 1.0 / temperature

    def load(ref, j):
        return ref[:, pl.ds(j * tile, tile)].astype(jnp.float32) * inv_t

    # pass 1: log-sum-exp of both rows (+ teacher argmax, lowest column among ties, for top1_ce)
    def stats(j, carry):
        ms, ss, mt, st, best_v, best_i = carry
        s, t = load(zs_ref, j), load(zt_ref, j)
        ms, ss = pc.online_lse_update(ms, ss, s)
        mt, st = pc.online_lse_update(mt, st, t)
        if top1:
            cols = j * tile + jax.lax.broadcasted_iota(jnp.int32, t.shape, 1)
            t_max = jnp.max(t, axis=-1)
            t_arg = jnp.min(jnp.where(t == t_max[:, None], cols, jnp.iinfo(jnp.int32).max), -1)
            better = t_max > best_v
            best_v, best_i = jnp.where(better, t_max, best_v), jnp.where(better, t_arg, best_i)
        return ms, ss, mt, st, best_v, best_i

    neg = jnp.full((rows,), -jnp.inf, jnp.float32)
    zero = jnp.zeros((rows,), jnp.float32)
    ms, ss, mt, st, _, top_col = jax.lax.fori_loop(
        0, n_tiles, stats, (neg, zero, neg, zero, neg, jnp.zeros((rows,), jnp.int32)))
    lse_s, lse_t = pc.finish_lse(ms, ss), pc.finish_lse(mt, st)

    def tile_terms(j):
        a = load(zs_ref, j) - lse_s[:, None]
        b = load(zt_ref, j) - lse_t[:, None]
        cols = j * tile + jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
        f, f_a = pc.terms_and_partials(name, a, b, cols == top_col[:, None], **kw)
        return a, f, f_a

    # pass 2: Σ f (the loss) and Σ f_a (needed by the gradient of the log-softmax)
    def sums(j, carry):
        _, f, f_a = tile_terms(j)
        return carry[0] + jnp.sum(f, axis=-1), carry[1] + jnp.sum(f_a, axis=-1)

    loss, fa_sum = jax.lax.fori_loop(0, n_tiles, sums, (zero, zero))
    w = w_ref[...].astype(jnp.float32)
    live = w != 0
    loss_ref[...] = jnp.where(live, w * jnp.where(live, loss, 0.0), 0.0)
    scale = jnp.where(live, w, 0.0) * inv_t

    # pass 3: dL/dz = (w/τ)(f_a − p_S Σ f_a)
    def write(j, carry):
        a, _, f_a = tile_terms(j)
        g = scale[:, None] * (f_a - jnp.exp(a) * fa_sum[:, None])
        grad_ref[:, pl.ds(j * tile, tile)] = jnp.where(live[:, None], g, 0.0)
        return carry

    jax.lax.fori_loop(0, n_tiles, write, 0)


def strict_full_rows(zs_bar, zt_bar, w, *, divergence, temperature=1.0, jsd_beta=0.5,
                     skl_lambda=0.1, interpret=True, block_rows=BLOCK_ROWS,
                     block_cols=BLOCK_COLS):
    """(per-row weighted loss [c], gradient [c, V∩]) for projected rows, via one pallas_call."""
    rows, cols = zs_bar.shape
    zs, zt, wp, tile = pc.pad_blocks(zs_bar, zt_bar, w, block_rows, block_cols)
    rows_p, cols_p = zs.shape
    kernel = functools.partial(
        _kernel, name=divergence, temperature=float(temperature), top1=divergence == "top1_ce",
        n_tiles=cols_p // tile, tile=tile, kw=dict(jsd_beta=jsd_beta, skl_lambda=skl_lambda))
    row_block = pl.BlockSpec((block_rows, cols_p), lambda i: (i, 0))
    loss, grad = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows_p,), jnp.float32),
                   jax.ShapeDtypeStruct((rows_p, cols_p), jnp.float32)),
        grid=(rows_p // block_rows,),
        in_specs=[row_block, row_block, pl.BlockSpec((block_rows,), lambda i: (i,))],
        out_specs=(pl.BlockSpec((block_rows,), lambda i: (i,)), row_block),
        interpret=interpret,
        compiler_params=None if interpret else pc.gpu_compiler_params(),
        name=f"strict_full_{divergence}",
    )(zs, zt, wp)
    return loss[:rows], grad[:rows, :cols]


@functools.lru_cache(maxsize=None)
def make_chunk_fn(divergence: str, temperature: float, div_items: tuple, interpret: bool,
                  block_cols: int = BLOCK_COLS):
    kw = dict(div_items)

    def chunk_fn(zs_bar, zt_bar, w):
        loss_rows, grad = strict_full_rows(zs_bar, zt_bar, w, divergence=divergence,
                                           temperature=temperature, jsd_beta=kw["jsd_beta"],
                                           skl_lambda=kw["skl_lambda"], interpret=interpret,
                                           block_cols=block_cols)
        return jnp.sum(loss_rows), grad

    return chunk_fn
