"""Key/value cache for incremental decoding with the `Decoder`.

Two caches. ``KVCache`` is dense (rows x maximum length; the models' cache tests and the GPU
check's compile stage use it, and benchmarks/rollout_throughput.py's "dense" baseline, the
sampler as of 19a9239); the sampler decodes over ``PagedKVCache`` (below).

Contract of ``KVCache``:

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

``PagedKVCache`` is the sampler's cache (rollout/jax_sampler.py): one pool of fixed-size pages
shared by all rows, and a page table per row.

- ``k``, ``v``  one [Hkv, P, page, D] array per layer (tuples; kernels/paged_attention's
                                     layout, as vLLM keeps it): a layer's write and read touch
                                     its own buffer only, updated in place (compile-only memory
                                     in benchmarks/sampler_memory.py);
  ``page_table`` [B, maxp] int32    row b's token i lives in page ``page_table[b, i // page]``
                                     at offset ``i % page``; entries past the row's length
                                     only need to be in range;
  ``lengths`` [B] int32              tokens in each row's cache.
- A token's RoPE position is its index in its row: ``model(ids, positions, mask, cache=c)``
  writes token (b, t) at index ``positions[b, t]`` where ``mask`` is True (pads are not
  written), adds the row's real tokens to ``lengths`` and returns ``(logits, new_cache)``.
- T > 1 is a prefill of rows that start empty: the tokens attend to each other as in the
  no-cache forward (left padding, ``prefill_positions``). T = 1 is a decode step: the token
  attends to its row's first ``lengths`` tokens (after its own write) through the ragged
  paged attention (kernels/paged_attention), which reads only the valid pages.
- Which pages a row owns is the caller's business (the sampler's allocator); several rows
  may share pages (the prompt of the n samples of a prompt) as long as none writes to them.
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


class PagedKVCache(NamedTuple):
    k: tuple
    v: tuple
    page_table: jax.Array
    lengths: jax.Array
    write_at: jax.Array | None = None   # [B, T] set by the Decoder during a call (-1: pad)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def init_page_pool(cfg: ModelConfig, pages: int, page_size: int, dtype=None):
    """Empty (zero) K and V pools, per layer [Hkv, pages, page_size, D], in the compute dtype."""
    if pages <= 0 or page_size <= 0:
        raise ValueError(f"init_page_pool needs pages > 0 and page_size > 0, got {pages}, "
                         f"{page_size}")
    shape = (cfg.num_kv_heads, pages, page_size, cfg.head_dim)
    dtype = cfg.compute_dtype if dtype is None else dtype
    return (tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def page_pool_token_bytes(cfg: ModelConfig, dtype=None) -> int:
    """Bytes one cached token takes in the pool (K and V over every layer)."""
    itemsize = jnp.dtype(cfg.compute_dtype if dtype is None else dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


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
