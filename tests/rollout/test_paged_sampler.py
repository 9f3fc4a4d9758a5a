"""The paged sampler against an independent oracle, and its page pool's rules.

The oracle decodes each sample by running the model without any cache on the prompt plus the
tokens so far (the whole sequence every step) and picking the token with the sampling
contract (rollout/sampling.py: keys from (seed, sample index, step)). It shares nothing with
the sampler's cache, page tables, slots or attention kernels.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ctopd_jax.models.config import tiny_llama
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.rollout import sampling
from ctopd_jax.rollout.base import SamplingParams
from ctopd_jax.models.kv_cache import page_pool_token_bytes
from ctopd_jax.rollout.jax_sampler import JaxSampler, slot_buffer_bytes
from ctopd_jax.rollout.paged_decode import decode_weights

NEW = 10


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_llama(), rngs=nnx.Rngs(0))


def _prompts(count, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 256, rng.integers(2, 23))] for _ in range(count)]


@nnx.jit
def _last_logits(model, ids, mask):
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return model(ids, positions, mask)[:, -1]


def oracle(model, prompts, params, eos):
    """Per sample (prompt-major, n each): tokens and raw log-probs, recomputed from scratch."""
    samples = [p for p in prompts for _ in range(params.n)]
    width = max(map(len, samples)) + params.max_new_tokens
    seqs = [list(p) for p in samples]
    out = [([], []) for _ in samples]
    alive = np.ones(len(samples), bool)
    for step in range(params.max_new_tokens):
        ids = np.zeros((len(samples), width), np.int32)
        mask = np.zeros((len(samples), width), bool)
        for i, s in enumerate(seqs):   # left padded to a fixed width: one compiled program
            ids[i, width - len(s):], mask[i, width - len(s):] = s, True
        logits = _last_logits(model, jnp.asarray(ids), jnp.asarray(mask))
        keys = None if params.greedy else sampling.sample_keys(
            params.seed, jnp.arange(len(samples)), step)
        tok, lp = sampling.sample_tokens(keys, logits, params.temperature or 1.0,
                                         params.top_k, params.top_p, greedy=params.greedy)
        for i in np.nonzero(alive)[0]:
            out[i][0].append(int(tok[i]))
            out[i][1].append(float(lp[i]))
            seqs[i].append(int(tok[i]))
            if int(tok[i]) in eos:
                alive[i] = False
    return out


PARAMS = {"greedy": SamplingParams(temperature=0.0, max_new_tokens=NEW),
          "seeded": SamplingParams(temperature=1.0, top_k=50, max_new_tokens=NEW, seed=5)}


def _slow_but(*quick):
    """(n, mode, EOS, slots), every combination but `quick` marked slow (~10 s each)."""
    grid = [(n, mode, eos, slots) for n in (1, 4) for mode in ("greedy", "seeded")
            for eos in (0, 1) for slots in (4, 64)]
    return [pytest.param(*g, marks=() if g == quick else pytest.mark.slow) for g in grid]


@pytest.mark.parametrize("n,mode,with_eos,slots", _slow_but(4, "seeded", 1, 4))
def test_tokens_and_logprobs_equal_the_no_cache_oracle(model, n, mode, with_eos, slots):
    prompts = _prompts(16 // n, seed=n)
    params = PARAMS[mode].replace(n=n)
    want = oracle(model, prompts, params, [])
    # EOS ids the samples emit mid-way: some rows stop early, others run to the limit.
    eos = [want[0][0][2], want[-1][0][6]] if with_eos else []
    want = oracle(model, prompts, params, eos) if with_eos else want
    lengths = {len(t) for t, _ in want}
    assert not with_eos or len(lengths) > 1            # rows really stop at different steps
    got = JaxSampler(model, eos_ids=eos or None, pad_id=0, max_batch_size=slots,
                     page_size=4).generate(prompts, params)
    assert got.token_ids == [t for t, _ in want]
    np.testing.assert_allclose(np.concatenate(got.logprobs),
                               np.concatenate([lp for _, lp in want]), atol=1e-5, rtol=0)
    # One prefill per prompt, not per sample.
    assert got.stats["prefill_tokens"] == sum(map(len, prompts))


def test_a_dry_pool_preempts_recomputes_and_reruns_bit_exact(model):
    prompts = _prompts(6, seed=9)
    params = PARAMS["seeded"].replace(n=4, max_new_tokens=16)
    roomy = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=16, page_size=4)
    free = roomy.generate(prompts, params)
    assert free.stats.get("preemptions", 0) == 0
    # 16 slots but a pool of 40 pages of 4 tokens: admitted samples outgrow it.
    cfg, width = model.cfg, (32 + 16) // 4 + 1        # prompt bucket 32, new bucket 16
    small_gb = (40.5 * 4 * page_pool_token_bytes(cfg)
                + slot_buffer_bytes(cfg, 16, 16, width)) / 1e9
    tight = JaxSampler(model, eos_ids=None, pad_id=0, max_batch_size=16, page_size=4,
                       kv_cache_budget_gb=small_gb)
    got = tight.generate(prompts, params)
    assert got.stats["pages"] == 40 and got.stats["preemptions"] > 0
    assert got.token_ids == free.token_ids
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(free.logprobs),
                               atol=1e-5, rtol=0)
    again = tight.generate(prompts, params)
    assert again.token_ids == got.token_ids and again.logprobs == got.logprobs
    assert again.stats == got.stats


def test_decode_weights_are_a_compute_dtype_copy():
    cfg = tiny_llama(dtype="bfloat16")
    master = Decoder(cfg, rngs=nnx.Rngs(1))
    _, state = nnx.split(master)
    copy = decode_weights(state, jnp.dtype(jnp.bfloat16))
    leaves = jax.tree.leaves(state)
    cast = jax.tree.leaves(copy)
    assert all(a.dtype == jnp.float32 for a in leaves)
    assert all(b.dtype == jnp.bfloat16 for b in cast)
    for a, b in zip(leaves, cast):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
    # Every use casts a weight to the compute dtype, so the copy computes what the master
    # weights compute, bit for bit.
    copied = nnx.merge(nnx.graphdef(master), copy)
    ids = jnp.asarray(_prompts(1, seed=3)[0])[None]
    forward = nnx.jit(lambda m: m(ids, jnp.arange(ids.shape[1])[None]))
    assert np.array_equal(np.asarray(forward(master)), np.asarray(forward(copied)))


def test_decode_weights_of_the_compute_dtype_are_the_weights_themselves():
    # a jitted identity would copy every weight before each rollout
    _, state = nnx.split(Decoder(tiny_llama(), rngs=nnx.Rngs(1)))
    same = decode_weights(state, jnp.dtype(jnp.float32))
    assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(same)))
