"""The Decoder over a PagedKVCache: prefill + decode steps equal the no-cache forward."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.models import prefill_positions
from ctopd_jax.models.config import tiny_llama
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.models.kv_cache import PagedKVCache, init_page_pool


def test_prefill_then_decode_equals_the_full_forward():
    cfg = tiny_llama()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    lengths, width, page, new = [3, 9, 5], 9, 4, 6
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), bool)
    seqs = [list(rng.integers(1, 256, n + new)) for n in lengths]
    for r, n in enumerate(lengths):
        ids[r, width - n:], mask[r, width - n:] = seqs[r][:n], True   # left padding
    # Rows own shuffled pages; row 2's table points past its pages at page 0 (in range).
    perm = rng.permutation(16)
    table = np.stack([perm[0:5], perm[5:10], perm[10:15]]).astype(np.int32)
    call = nnx.jit(lambda m, *args: m(*args))
    k, v = init_page_pool(cfg, 16, page)
    cache = PagedKVCache(k, v, jnp.asarray(table), jnp.zeros(3, jnp.int32))
    logits, cache = call(model, jnp.asarray(ids), prefill_positions(jnp.asarray(mask)),
                          jnp.asarray(mask), cache)
    got = [logits[:, -1]]
    for t in range(new - 1):
        tok = jnp.asarray([s[n + t] for s, n in zip(seqs, lengths)], jnp.int32)[:, None]
        logits, cache = call(model, tok, cache.lengths[:, None], jnp.ones((3, 1), bool), cache)
        got.append(logits[:, -1])
    assert np.asarray(cache.lengths).tolist() == [n + new - 1 for n in lengths]
    # The oracle: one no-cache forward over the whole sequences, left padded.
    total = width + new - 1
    full_ids = np.zeros((3, total), np.int32)
    full_mask = np.zeros((3, total), bool)
    for r, n in enumerate(lengths):
        full_ids[r, total - n - new + 1:] = seqs[r][:n + new - 1]
        full_mask[r, total - n - new + 1:] = True
    full = call(model, jnp.asarray(full_ids), prefill_positions(jnp.asarray(full_mask)),
                jnp.asarray(full_mask))
    for r, n in enumerate(lengths):
        want = np.asarray(full[r, total - new:])
        np.testing.assert_allclose(np.stack([np.asarray(g[r]) for g in got]), want,
                                   atol=2e-5, rtol=1e-5)
