"""The sampler's key/value cache for incremental decoding with the `Decoder`.

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

from ctopd_jax.models.config import ModelConfig


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
