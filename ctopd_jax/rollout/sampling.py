"""Token sampling transforms as pure jnp functions (jit-able, traced parameter values).

Order (same as HF `generate` and vLLM): divide by the temperature, keep the top-k logits, then
keep the nucleus (top-p) of the distribution renormalised over what top-k kept, and sample from
the softmax of what is left. Definitions the tests check against a brute-force oracle:

- top-k keeps every token whose logit is >= the k-th largest logit (ties at the boundary are
  kept, as HF and vLLM do); k <= 0 keeps everything.
- top-p keeps token v iff the probability mass of the tokens strictly ahead of v in descending
  order is < p (the smallest prefix whose mass reaches p); p >= 1 keeps everything. At least the
  most likely token is always kept. Tokens tied with the last kept one are kept too.

`top_k` / `top_p` / `temperature` are traced values, scalars or one per row ([B] for logits
[B, V]), so one compiled sampler serves every setting; only whether a filter is active at all (`use_top_k`, `use_top_p`, greedy) is static,
because the shared descending sort is skipped when neither filter is on.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def apply_temperature(logits: jax.Array, temperature) -> jax.Array:
    """logits / temperature, computed in float32 (temperature > 0)."""
    return logits.astype(jnp.float32) / _per_row(temperature, jnp.float32)


def _per_row(value, dtype) -> jax.Array:
    """A scalar or per-row [...] parameter shaped to broadcast against logits [..., V]."""
    return jnp.asarray(value, dtype)[..., None]


def _kth_largest(srt: jax.Array, k: jax.Array) -> jax.Array:
    idx = jnp.clip(k - 1, 0, srt.shape[-1] - 1)
    return jnp.take_along_axis(srt, jnp.broadcast_to(idx, srt.shape[:-1] + (1,)), axis=-1)


def _sorted_desc(logits: jax.Array) -> jax.Array:
    return -jnp.sort(-logits, axis=-1)


def top_k_keep(logits: jax.Array, top_k) -> jax.Array:
    """Bool mask [..., V]: logits >= the k-th largest logit of their row (k <= 0: all)."""
    top_k = _per_row(top_k, jnp.int32)
    kth = _kth_largest(_sorted_desc(logits), top_k)
    return (logits >= kth) | (top_k <= 0)


def top_p_keep(logits: jax.Array, top_p) -> jax.Array:
    """Bool mask [..., V]: the nucleus of softmax(logits) with mass p (-inf logits never kept)."""
    top_p = _per_row(top_p, jnp.float32)
    srt = _sorted_desc(logits)
    probs = jax.nn.softmax(srt, axis=-1)
    mass_ahead = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_ahead < top_p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    return (logits >= threshold) | (top_p >= 1.0)


def filter_logits(logits: jax.Array, top_k=0, top_p=1.0, *, use_top_k: bool = True,
                  use_top_p: bool = True) -> jax.Array:
    """Top-k then top-p: dropped logits become -inf. One descending sort serves both."""
    logits = logits.astype(jnp.float32)
    if not (use_top_k or use_top_p):
        return logits
    vocab = logits.shape[-1]
    srt = _sorted_desc(logits)
    keep = jnp.ones(logits.shape, bool)
    if use_top_k:
        k = _per_row(top_k, jnp.int32)
        keep = (logits >= _kth_largest(srt, k)) | (k <= 0)
        # The sorted copy stays sorted when its tail is cut, so top-p can reuse it.
        rank = jnp.arange(vocab)
        srt = jnp.where((rank < k) | (k <= 0), srt, NEG_INF)
    if use_top_p:
        p = _per_row(top_p, jnp.float32)
        probs = jax.nn.softmax(srt, axis=-1)
        mass_ahead = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.maximum(jnp.sum(mass_ahead < p, axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        keep = keep & ((logits >= threshold) | (p >= 1.0))
    return jnp.where(keep, logits, NEG_INF)


def sample_tokens(keys: jax.Array, logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0, *,
                  greedy: bool = False, use_top_k: bool = True, use_top_p: bool = True,
                  vocab_limit: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row of logits [B, V] with per-row keys [B].

    Returns (tokens [B] int32, raw log-probs [B]): the log-probs are log softmax of the
    unmodified logits at the chosen token (see rollout/base.py for why). `vocab_limit`: ids
    from it on are never chosen: an embedding padded past its tokenizer (Qwen2.5: 151,936 rows
    for 151,665 tokens) has rows no text decodes to; like top-k, the cut changes the choice,
    not the reported log-probs.
    """
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, NEG_INF)
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        scaled = apply_temperature(logits, temperature)
        filtered = filter_logits(scaled, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)
        tokens = categorical(keys, filtered)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen


def categorical(keys: jax.Array, logits: jax.Array, block: int = 256) -> jax.Array:
    """One draw per row of softmax(logits) [B, V] (-inf: never drawn) with per-row keys [B]:
    a block of `block` columns by its mass (the block's logsumexp), then a column of that block
    by its logit. P(block) · P(column | block) is the column's softmax probability, so the
    distribution is the one-stage draw's, at V / block + block random numbers a row instead of
    V: jax.random.categorical's Gumbel-max spends a threefry draw and two logs on every column,
    ~14 ms of a 32-slot decode step over SmolLM2's 49,152 columns on a 2-core CPU, against
    ~0.5 ms for this (benchmarks/RESULTS.md, "The rollout's draw")."""
    rows, vocab = logits.shape
    if vocab <= block:   # one block: jax's own draw, the same tokens for a seed as before
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    blocks = jnp.pad(logits, ((0, 0), (0, -vocab % block)), constant_values=NEG_INF)
    blocks = blocks.reshape(rows, -1, block)
    outer, inner = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    which = jax.vmap(jax.random.categorical)(outer, jax.nn.logsumexp(blocks, axis=-1))
    chosen = jnp.take_along_axis(blocks, which[:, None, None], axis=1)[:, 0]
    column = jax.vmap(jax.random.categorical)(inner, chosen)
    return (which * block + column).astype(jnp.int32)


def sample_keys(seed, sample_ids: jax.Array, step) -> jax.Array:
    """Per-sample, per-step keys: depend only on (seed, global sample index, step).

    So a sample's randomness does not depend on which batch bucket, padding or decode slot it
    landed in. `step` is a scalar or one per row ([B]): with continuous batching each slot is
    at its own step (the sample's own token index); a scalar gives the same keys as [B] copies.
    """
    base = jax.random.key(jnp.asarray(seed, jnp.uint32))
    per_sample = jax.vmap(lambda i: jax.random.fold_in(base, i))(sample_ids)
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), jnp.shape(sample_ids))
    return jax.vmap(jax.random.fold_in)(per_sample, steps)
