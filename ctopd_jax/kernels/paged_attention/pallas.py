"""Ragged paged decode attention as a Pallas GPU (Triton) kernel.

This is jax's own Pallas GPU paged-attention op (jax.experimental.pallas.ops.gpu.
paged_attention): one program per (kv head, block of 16 query heads of its group, split of
the page table); each program loops over its pages only up to the row's length, so a decode
step reads each row's valid pages and nothing else. This module adapts the project's layout
to it (page table padded to a multiple of the split count) and fixes its tiling: a compute
block of `pages_per_block` pages holds >= BLOCK_TOKENS tokens (both sizes, and why, in
measured.json). The op
does not scale the scores, so q is multiplied by 1/sqrt(head_dim) first (in float32, then
back to q's dtype: in bf16 that rounding differs from xla.py's scaling of the scores).
Interpret mode runs the same kernel on CPU (tests compare it with reference.py); it lowers to
a Triton custom call for CUDA (tests export it with `jax.export`). Not run on a GPU yet.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from ctopd_jax.kernels.choices import sizes

try:   # jax 0.12.1 removed this op from jax.experimental.pallas.ops.gpu
    from jax.experimental.pallas.ops.gpu import paged_attention as _jax_paged
except ImportError:
    _jax_paged = None
AVAILABLE = _jax_paged is not None
MISSING = "this jax has no jax.experimental.pallas.ops.gpu.paged_attention (removed in jax 0.12.1)"

K_SPLITS = sizes("paged_attention")["k_splits"]
BLOCK_TOKENS = sizes("paged_attention")["block_tokens"]


def decode_attention(q, k_pages, v_pages, page_table, lengths, *, interpret: bool = False):
    """Same contract as xla.decode_attention (zeros, up to eps, for a row of length 0)."""
    if not AVAILABLE:
        raise NotImplementedError(f"paged attention 'pallas': {MISSING}; use 'xla' or 'auto'")
    page, head_dim = k_pages.shape[2], k_pages.shape[3]
    q = (q.astype(jnp.float32) / math.sqrt(head_dim)).astype(q.dtype)
    pages_per_block = max(1, -(-BLOCK_TOKENS // page))
    multiple = K_SPLITS * pages_per_block
    width = -(-page_table.shape[1] // multiple) * multiple
    table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))
    return _jax_paged.paged_attention(
        q, k_pages, v_pages, table, lengths.astype(jnp.int32),
        pages_per_compute_block=pages_per_block, k_splits=K_SPLITS, interpret=interpret)
