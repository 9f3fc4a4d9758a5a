"""The numpy oracle of ragged paged decode attention (float64, one row and head at a time).

Row b's keys are its first `lengths[b]` cache tokens; token i of the row lives in page
`page_table[b, i // page_size]` at offset `i % page_size`. Query head h reads kv head
h // (num_q_heads // num_kv_heads). A row with length 0 outputs zeros.
"""
from __future__ import annotations

import numpy as np


def decode_attention(q, k_pages, v_pages, page_table, lengths) -> np.ndarray:
    """q [B, Hq, D]; k/v_pages [Hkv, P, page, D]; page_table [B, maxp]; lengths [B] -> [B, Hq, D]."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    b, hq, d = q.shape
    hkv, _, page, _ = k_pages.shape
    out = np.zeros((b, hq, d))
    for row in range(b):
        n = int(lengths[row])
        if n == 0:
            continue
        idx = np.arange(n)
        pages = np.asarray(page_table)[row, idx // page]
        for h in range(hq):
            kv = h // (hq // hkv)
            k = k_pages[kv, pages, idx % page]        # [n, D]
            v = v_pages[kv, pages, idx % page]
            s = k @ q[row, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[row, h] = (p / p.sum()) @ v
    return out
