"""Ragged paged decode attention in plain XLA (the CPU path; same semantics as reference.py).

One `fori_loop` step per page column j: every row gathers its page `page_table[:, j]` and
folds it into an online softmax (float32 statistics, probabilities cast to the value dtype
before the PV product, as models/attention.py does). The loop stops after the longest row's
last valid page, so a step reads max_b(lengths) tokens per row, not the table's capacity;
the Pallas kernel (pallas.py) goes further and reads each row's own valid pages only.
Rows shorter than the longest gather a page they mask out; their table entries past their
length only need to be in range (the sampler leaves them 0).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG = float(jnp.finfo(jnp.float32).min)


def decode_attention(q, k_pages, v_pages, page_table, lengths):
    """q [B, Hq, D]; k/v_pages [Hkv, P, page, D]; page_table [B, maxp] int32; lengths [B]
    int32 -> [B, Hq, D] in q's dtype (zeros for a row of length 0)."""
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    page_table, lengths = jnp.asarray(page_table, jnp.int32), jnp.asarray(lengths, jnp.int32)
    b, hq, d = q.shape
    hkv, _, page, _ = k_pages.shape
    q5 = q.reshape(b, hkv, hq // hkv, d)
    scale = 1.0 / math.sqrt(d)
    columns = jnp.minimum((jnp.max(lengths) + page - 1) // page, page_table.shape[1])

    def step(j, carry):
        m, l, acc = carry
        pages = page_table[:, j]
        k = jnp.swapaxes(k_pages[:, pages], 0, 1)          # [B, Hkv, page, D]
        v = jnp.swapaxes(v_pages[:, pages], 0, 1)
        s = jnp.einsum("bkgd,bksd->bkgs", q5, k, preferred_element_type=jnp.float32) * scale
        valid = (j * page + jnp.arange(page))[None, :] < lengths[:, None]   # [B, page]
        valid = valid[:, None, None, :]
        s = jnp.where(valid, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv

    g = hq // hkv
    init = (jnp.full((b, hkv, g), _NEG, jnp.float32), jnp.zeros((b, hkv, g), jnp.float32),
            jnp.zeros((b, hkv, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, columns, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(b, hq, d).astype(q.dtype)
