"""Per-row statistics over the FULL vocabulary of several models, chunk by chunk, as constants.

    row_stats(fn, models=((hidden [R, H_m], lm_head [H_m, V]), ...), temperature, chunk_rows)
        -> [R, K] float32, stop_gradient

`fn(log_probs)` receives one chunk's log-softmax rows of every model ([c, V] float32 each, the
logits divided by τ) and returns [c, K] statistics of each row. The rows are walked in chunks
of `chunk_rows` with `lax.map`, so only [chunk_rows, V] log-prob blocks exist at once, never
[R, V]. No gradient flows (the OPD family's advantages, baselines and centring terms are
constants by SPEC §9); the trainable full-vocabulary divergences (`opd_full`, GKD) go through
`kernels.strict_kd_rows` with s_ids = t_ids = arange(V), which has the recomputing
(chunked) gradient.

Statistics provided (statistics.py, each a `fn`):
- `reverse_kl`: KL(p_0 ‖ p_1) per row (vOPD's exact baseline, KL_t of SPEC §9);
- `topk_reverse_kl(k)`: the same on the top-k columns of p_0, both rows renormalised there
  (vOPD's top-k baseline);
- `topk_centres(k)`: OPD²'s E_{p̃_S}[log p_T − log p_S] and E_{p̃_S}[log p_T − log p_B] over
  the top-k columns of p_S (models = student, teacher, base), p̃_S renormalised there;
- `top1_stats`: the teacher's top-1 probability and student/teacher argmax agreement (SAGE-OPD).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def _log_probs(h, w, inv_t):
    z = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if inv_t != 1.0:
        z = z * inv_t
    return jax.nn.log_softmax(z, axis=-1)


def row_stats(fn: Callable, models: Sequence[tuple], *, temperature: float = 1.0,
              chunk_rows: int = 2048):
    """[R, K] constants: `fn` of each chunk's full-vocabulary log-probs of every model."""
    if not models:
        raise ValueError("row_stats: give at least one (hidden, lm_head) pair")
    rows = models[0][0].shape[0]
    vocab = models[0][1].shape[1]
    for i, (h, w) in enumerate(models):
        if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[0]:
            raise ValueError(f"models[{i}]: hidden [R, H] and lm_head [H, V] disagree: {h.shape}, {w.shape}")
        if h.shape[0] != rows or w.shape[1] != vocab:
            raise ValueError(f"models[{i}]: every model needs R={rows} rows and V={vocab} columns "
                             f"(one shared vocabulary); got {h.shape[0]} rows, {w.shape[1]} columns")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1 (chunked_loss_size)")
    inv_t = 1.0 / float(temperature)
    hidden = [jax.lax.stop_gradient(h) for h, _ in models]
    heads = [jax.lax.stop_gradient(w) for _, w in models]
    size = max(1, min(int(chunk_rows), rows))
    n = -(-rows // size) if rows else 0
    pad = n * size - rows
    blocks = [jnp.pad(h, ((0, pad), (0, 0))).reshape(n, size, h.shape[1]) for h in hidden]

    def one(chunk):
        return fn([_log_probs(h, w, inv_t) for h, w in zip(chunk, heads)])

    out = jax.lax.map(one, blocks)            # [n, size, K]
    return jax.lax.stop_gradient(out.reshape(n * size, -1)[:rows])
