"""The oracle of token_rows: plain jnp over all rows ([R, V] logits at once), autodiff backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def logits(h, lm_head, inv_t):
    z = jnp.dot(h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
    return z * inv_t if inv_t != 1.0 else z


def token_rows(hidden, lm_head, targets, inv_t):
    z = logits(hidden, lm_head, inv_t)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - lse, lse
