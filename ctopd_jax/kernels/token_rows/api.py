"""Per-row full-vocabulary statistics from hidden rows: realised-token log-prob and logsumexp.

    token_rows(hidden [R, H], lm_head [H, V], targets [R]) -> (logprob [R], logsumexp [R])

with logits = hidden @ lm_head / τ over the FULL vocabulary (SPEC §6 span paths, the CE of
kd_ratio, MP-OPD's atom log-probs, OPD's sampled log-probs, the log-prob gap), float32.

Both outputs are differentiable with ANY per-row cotangent (a span loss squares a sum of
log-probs, so its cotangent differs per row). The "xla" path walks row chunks: the forward keeps
only the two [R] results, the backward recomputes each chunk's logits and forms

    dL/dz = (cot_lp · (onehot(y) − p) + cot_lse · p) / τ

then the hidden and lm_head gradients with two matmuls (the fused cross-entropy pattern). So no
[R, V] array exists at once. Matmuls run in the hidden states' dtype with float32 accumulation.
"reference" (reference.py) is plain jnp autodiff over all rows (the oracle); the "xla" path is
xla.py; "pallas" has no kernel of its own here and runs "xla" (measured.json).
"""
from __future__ import annotations

import jax.numpy as jnp

from ctopd_jax.kernels.choices import choose
from ctopd_jax.kernels.token_rows import reference, xla

IMPLEMENTATIONS = ("pallas", "xla", "reference")


def token_rows(hidden, lm_head, targets, *, temperature: float = 1.0, chunk_rows: int = 2048,
               implementation: str = "xla"):
    """(log p(target) [R], logsumexp [R]) of hidden @ lm_head / τ over the full vocabulary."""
    if implementation == "auto":   # measured.json: xla (there is no Pallas kernel here)
        implementation = choose("token_rows")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; use auto or one of {IMPLEMENTATIONS}")
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"hidden [R, H] and lm_head [H, V] disagree: {hidden.shape}, {lm_head.shape}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [R={hidden.shape[0]}], got {targets.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1 (chunked_loss_size)")
    targets = targets.astype(jnp.int32)
    inv_t = 1.0 / float(temperature)
    if implementation == "reference":
        return reference.token_rows(hidden, lm_head, targets, inv_t)
    return xla.chunked(int(chunk_rows), inv_t)(hidden, lm_head, targets)
