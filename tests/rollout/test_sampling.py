"""Sampling transforms against their definitions, checked by brute force in numpy."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ctopd_jax.rollout import sampling


def oracle_top_k(logits, k):
    """Keep v iff fewer than k tokens have a strictly larger logit (so ties with the k-th stay)."""
    if k <= 0:
        return np.ones_like(logits, bool)
    return np.array([(logits > x).sum() < k for x in logits])


def oracle_top_p(logits, p):
    """Keep v iff the mass of tokens strictly more probable than v is < p (at least one kept)."""
    if p >= 1.0:
        return np.isfinite(logits)
    z = np.where(np.isfinite(logits), np.exp(logits - logits[np.isfinite(logits)].max()), 0.0)
    probs = z / z.sum()
    keep = np.array([probs[probs > q].sum() < p and np.isfinite(x)
                     for q, x in zip(probs, logits)])
    keep[np.argmax(logits)] = True
    return keep


def oracle_filtered_probs(logits, temperature, k, p):
    scaled = logits / temperature
    after_k = np.where(oracle_top_k(scaled, k), scaled, -np.inf)
    keep = oracle_top_p(after_k, p) & np.isfinite(after_k)
    z = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return z / z.sum()


# Random logits without near-ties at the decision boundary: distinct values on a grid.
def distinct_logits(rng, vocab):
    return rng.permutation(vocab).astype(np.float32) * 0.37 - 3.0 + rng.normal(0, 0.01, vocab)


VOCABS = (2, 7, 33)
ROWS = 48
top_k_keep = jax.jit(sampling.top_k_keep)
top_p_keep = jax.jit(sampling.top_p_keep)
filter_logits = jax.jit(sampling.filter_logits)


def random_rows(seed, vocab):
    rng = np.random.default_rng(seed)
    rows = np.stack([distinct_logits(rng, vocab) * rng.uniform(0.2, 2.0) for _ in range(ROWS)])
    return rng, rows.astype(np.float32)


def near_boundary(logits, p, tol=1e-4):
    """True when p is within float error of a cumulative-mass boundary (ambiguous case)."""
    finite = np.isfinite(logits)
    z = np.where(finite, np.exp(logits - logits[finite].max()), 0.0)
    cum = np.cumsum(np.sort(z / z.sum())[::-1])
    return np.min(np.abs(cum - p)) < tol


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_matches_definition(vocab):
    rng, rows = random_rows(vocab, vocab)
    ks = rng.integers(-1, vocab + 3, ROWS)  # one k per row, including off (<=0) and k >= V
    got = np.asarray(top_k_keep(jnp.asarray(rows), jnp.asarray(ks)))
    for row, k, g in zip(rows, ks, got):
        np.testing.assert_array_equal(g, oracle_top_k(row, k))
    scalar = np.asarray(top_k_keep(jnp.asarray(rows), 3))
    for row, g in zip(rows, scalar):
        np.testing.assert_array_equal(g, oracle_top_k(row, 3))


def test_top_k_keeps_ties_at_boundary():
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0], np.float32)
    got = np.asarray(sampling.top_k_keep(jnp.asarray(logits), 2))
    np.testing.assert_array_equal(got, [True, False, True, True, False])


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_p_matches_definition(vocab):
    rng, rows = random_rows(100 + vocab, vocab)
    ps = rng.uniform(0.01, 1.0, ROWS).astype(np.float32)
    ps[:3] = 1.0
    got = np.asarray(top_p_keep(jnp.asarray(rows), jnp.asarray(ps)))
    checked = 0
    for row, p, g in zip(rows, ps, got):
        if p < 1.0 and near_boundary(row.astype(np.float64), p):
            continue
        np.testing.assert_array_equal(g, oracle_top_p(row.astype(np.float64), p))
        checked += 1
    assert checked > ROWS // 2


@pytest.mark.parametrize("vocab", VOCABS)
def test_filter_logits_is_top_k_then_top_p_of_renormalised(vocab):
    rng, rows = random_rows(200 + vocab, vocab)
    ks = rng.integers(0, vocab + 2, ROWS)
    ps = rng.uniform(0.05, 1.0, ROWS).astype(np.float32)
    temps = rng.uniform(0.3, 2.0, ROWS).astype(np.float32)
    filtered = filter_logits(
        sampling.apply_temperature(jnp.asarray(rows), jnp.asarray(temps)),
        jnp.asarray(ks), jnp.asarray(ps))
    got = np.asarray(jax.nn.softmax(filtered))
    checked = 0
    for row, k, p, t, g, f in zip(rows, ks, ps, temps, got, np.asarray(filtered)):
        scaled = row.astype(np.float64) / np.float64(t)
        if near_boundary(np.where(oracle_top_k(scaled, k), scaled, -np.inf), p):
            continue
        want = oracle_filtered_probs(row.astype(np.float64), np.float64(t), k, p)
        np.testing.assert_allclose(g, want, atol=1e-5)
        np.testing.assert_array_equal(np.isfinite(f), want > 0)
        checked += 1
    assert checked > ROWS // 2


def test_filters_off_are_identity():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 11)), jnp.float32)
    out = sampling.filter_logits(logits, 0, 1.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))
    out = sampling.filter_logits(logits, 5, 1.0, use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def test_sampled_frequencies_follow_filtered_distribution():
    """20k draws: empirical frequencies match the oracle's renormalised distribution."""
    rng = np.random.default_rng(3)
    vocab, draws = 12, 20_000
    logits = distinct_logits(rng, vocab) * 0.5
    temperature, k, p = 0.8, 6, 0.85
    want = oracle_filtered_probs(logits.astype(np.float64), temperature, k, p)
    keys = sampling.sample_keys(7, jnp.arange(draws), 0)
    tokens, logprobs = jax.jit(sampling.sample_tokens)(
        keys, jnp.tile(jnp.asarray(logits)[None], (draws, 1)), temperature, k, p)
    freq = np.bincount(np.asarray(tokens), minlength=vocab) / draws
    assert np.all(freq[want == 0] == 0)
    np.testing.assert_allclose(freq, want, atol=0.015)
    # Log-probs are of the raw (unscaled, unfiltered) distribution at the drawn token.
    raw = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    np.testing.assert_allclose(np.asarray(logprobs), raw[np.asarray(tokens)], atol=1e-5)


