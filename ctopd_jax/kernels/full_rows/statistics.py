"""The per-chunk statistics `row_stats` computes (each a `fn(log_probs) -> [c, K]`; see api.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _kl(a, b):
    """Σ_v e^{a_v} (a_v − b_v) per row, with 0·log 0 = 0."""
    p = jnp.exp(a)
    return jnp.sum(jnp.where(p > 0, p * (a - b), 0.0), axis=-1)


def reverse_kl(log_probs):
    """[c, 1]: KL(p_0 ‖ p_1)."""
    return _kl(log_probs[0], log_probs[1])[:, None]


def _topk_renormalised(log_probs, k):
    """The top-k columns of model 0 and every model's log-probs renormalised on them."""
    _, idx = jax.lax.top_k(log_probs[0], k)
    picked = [jnp.take_along_axis(lp, idx, axis=-1) for lp in log_probs]
    return [lp - jax.nn.logsumexp(lp, axis=-1, keepdims=True) for lp in picked]


def topk_reverse_kl(k: int):
    def fn(log_probs):
        a, b = _topk_renormalised(log_probs[:2], k)
        return _kl(a, b)[:, None]
    return fn


def topk_centres(k: int):
    """[c, 2]: E_{p̃_S}[log p_T − log p_S], E_{p̃_S}[log p_T − log p_B] over the student's top-k
    (p̃_S renormalised on the k columns; the log-probs themselves are the full-vocabulary ones)."""
    def fn(log_probs):
        s, t, b = log_probs
        _, idx = jax.lax.top_k(s, k)
        s_k, t_k, b_k = (jnp.take_along_axis(lp, idx, axis=-1) for lp in (s, t, b))
        q = jax.nn.softmax(s_k, axis=-1)
        return jnp.stack([jnp.sum(q * (t_k - s_k), -1), jnp.sum(q * (t_k - b_k), -1)], axis=-1)
    return fn


def top1_stats(log_probs):
    """[c, 2]: model 1's top-1 probability, and 1 where models 0 and 1 have the same argmax
    (SAGE-OPD's confidence and its proxy judge's agreement; models = student, teacher)."""
    s, t = log_probs
    agree = (jnp.argmax(s, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32)
    return jnp.stack([jnp.exp(jnp.max(t, axis=-1)), agree], axis=-1)
