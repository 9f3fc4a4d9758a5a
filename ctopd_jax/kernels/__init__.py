"""Strict cross-tokenizer distillation kernels (SPEC §3–§5).

One folder per kernel (strict_full, strict_topk), each with reference.py (plain jnp oracle),
xla.py (memory-tuned chunk function for the row-chunk driver) and pallas.py. `api.py` picks the
implementation with an ordered fallback pallas -> xla -> reference.
"""
