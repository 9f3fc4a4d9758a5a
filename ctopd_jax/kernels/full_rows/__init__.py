"""Per-row statistics over the full vocabulary of several models, as constants (api.py).

One path: the chunked XLA map of api.row_stats over the statistics of statistics.py (no
gradient flows, so there is no custom VJP to fuse and no Pallas kernel; measured.json says
so). Tested through the objectives that use it (tests/algorithms: vopd, opd2, sage_opd).
"""
from ctopd_jax.kernels.full_rows.api import row_stats  # noqa: F401  (entry point)
from ctopd_jax.kernels.full_rows.statistics import (  # noqa: F401  (entry points)
    reverse_kl, top1_stats, topk_centres, topk_reverse_kl)
