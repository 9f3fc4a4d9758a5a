"""Pallas pieces shared by the strict kernels: tile streaming, padding, the backend and the
pallas call (tiles.py); the three loss and gradient passes (passes.py)."""
