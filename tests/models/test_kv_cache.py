"""Incremental decoding with the KV cache equals HF's full forward (left-padded prompts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import VARIANTS, hf_logits, save_hf
from ctopd_jax.models import init_cache, prefill_positions, weights

PROMPT_LENS = (5, 9, 3)
NEW_TOKENS = 5


def _jitted(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, positions, mask, cache):
        return nnx.merge(graphdef, state)(ids, positions, mask, cache=cache)

    @jax.jit
    def full(state, ids, positions, mask):
        return nnx.merge(graphdef, state)(ids, positions, mask)

    return (lambda *a: run(state, *a)), (lambda *a: full(state, *a))


@pytest.mark.parametrize("variant", ["llama_untied_llama3rope", "qwen2_tied_bias"])
def test_prefill_then_decode_matches_hf_full_forward(variant, tmp_path):
    cfg = VARIANTS[variant]()
    hf = save_hf(cfg, tmp_path)
    model, _ = weights.load_hf_checkpoint(tmp_path)
    step, full = _jitted(model)

    rng = np.random.RandomState(0)
    width = max(PROMPT_LENS)
    rows = [rng.randint(0, cfg.vocab_size, n + NEW_TOKENS) for n in PROMPT_LENS]
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for r, n in enumerate(PROMPT_LENS):  # left padding
        ids[r, width - n:] = rows[r][:n]
        mask[r, width - n:] = True

    cache = init_cache(cfg, len(rows), width + NEW_TOKENS + 2)
    pos = prefill_positions(jnp.asarray(mask))
    logits, cache = step(jnp.asarray(ids), pos, jnp.asarray(mask), cache)
    got = [np.asarray(logits[:, -1])]
    np.testing.assert_array_equal(np.asarray(cache.lengths), PROMPT_LENS)
    for j in range(NEW_TOKENS - 1):
        tok = np.array([[rows[r][n + j]] for r, n in enumerate(PROMPT_LENS)], np.int32)
        logits, cache = step(jnp.asarray(tok), cache.lengths[:, None],
                             jnp.ones((len(rows), 1), bool), cache)
        got.append(np.asarray(logits[:, 0]))
    assert int(cache.index) == width + NEW_TOKENS - 1

    for r, n in enumerate(PROMPT_LENS):
        ref = hf_logits(hf, rows[r][None])[0]
        for j in range(NEW_TOKENS):
            err = np.abs(got[j][r] - ref[n - 1 + j]).max()
            assert err <= 1e-4, f"row {r} step {j}: {err}"

    # The same sequences through our own full forward (left-padded, masked) agree as well.
    all_ids = np.concatenate([ids, np.array([rows[r][n:n + NEW_TOKENS - 1]
                                             for r, n in enumerate(PROMPT_LENS)])], axis=1)
    all_mask = np.concatenate([mask, np.ones((len(rows), NEW_TOKENS - 1), bool)], axis=1)
    full_logits = np.asarray(full(jnp.asarray(all_ids), prefill_positions(jnp.asarray(all_mask)),
                                  jnp.asarray(all_mask)))
    for j in range(NEW_TOKENS):
        np.testing.assert_allclose(got[j], full_logits[:, width - 1 + j], atol=1e-4)


def test_chunked_prefill_and_paused_rows(tmp_path):
    """Prefill in two chunks equals one; a row decoded with mask False does not advance and
    does not disturb the others."""
    cfg = VARIANTS["qwen2_untied_bias"]()
    hf = save_hf(cfg, tmp_path)
    model, _ = weights.load_hf_checkpoint(tmp_path)
    step, _ = _jitted(model)
    rng = np.random.RandomState(1)
    seqs = rng.randint(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    ones = jnp.ones((2, 4), bool)

    cache = init_cache(cfg, 2, 16)
    _, cache = step(jnp.asarray(seqs[:, :4]), jnp.broadcast_to(jnp.arange(4), (2, 4)), ones, cache)
    logits, cache = step(jnp.asarray(seqs[:, 4:8]), jnp.broadcast_to(jnp.arange(4, 8), (2, 4)),
                         ones, cache)
    ref = hf_logits(hf, seqs)
    np.testing.assert_allclose(np.asarray(logits), ref[:, 4:8], atol=1e-4)

    # Row 0 paused for one step (its token is a pad), row 1 advances.
    paused = jnp.array([[False], [True]])
    _, cache = step(jnp.asarray(seqs[:, 8:9]), cache.lengths[:, None], paused, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 9])
    logits, cache = step(jnp.asarray(np.array([[seqs[0, 8]], [seqs[1, 9]]], np.int32)),
                         cache.lengths[:, None], jnp.ones((2, 1), bool), cache)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref[0, 8], atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[1, 0]), ref[1, 9], atol=1e-4)