def test_draws_over_many_blocks_follow_the_softmax_and_the_filters():
    """Over more columns than one block (1,000 = 3 blocks of 256 and a padded fourth; and
    blocks of 16 on the same row): frequencies of the columns the mass sits on, in different
    blocks, and of the rest together, against the exact softmax (float64), plain and with top-k
    (the filtered-out columns never drawn)."""
    rng = np.random.default_rng(11)
    vocab, draws = 1000, 40_000
    logits = rng.normal(size=vocab) - 2.0
    heavy = np.array([5, 255, 256, 511, 777, 999])          # first/last columns of blocks, the pad
    logits[heavy] = [2.0, 1.5, 1.0, 2.5, 0.5, 1.8]
    logits = logits.astype(np.float32)
    keys = sampling.sample_keys(3, jnp.arange(draws), 0)
    rows = jnp.tile(jnp.asarray(logits)[None], (draws, 1))

    def frequencies(tokens):
        counts = np.bincount(np.asarray(tokens), minlength=vocab) / draws
        return np.append(counts[heavy], 1.0 - counts[heavy].sum())

    exact = np.exp(logits.astype(np.float64) - logits.max())
    exact /= exact.sum()
    want = np.append(exact[heavy], 1.0 - exact[heavy].sum())
    for block in (256, 16):
        tokens = jax.jit(sampling.categorical, static_argnums=2)(keys, rows, block)
        assert 0 <= int(tokens.min()) and int(tokens.max()) < vocab
        np.testing.assert_allclose(frequencies(tokens), want, atol=0.01)
    tokens, _ = jax.jit(sampling.sample_tokens)(keys, rows, 1.0, 4, 1.0)
    top4 = np.argsort(-logits)[:4]
    assert set(np.unique(np.asarray(tokens))) <= set(top4)
    kept = exact[top4] / exact[top4].sum()
    freq = np.bincount(np.asarray(tokens), minlength=vocab)[top4] / draws
    np.testing.assert_allclose(freq, kept, atol=0.01)


def test_temperature_definition():
    """Frequencies at temperature T follow softmax(logits / T)."""
    logits = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    draws = 20_000
    keys = sampling.sample_keys(1, jnp.arange(draws), 3)
    for t in (0.5, 2.0):
        tokens, _ = sampling.sample_tokens(keys, jnp.tile(jnp.asarray(logits)[None], (draws, 1)),
                                           t, 0, 1.0, use_top_k=False, use_top_p=False)
        want = np.exp(logits / t) / np.exp(logits / t).sum()
        freq = np.bincount(np.asarray(tokens), minlength=4) / draws
        np.testing.assert_allclose(freq, want, atol=0.015)


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(5, 17)), jnp.float32)
    tokens, _ = sampling.sample_tokens(None, logits, greedy=True)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))


def test_sample_keys_depend_only_on_seed_sample_and_step():
    a = sampling.sample_keys(5, jnp.array([0, 1, 2, 3]), 4)
    b = sampling.sample_keys(5, jnp.array([2, 3]), 4)
    assert np.array_equal(jax.random.key_data(a[2:]), jax.random.key_data(b))
    c = sampling.sample_keys(6, jnp.array([2, 3]), 4)
    assert not np.array_equal(jax.random.key_data(c), jax.random.key_data(b))


def test_rows_past_the_tokenizer_are_never_chosen_and_log_probs_stay_the_models():
    """An embedding padded past its tokenizer (vocab_limit): its rows hold the largest logits
    here, yet neither greedy nor sampling picks them; the returned log-probs are still the
    model's own (log softmax over every row), as with top-k."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4000, 12)).astype(np.float32)
    logits[:, 9:] += 3.0                       # rows 9..11 would win most draws
    keys = sampling.sample_keys(0, jnp.arange(4000), 0)
    for greedy in (True, False):
        tokens, logprobs = sampling.sample_tokens(None if greedy else keys, jnp.asarray(logits),
                                                  greedy=greedy, use_top_k=False,
                                                  use_top_p=False, vocab_limit=9)
        tokens = np.asarray(tokens)
        assert tokens.max() < 9
        full = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        np.testing.assert_allclose(np.asarray(logprobs), full[np.arange(4000), tokens], atol=1e-5)
    free, _ = sampling.sample_tokens(keys, jnp.asarray(logits), use_top_k=False, use_top_p=False)
    assert np.asarray(free).max() >= 9        # without the limit they are drawn
