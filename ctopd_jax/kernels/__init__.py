"""The kernels: one folder per kernel, each with its api (entry point), reference.py (the
oracle), xla.py, pallas.py where it has a Pallas kernel, and measured.json (its tuned sizes and
the implementation `auto` picks per device; kernels/choices.py reads it).

    strict_full/, strict_topk/  strict cross-tokenizer distillation (SPEC §3–§5); their shared
                                entry point, row-chunk driver and row terms are in strict/
    token_rows/                 realised-token log-prob and log-sum-exp over the full vocabulary
    full_rows/                  per-row full-vocabulary statistics of several models (constants)
    paged_attention/            ragged decode attention over a paged KV cache
    pallas_shared/              the Pallas helpers the strict kernels share (tiles, passes)

`python -m ctopd_jax.kernels RESULT.json` writes a GPU check's measured rows into the tables.
"""
from ctopd_jax.kernels.strict.api import (  # noqa: F401  (the strict objective's entry points)
    gather_rows, strict_kd_rows, strict_kd_sum)
