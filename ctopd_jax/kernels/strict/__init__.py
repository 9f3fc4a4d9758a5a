"""The strict objective's kernels (SPEC §3–§5): one entry point for the strict full and strict
top-k kernels (api.py: validation, the implementation choice, the ordered fallback pallas ->
xla -> reference), the row-chunked custom-VJP driver both the xla and pallas paths run under
(row_chunks.py) and the divergences as elementwise terms (row_terms.py). Each kernel's
reference, xla and pallas code and its table live in kernels/strict_full/ and
kernels/strict_topk/."""
