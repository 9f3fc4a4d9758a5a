"""Realised-token log-prob and log-sum-exp of hidden rows over the full vocabulary (api.py).

reference.py: plain jnp autodiff over all rows (the oracle); xla.py: row chunks with a
recomputing backward. No Pallas kernel: `pallas` and `auto` run xla (measured.json says why).
"""
from ctopd_jax.kernels.token_rows.api import IMPLEMENTATIONS, token_rows  # noqa: F401  (entry point)
