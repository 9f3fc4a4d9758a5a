"""The sampler's jitted device programs (rollout/jax_sampler.py drives them from the host):
the decode-weight copy, the page pool, the prompt prefill into pages, the admission of
newcomers (prompt tail copies, first logits) and the decode loop that takes pages as rows
grow. See jax_sampler.py for the design and rollout/pages.py for the page rules."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.models.kv_cache import PagedKVCache, init_page_pool
from ctopd_jax.rollout import sampling


def decode_weights(state, dtype):
    """The state with every floating parameter wider than `dtype` cast to it (scalars such as
    the LoRA scale stay, as the model multiplies by them in their own dtype). The state itself
    when none is wider: a jitted identity copies every weight (0.54 GB for a float32 135M model,
    held through the rollout)."""
    if not any(_wider(x, dtype) for x in jax.tree.leaves(state)):
        return state
    return _cast_wider(state, dtype)


def _wider(x, dtype) -> bool:
    return (jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0
            and jnp.dtype(x.dtype).itemsize > jnp.dtype(dtype).itemsize)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast_wider(state, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if _wider(x, dtype) else x, state)


@functools.partial(jax.jit, static_argnames=("cfg", "pages", "page_size", "sharding"))
def new_pool(*, cfg, pages, page_size, sharding):
    k, v = init_page_pool(cfg, pages, page_size)
    if sharding is not None:
        k, v = jax.lax.with_sharding_constraint((k, v), sharding)
    return k, v


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("k", "v"))
def prefill_pages(state, k, v, table, input_ids, attention_mask, *, graphdef):
    """Prefill prompts [R, P] (left padded) into their pages; the last position's logits."""
    model = nnx.merge(graphdef, state)
    cache = PagedKVCache(k, v, table, jnp.zeros(table.shape[0], jnp.int32))
    hidden, cache = model.hidden_states(input_ids, prefill_positions(attention_mask),
                                        attention_mask, cache)
    return cache.k, cache.v, model.logits(hidden[:, -1:])[:, 0]


@functools.partial(jax.jit, donate_argnames=("k", "v", "logits"))
def admit_newcomers(k, v, logits, src, dst, rows, new_logits):
    """Copy prompt tail pages src -> dst (out-of-range dst: dropped) and set newcomers' logits."""
    k = tuple(a.at[:, dst].set(a[:, src], mode="drop") for a in k)
    v = tuple(a.at[:, dst].set(a[:, src], mode="drop") for a in v)
    return k, v, logits.at[rows].set(new_logits, mode="drop")


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "greedy", "use_top_k", "use_top_p", "pad_id", "vocab_limit"),
    donate_argnames=("k", "v", "logits", "tokens", "logprobs"))
def decode_until_refill(state, k, v, logits, tokens, logprobs, table, lengths, sample_ids,
                         steps, done, free_stack, free_top, seed, temperature, top_k, top_p,
                         max_new_tokens, eos, refill_min,
                         *, graphdef, greedy, use_top_k, use_top_p, pad_id, vocab_limit=None):
    """Decode until `refill_min` occupied slots finished, all are done, or the pool may run
    dry at the next step (a row at a page boundary needs a page)."""
    model = nnx.merge(graphdef, state)
    slots, max_new_bucket = tokens.shape
    page, width = k[0].shape[2], table.shape[1]
    rows = jnp.arange(slots)
    occupied = sample_ids >= 0

    def cond(carry):
        lengths, done, free_top = carry[5], carry[7], carry[8]
        may_need = jnp.sum(~done & (lengths % page == 0))
        return (~jnp.all(done) & (jnp.sum(done & occupied) < refill_min)
                & (may_need <= free_top))

    def body(carry):
        k, v, logits, tokens, logprobs, lengths, steps, done, free_top, table = carry
        keys = None if greedy else sampling.sample_keys(seed, sample_ids, steps)
        tok, lp = sampling.sample_tokens(keys, logits, temperature, top_k, top_p, greedy=greedy,
                                         use_top_k=use_top_k, use_top_p=use_top_p,
                                         vocab_limit=vocab_limit)
        active = ~done
        tok = jnp.where(active, tok, pad_id)
        at = jnp.where(active, steps, max_new_bucket)  # out of bounds: dropped
        tokens = tokens.at[rows, at].set(tok, mode="drop")
        logprobs = logprobs.at[rows, at].set(lp, mode="drop")
        steps = steps + active
        finished = active & (jnp.any(tok[:, None] == eos[None, :], axis=-1)  # eos is -1 padded
                             | (steps >= max_new_tokens))
        feed = active & ~finished  # only rows that go on need the new token's K/V
        # Rows whose new token starts a page pop one from the top of the free stack.
        need = feed & (lengths % page == 0)
        rank = jnp.cumsum(need) - 1
        popped = free_stack[jnp.clip(free_top - 1 - rank, 0, free_stack.shape[0] - 1)]
        table = table.at[rows, jnp.where(need, lengths // page, width)].set(popped, mode="drop")
        free_top = free_top - jnp.sum(need)
        logits, cache = model(tok[:, None], lengths[:, None], feed[:, None],
                              PagedKVCache(k, v, table, lengths))
        return (cache.k, cache.v, logits[:, -1], tokens, logprobs, cache.lengths, steps,
                done | finished, free_top, table)

    carry = (k, v, logits, tokens, logprobs, lengths, steps, done, free_top, table)
    return jax.lax.while_loop(cond, body, carry)


def lower_decode(cfg, slots: int, pages: int, page_size: int, prompt_len: int, max_new: int):
    """`decode_until_refill` lowered for abstract inputs of these sizes (nothing allocated),
    for compile-only memory (benchmarks/sampler_memory.py, scripts/gpu_check.py)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    S = jax.ShapeDtypeStruct
    width = -(-(prompt_len + max_new) // page_size) + 1
    pool = (S((cfg.num_kv_heads, pages, page_size, cfg.head_dim), cfg.compute_dtype),) \
        * cfg.num_layers
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    args = (state, pool, pool, S((slots, cfg.vocab_size), jnp.float32), i32(slots, max_new),
            S((slots, max_new), jnp.float32), i32(slots, width), i32(slots), i32(slots),
            i32(slots), S((slots,), jnp.bool_), i32(pages), i32(), S((), jnp.uint32),
            S((), jnp.float32), i32(), S((), jnp.float32), i32(), i32(1), i32())
    return decode_until_refill.lower(*args, graphdef=graphdef, greedy=False, use_top_k=False,
                                     use_top_p=True, pad_id=0)


@jax.jit
def take_rows(tokens, logprobs, rows):
    return tokens[rows], logprobs[rows]
