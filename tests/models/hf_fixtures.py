"""Tiny random HF transformers models (the independent reference) saved to disk, no download."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from transformers import LlamaConfig, Qwen2Config

from hf_random import random_hf_model

from ctopd_jax.models.config import ModelConfig, tiny_llama, tiny_qwen2

# llama3 scaling bands chosen inside the frequency range of head_dim 32 / theta 10000 so the
# three regimes (kept, interpolated, divided) all occur; positions in tests go past orig.
_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 256}

VARIANTS = {
    "llama_untied_llama3rope": lambda: tiny_llama(rope_theta=10000.0, rope_scaling=_LLAMA3),
    "llama_tied": lambda: tiny_llama(tie_word_embeddings=True, rope_scaling=None),
    "qwen2_tied_bias": lambda: tiny_qwen2(),
    "qwen2_untied_bias": lambda: tiny_qwen2(tie_word_embeddings=False),
}


def hf_model(cfg: ModelConfig, seed: int = 0):
    """A random HF model for `cfg` (hf_random), with weights large enough that logits are O(1)."""
    config_cls = LlamaConfig if cfg.family == "llama" else Qwen2Config
    return random_hf_model(config_cls(**{**cfg.to_hf_dict(), "initializer_range": 0.08}), seed)


def save_hf(cfg: ModelConfig, directory, seed: int = 0, **save_kwargs):
    model = hf_model(cfg, seed)
    model.save_pretrained(directory, **save_kwargs)
    return model


def hf_logits(model, ids: np.ndarray, positions: np.ndarray | None = None,
              mask: np.ndarray | None = None) -> np.ndarray:
    kwargs = {}
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(mask), dtype=torch.long)
    with torch.no_grad():
        ids = torch.tensor(np.asarray(ids), dtype=torch.long)
        return model(ids, **kwargs).logits.float().numpy()


def with_options(model, **options):
    """The same parameters under a config with other execution options (attention,
    scan_layers, remat_policy, ...); the parameter tree does not depend on them."""
    from flax import nnx

    from ctopd_jax.models.decoder import Decoder

    other = nnx.eval_shape(lambda: Decoder(model.cfg.replace(**options), rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model))
    return other


def jax_logits(model, ids, positions=None, mask=None) -> np.ndarray:
    """Our model's float32 logits, run eagerly: op-by-op compilation is shared by all tiny
    variants, which on a loaded 2-core machine is cheaper than one jit per variant."""
    ids = jnp.asarray(ids, jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(ids, jnp.asarray(positions, jnp.int32), mask))


def paged_cache(cfg: ModelConfig, rows: int, max_len: int, page_size: int = 4):
    """An empty PagedKVCache (the sampler's) of `rows` rows of up to `max_len` tokens, each row
    owning its own consecutive pages."""
    from ctopd_jax.models.kv_cache import PagedKVCache, init_page_pool
    per_row = -(-max_len // page_size)
    k, v = init_page_pool(cfg, rows * per_row, page_size)
    table = np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    return PagedKVCache(k, v, jnp.asarray(table), jnp.zeros(rows, jnp.int32))
