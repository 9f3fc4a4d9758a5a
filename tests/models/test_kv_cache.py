"""Incremental decoding over the sampler's paged KV cache equals HF's full forward (left-padded
prompts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import VARIANTS, hf_logits, paged_cache, save_hf
from ctopd_jax.models import prefill_positions, weights

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

    cache = paged_cache(cfg, len(rows), width + NEW_TOKENS + 2)
    pos = prefill_positions(jnp.asarray(mask))
    logits, cache = step(jnp.asarray(ids), pos, jnp.asarray(mask), cache)
    got = [np.asarray(logits[:, -1])]
    np.testing.assert_array_equal(np.asarray(cache.lengths), PROMPT_LENS)
    for j in range(NEW_TOKENS - 1):
        tok = np.array([[rows[r][n + j]] for r, n in enumerate(PROMPT_LENS)], np.int32)
        logits, cache = step(jnp.asarray(tok), cache.lengths[:, None],
                             jnp.ones((len(rows), 1), bool), cache)
        got.append(np.asarray(logits[:, 0]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.add(PROMPT_LENS, NEW_TOKENS - 1))

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
