"""Pallas chunk kernel for the strict full objective: divergence and its gradient in 3 streaming
passes over vocabulary tiles per block of rows, 2 for kl and rkl (math and tiling:
kernels/pallas_shared/; what bounds its speed: README.md in this folder).

Grid: one program per block of BLOCK_ROWS rows; each pass streams [BLOCK_ROWS, tile] tiles, so
shared memory does not grow with V∩. Columns are padded to a multiple of the tile with -inf on
both sides (probability 0 there, so padding changes nothing); padded rows get weight 0. The XLA
side (kernels/strict/row_chunks.py) gathers the shared columns of a row chunk before calling
this and puts the gradient back into student layout after.
"""
from __future__ import annotations

import functools

from ctopd_jax.kernels.choices import sizes
from ctopd_jax.kernels.pallas_shared import passes
from ctopd_jax.kernels.pallas_shared import tiles as pt

BLOCK_ROWS = sizes("strict_full")["block_rows"]   # the table's tuned sizes (measured.json)
BLOCK_COLS = sizes("strict_full")["block_cols"]


def strict_full_rows(zs_bar, zt_bar, w, *, divergence, temperature=1.0, jsd_beta=0.5,
                     skl_lambda=0.1, interpret=True, block_rows=BLOCK_ROWS,
                     block_cols=BLOCK_COLS, mode=None):
    """(per-row weighted loss [c], gradient [c, V∩]) for projected rows, via one Pallas kernel."""
    if divergence not in passes.PALLAS_DIVERGENCES:
        raise ValueError(f"divergence {divergence!r} has no Pallas kernel")
    rows, cols = zs_bar.shape
    loss, grad = passes.divergence_rows(
        zs_bar, zt_bar, w, divergence=divergence, temperature=temperature,
        kw=dict(jsd_beta=jsd_beta, skl_lambda=skl_lambda), interpret=interpret,
        block_rows=block_rows, block_cols=block_cols, mode=mode, name=f"strict_full_{divergence}")
    return loss[:rows], grad[:rows, :cols]


def make_chunk_fn(divergence: str, temperature: float, div_items: tuple, interpret: bool,
                  block_cols: int = BLOCK_COLS):
    """chunk_fn(zs_bar [c, V∩], zt_bar [c, V∩], w [c]) -> (w_r·D_r [c], gradient [c, V∩]).

    One function object per kernel mode (interpret / mosaic / triton, read from the
    environment now), so jit caches never hand a kernel of one backend to another.
    """
    return _make_chunk_fn(divergence, temperature, div_items, pt.kernel_mode(interpret),
                          block_cols)


@functools.lru_cache(maxsize=None)
def _make_chunk_fn(divergence, temperature, div_items, mode, block_cols):
    kw = dict(div_items)

    def chunk_fn(zs_bar, zt_bar, w):
        return strict_full_rows(zs_bar, zt_bar, w, divergence=divergence,
                                temperature=temperature, jsd_beta=kw["jsd_beta"],
                                skl_lambda=kw["skl_lambda"], mode=mode,
                                block_cols=block_cols)

    return chunk_fn
