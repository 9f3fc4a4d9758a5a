"""`decode_attention(..., implementation)`: one query token per row over a paged KV cache.

Implementations: "pallas" (GPU kernel, pallas.py; interpret mode on CPU), "xla" (xla.py, the
CPU path), "reference" (numpy, reference.py; tests only, not jit-able). "auto" takes the
choice of the table in measured.json for this device (pallas on a GPU, xla elsewhere; xla
where the installed jax lacks the op pallas.py wraps). All follow reference.py's contract.
"""
from __future__ import annotations

from ctopd_jax.kernels.choices import choose
from ctopd_jax.kernels.paged_attention import pallas, xla

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def resolve(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"paged attention must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if implementation == "auto":
        return choose("paged_attention") if pallas.AVAILABLE else "xla"
    return implementation


def decode_attention(q, k_pages, v_pages, page_table, lengths, implementation: str = "auto",
                     *, interpret: bool = False):
    """q [B, Hq, D]; k/v_pages [Hkv, P, page, D]; page_table [B, maxp]; lengths [B] -> [B, Hq, D]."""
    if resolve(implementation) == "pallas":
        return pallas.decode_attention(q, k_pages, v_pages, page_table, lengths,
                                       interpret=interpret)
    return xla.decode_attention(q, k_pages, v_pages, page_table, lengths)
