"""Key/value cache for incremental decoding with the `Decoder`.

Contract (the rollout sampler is built on it):

- ``KVCache`` is a pytree (NamedTuple of arrays) that goes in and out of ``jax.jit``:
    ``k``, ``v``   [L, B, S, Hkv, D]  keys (already RoPE-rotated) and values per layer;
    ``valid``      [B, S] bool        True where a slot holds a real (non-pad) token;
    ``lengths``    [B] int32          real tokens stored per row, i.e. the RoPE position the
                                      next real token of that row should get when the prompt
                                      starts at position 0;
    ``index``      [] int32           the next slot to write; shared by all rows.
- ``model(ids[B,T], positions[B,T], attention_mask[B,T], cache=c)`` writes the T new tokens into
  slots ``[c.index, c.index + T)`` of every row, marks those slots valid where
  ``attention_mask`` is True, adds the per-row count of real tokens to ``lengths``, advances
  ``index`` by T and returns ``(logits, new_cache)``.  Each query attends to valid slots at or
  before its own slot, so pads (left or right, in the prompt or mid-way) are never attended to.
- Prefill a left-padded batch in one call with ``positions = max(cumsum(mask) - 1, 0)``; then
  decode one token per call with ``positions = cache.lengths[:, None]`` and an all-True mask
  (or False for rows that already finished, so they stop growing).
- The caller keeps ``index + T <= S`` (``max_len``).  It cannot be checked inside jit; writes
  past the end would be clamped by ``dynamic_update_slice`` and overwrite the last slots.
- Attention always spans all S slots (static shapes, one compiled decode step); the cost per
  step is O(S), which is what a fixed-size cache buys.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ctopd_jax.models.attention import segment_starts
from ctopd_jax.models.config import DTYPES, ModelConfig


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    lengths: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for ``batch`` rows of at most ``max_len`` tokens (prompt + generated).

    ``dtype`` defaults to the model's compute dtype; it may be a jnp dtype or its name.
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs batch > 0 and max_len > 0, got {batch}, {max_len}")
    if dtype is None:
        dtype = cfg.compute_dtype
    elif isinstance(dtype, str):
        dtype = DTYPES[dtype]
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch, max_len), jnp.bool_),
        lengths=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def prefill_positions(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions for a (left- or right-) padded prompt batch: 0, 1, ... over real tokens.
    An integer mask holds packed rows' segment ids (contiguous runs, 0 on pads): positions
    restart at 0 where each segment starts."""
    if attention_mask.dtype == jnp.bool_:
        return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    seg = attention_mask.astype(jnp.int32)
    slot = jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
    return jnp.where(seg > 0, slot - segment_starts(seg), 0)
