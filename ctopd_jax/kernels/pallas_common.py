"""Pieces shared by the Pallas strict kernels: elementwise divergence terms, padding, backend.

Row math used by both kernels (kernels/row_terms.py). With a = log p_S and b = log p_T (τ applied), every divergence
except akl is a sum of elementwise terms f(a_v, b_v) (top1_ce: f is nonzero only at the
teacher's argmax column). Its gradient w.r.t. the student logits z is

    dL/dz_u = (1/τ) · (f_a(u) − p_S(u) · Σ_v f_a(v)),     f_a = ∂f/∂a elementwise,

so a kernel needs the two log-sum-exps (pass 1), Σ f and Σ f_a (pass 2) and then writes the
gradient (pass 3), streaming over vocabulary tiles: no [rows, V] temporaries besides the output.

Backend: interpret=True runs anywhere (CPU tests). On GPU the kernel is compiled by Mosaic GPU
(Hopper) by default; CTOPD_PALLAS_GPU_BACKEND=triton selects the (deprecated) Triton lowering
instead. Both are exercised by scripts/gpu_check.sh; neither has been run in this repository's
CI (CPU only).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ctopd_jax.kernels.row_terms import (  # noqa: F401  (re-exported)
    ELEMENTWISE_DIVERGENCES, elementwise_terms, terms_and_partials)

PALLAS_DIVERGENCES = ELEMENTWISE_DIVERGENCES


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_to(x, rows: int, cols: int, value):
    pad_r, pad_c = rows - x.shape[0], cols - x.shape[1]
    if pad_r == 0 and pad_c == 0:
        return x
    return jnp.pad(x, ((0, pad_r), (0, pad_c)), constant_values=value)


def pad_blocks(zs_bar, zt_bar, w, block_rows: int, block_cols: int):
    """Pad student/teacher rows [c, V∩] and weights [c] to whole row blocks and column tiles.

    Padding columns are -inf (no mass, after every real column, so top-k never picks one);
    padding rows get finite zeros so they stay NaN-free, and weight 0 so they add nothing.
    Returns (zs, zt, wp, tile).
    """
    rows, cols = zs_bar.shape
    tile = min(block_cols, round_up(cols, 16))
    cols_p, rows_p = round_up(cols, tile), round_up(max(rows, 1), block_rows)
    zs = pad_to(zs_bar.astype(jnp.float32), rows_p, cols_p, -jnp.inf)
    zt = pad_to(zt_bar.astype(jnp.float32), rows_p, cols_p, -jnp.inf)
    if rows_p > rows:
        pad_row = jnp.arange(rows_p)[:, None] >= rows
        zs = jnp.where(pad_row, 0.0, zs)
        zt = jnp.where(pad_row, 0.0, zt)
    wp = jnp.pad(w.astype(jnp.float32), (0, rows_p - rows))
    return zs, zt, wp, tile


def gpu_compiler_params():
    """Compiler parameters for a compiled (non-interpret) GPU pallas_call."""
    backend = os.environ.get("CTOPD_PALLAS_GPU_BACKEND", "mosaic").lower()
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    if backend != "mosaic":
        raise ValueError(f"CTOPD_PALLAS_GPU_BACKEND={backend!r}; use 'mosaic' or 'triton'")
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams()


def online_lse_update(m, s, tile):
    """One step of a streaming log-sum-exp over the last axis: (max, Σ exp(x − max))."""
    tile_max = jnp.max(tile, axis=-1)
    m_new = jnp.maximum(m, tile_max)
    shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # all -inf so far: avoid -inf - -inf
    s_new = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(tile - shift[:, None]), axis=-1)
    return m_new, s_new


def finish_lse(m, s):
    return jnp.where(jnp.isneginf(m), -jnp.inf, m + jnp.log(s))
