"""Causal grouped-query attention: an einsum reference, a blockwise (flash-style) pure-JAX path
and cuDNN through ``jax.nn.dot_product_attention``.

Mask contract (every path): query ``t`` of row ``b`` may attend key slot ``s`` iff
``kv_valid[b, s]`` and ``s <= q_slots[t]`` and, for packed rows (``segments`` given: several
samples in one row, each a run of one segment id), ``segments[b, s] == segments[b, q_slots[t]]``:
attention never crosses a sample.  Without a cache ``q_slots = arange(T)`` and
``kv_valid`` is the attention mask; with a KV cache ``q_slots`` are the slots the new tokens
were written to and ``kv_valid`` the cache's valid slots.  ``AttentionMask`` carries those two
O(T) arrays, so no path but the einsum reference ever builds a [T, S] mask.

Decisions:
- Blockwise attention is a ``jax.custom_vjp``: the forward keeps only the output and the
  per-query log-sum-exp (O(T)) as residuals, and the backward recomputes each [block_q,
  block_k] score tile.  The alternative, ``jax.checkpoint`` per key block inside a
  differentiated ``lax.scan``, saves the running (max, sum, accumulator) carry of every step,
  i.e. an O(T) accumulator per key block: O(T^2 / block) memory, which is what we are avoiding.
- ``q_slots`` must be non-decreasing (true for both uses above).  That lets the loops skip
  key blocks past a query block's last slot (forward) and query blocks before a key block's
  first reachable query (backward): about half the tiles for causal training, and only the
  filled part of a KV cache when decoding.  Loop bounds are dynamic, so they are
  ``fori_loop``s that lower to while loops; the custom VJP means nothing differentiates them.
- Packed rows (``segments``) also skip the (query block, key block) tiles that lie wholly
  before the segment of the block's first query: for a query block, keys from the start of
  its first query's segment to its last query; for a key block, the query blocks from the
  first that reaches it to the last whose first query's segment starts inside or before it;
  and the key blocks after the row's last valid key.
  Samples sit in different places in each row, so packed rows loop one row at a time
  (``_over_rows``), each with its own bounds; the decoder gives them smaller tiles
  (``ModelConfig.packed_attention_block``), which skip more: a row of width W holding samples
  of lengths L_i then costs about sum L_i^2 / 2 + W * block instead of W^2 / 2.
- GQA without repeating K/V: queries are viewed as [B, T, kv_heads, group, D] and every tile
  contracts against the shared K/V head.
- Scores, softmax statistics and the accumulators are float32; probabilities are cast to the
  value dtype before the PV matmul (as the einsum reference does), so bf16 runs match it.
- Rows with no visible key (left pads) output zeros.  The einsum reference outputs finite
  garbage there instead; neither is ever read (pads are masked out of every loss).
- cuDNN's fused kernel takes padding only as per-row lengths, so that path assumes right
  padding (``kv_valid`` = the first ``sum(kv_valid)`` slots), which is what every no-cache
  caller in this project passes (retokenized batches, teacher scoring, logprob recompute).
  It needs bf16/fp16 inputs and a GPU; ``resolve_implementation`` only picks it then.
  ``jax.nn.dot_product_attention`` takes no segment ids, so packed rows (``segments``) asked
  of cuDNN run the blockwise path instead (same result, no fused kernel).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "einsum", "blockwise", "cudnn")
_NEG = float(jnp.finfo(jnp.float32).min)


class AttentionMask(NamedTuple):
    """Which keys each query may see, in O(T + S) memory (see the module docstring)."""

    q_slots: jax.Array   # [T] int32, non-decreasing
    kv_valid: jax.Array  # [B, S] bool
    segments: jax.Array | None = None   # [B, S] int32 sample id of each slot (packed rows)

    def query_segments(self) -> jax.Array | None:
        """[B, T] segment of each query (that of its slot), None without segments."""
        return None if self.segments is None else jnp.take(self.segments, self.q_slots, axis=1)

    def dense(self) -> jax.Array:
        """The [B, T, S] boolean mask (only the einsum reference materialises it)."""
        s = jnp.arange(self.kv_valid.shape[1], dtype=jnp.int32)
        dense = self.kv_valid[:, None, :] & (s[None, None, :] <= self.q_slots[None, :, None])
        if self.segments is not None:
            dense = dense & (self.query_segments()[:, :, None] == self.segments[:, None, :])
        return dense


def attend_einsum(q, k, v, mask):
    """Reference GQA attention over a dense mask. q [B,T,Nq,D], k/v [B,S,Nkv,D]; ``mask`` an
    ``AttentionMask`` or an explicit [B, T, S] bool array."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    q = q.reshape(b, t, nkv, nq // nkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    dense = mask.dense() if isinstance(mask, AttentionMask) else mask
    scores = jnp.where(dense[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, nq, d)


# ---------------------------------------------------------------------- blockwise
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _tile_allowed(valid_j, q_pos_i, j, bk, segs=None):
    """[B, 1, 1, bq, bk] mask of one tile: key slot valid and not after the query's slot, and
    with `segs` = (query segments [B, bq], key segments [B, bk]) in the query's segment."""
    k_slots = j * bk + jnp.arange(bk, dtype=jnp.int32)
    causal = k_slots[None, :] <= q_pos_i[:, None]                  # [bq, bk]
    allowed = valid_j[:, None, :] & causal[None]
    if segs is not None:
        allowed = allowed & (segs[0][:, :, None] == segs[1][:, None, :])
    return allowed[:, None, None]                                  # [B, 1, 1, bq, bk]


def _tile_segments(segments, i, bq, j, bk):
    """(query, key) segments of tile (i, j), or None for rows that are not packed."""
    if segments is None:
        return None
    q_seg, kv_seg, _ = segments
    return (jax.lax.dynamic_slice_in_dim(q_seg, i * bq, bq, axis=1),
            jax.lax.dynamic_slice_in_dim(kv_seg, j * bk, bk, axis=1))


def _key_blocks(kv_valid, segments, bk):
    """The key blocks the loops visit: all, or for packed rows those up to the last valid key
    (a packed row ends in pads, or is all pads where the row count was rounded up)."""
    if segments is None:
        return kv_valid.shape[1] // bk
    slots = jnp.arange(kv_valid.shape[1], dtype=jnp.int32)
    return (jnp.max(jnp.where(kv_valid, slots, -1)) + bk) // bk


def _blockwise_forward(q5, k, v, q_slots, kv_valid, segments, bq, bk):
    """Padded inputs: q5 [B,Tp,K,G,D], k/v [B,Sp,K,D], q_slots [Tp], kv_valid [B,Sp],
    segments None or (query segments [B,Tp], key segments [B,Sp], first slot of each query's
    segment, least over the B rows [Tp], non-decreasing: _over_rows).
    Returns out [B,Tp,K,G,D] (q dtype) and lse [B,K,G,Tp] float32."""
    b, tp, nkv, g, d = q5.shape
    n_qb, n_kb = tp // bq, _key_blocks(kv_valid, segments, bk)
    scale = 1.0 / math.sqrt(d)

    def q_block(i, bufs):
        out, lse = bufs
        qi = jax.lax.dynamic_slice_in_dim(q5, i * bq, bq, axis=1)
        pos_i = jax.lax.dynamic_slice_in_dim(q_slots, i * bq, bq)
        # Key blocks that start after this block's last query slot are fully masked, and in
        # packed rows so are those that end before its first query's segment starts.
        n_needed = jnp.minimum(n_kb, pos_i[-1] // bk + 1)
        first_kb = 0 if segments is None else segments[2][i * bq] // bk

        def k_step(j, carry):
            m, l, acc = carry
            kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
            valid_j = jax.lax.dynamic_slice_in_dim(kv_valid, j * bk, bk, axis=1)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj,
                           preferred_element_type=jnp.float32) * scale
            allowed = _tile_allowed(valid_j, pos_i, j, bk, _tile_segments(segments, i, bq, j, bk))
            s = jnp.where(allowed, s, _NEG)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * correction[..., None] + pv

        init = (jnp.full((b, nkv, g, bq), _NEG, jnp.float32),
                jnp.zeros((b, nkv, g, bq), jnp.float32),
                jnp.zeros((b, nkv, g, bq, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(first_kb, n_needed, k_step, init)
        seen = l > 0
        out_i = acc / jnp.where(seen, l, 1.0)[..., None]
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        out_i = jnp.transpose(out_i, (0, 3, 1, 2, 4)).astype(out.dtype)   # [B,bq,K,G,D]
        out = jax.lax.dynamic_update_slice_in_dim(out, out_i, i * bq, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * bq, axis=3)
        return out, lse

    bufs = (jnp.zeros(q5.shape, q5.dtype), jnp.zeros((b, nkv, g, tp), jnp.float32))
    return jax.lax.fori_loop(0, n_qb, q_block, bufs)


def _blockwise_backward(q5, k, v, q_slots, kv_valid, segments, out, lse, d_out, bq, bk):
    """Gradients for padded inputs; key blocks outer, query blocks inner, dq accumulated."""
    b, tp, nkv, g, d = q5.shape
    n_qb, n_kb = tp // bq, _key_blocks(kv_valid, segments, bk)
    scale = 1.0 / math.sqrt(d)
    # delta_t = sum_d dO * O: the softmax backward's row term, computed once.
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    block_last_slot = q_slots[bq - 1::bq]                               # [n_qb]
    block_first_start = None if segments is None else segments[2][::bq]  # [n_qb]

    def k_block(j, grads):
        dq, dk, dv = grads
        kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
        valid_j = jax.lax.dynamic_slice_in_dim(kv_valid, j * bk, bk, axis=1)
        # Query blocks whose last slot precedes this key block cannot see any of it, nor (packed
        # rows) those whose first query's segment starts after the block's last key.
        first = jnp.sum(block_last_slot < j * bk).astype(jnp.int32)
        stop = n_qb if segments is None else jnp.sum(block_first_start <= (j + 1) * bk - 1).astype(jnp.int32)

        def q_step(i, carry):
            dq, dkj, dvj = carry
            qi = jax.lax.dynamic_slice_in_dim(q5, i * bq, bq, axis=1)
            doi = jax.lax.dynamic_slice_in_dim(d_out, i * bq, bq, axis=1)
            pos_i = jax.lax.dynamic_slice_in_dim(q_slots, i * bq, bq)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj,
                           preferred_element_type=jnp.float32) * scale
            allowed = _tile_allowed(valid_j, pos_i, j, bk, _tile_segments(segments, i, bq, j, bk))
            p = jnp.where(allowed, jnp.exp(s - lse_i[..., None]), 0.0)
            dvj = dvj + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                                   preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * scale
            dkj = dkj + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qi.dtype), qi,
                                   preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kj.dtype), kj,
                              preferred_element_type=jnp.float32)
            dq_old = jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_old + dq_i, i * bq, axis=1)
            return dq, dkj, dvj

        zeros_kv = jnp.zeros((b, bk, nkv, d), jnp.float32)
        dq, dkj, dvj = jax.lax.fori_loop(first, stop, q_step, (dq, zeros_kv, zeros_kv))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, axis=1)
        return dq, dk, dv

    grads = (jnp.zeros(q5.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
             jnp.zeros(v.shape, jnp.float32))
    return jax.lax.fori_loop(0, n_kb, k_block, grads)


def _pad_inputs(q, k, v, q_slots, kv_valid, segments, block_q, block_k):
    b, t, nq, d = q.shape
    s, nkv = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    q5 = _pad_axis(q.reshape(b, t, nkv, nq // nkv, d), 1, tp)
    # Padded queries repeat the last slot so q_slots stays non-decreasing; their rows are
    # sliced off.  Padded keys are invalid.
    q_slots = jnp.concatenate([q_slots.astype(jnp.int32),
                               jnp.broadcast_to(q_slots[-1].astype(jnp.int32), (tp - t,))])
    if segments is not None:   # padded queries and keys sit in segment -1, seen by no real query
        q_seg, kv_seg, q_start = segments
        q_start = jnp.concatenate([q_start, jnp.broadcast_to(q_start[:, -1:], (b, tp - t))], axis=1)
        segments = (_pad_axis(q_seg, 1, tp, -1), _pad_axis(kv_seg, 1, sp, -1), q_start)
    return (q5, _pad_axis(k, 1, sp), _pad_axis(v, 1, sp), q_slots,
            _pad_axis(kv_valid.astype(jnp.bool_), 1, sp, False), segments, bq, bk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q, k, v, q_slots, kv_valid, segments, block_q, block_k):
    return _blockwise_fwd(q, k, v, q_slots, kv_valid, segments, block_q, block_k)[0]


def _blockwise_fwd(q, k, v, q_slots, kv_valid, segments, block_q, block_k):
    b, t, nq, d = q.shape
    q5, kp, vp, slots, valid, segs, bq, bk = _pad_inputs(q, k, v, q_slots, kv_valid, segments,
                                                         block_q, block_k)
    out, lse = _over_rows(lambda q5, kp, vp, valid, segs: _blockwise_forward(
        q5, kp, vp, slots, valid, segs, bq, bk), (q5, kp, vp, valid), segs, bq, bk)
    result = out[:, :t].reshape(b, t, nq, d)
    return result, (q, k, v, q_slots, kv_valid, segments, out, lse)


def _blockwise_bwd(block_q, block_k, residuals, d_result):
    q, k, v, q_slots, kv_valid, segments, out, lse = residuals
    b, t, nq, d = q.shape
    q5, kp, vp, slots, valid, segs, bq, bk = _pad_inputs(q, k, v, q_slots, kv_valid, segments,
                                                         block_q, block_k)
    d_out = _pad_axis(d_result.reshape(q5.shape[:1] + (t,) + q5.shape[2:]), 1, q5.shape[1])
    dq, dk, dv = _over_rows(
        lambda q5, kp, vp, valid, out, lse, d_out, segs: _blockwise_backward(
            q5, kp, vp, slots, valid, segs, out, lse, d_out, bq, bk),
        (q5, kp, vp, valid, out, lse, d_out.astype(q.dtype)), segs, bq, bk)
    s = k.shape[1]
    no_grad = None if segments is None else (None, None, None)
    return (dq[:, :t].reshape(q.shape).astype(q.dtype), dk[:, :s].astype(k.dtype),
            dv[:, :s].astype(v.dtype), None, None, no_grad)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def _over_rows(loops, arrays, segments, bq, bk):
    """loops(*arrays, segments) over all rows at once, or, for packed rows of more than one
    tile, one row at a time: each row's samples sit elsewhere than another row's, so a batch of
    rows would share the union of their bounds where a row alone skips the tiles its own
    segments never need.  arrays: [B, ...] each (q5 and the keys first)."""
    if segments is None or arrays[0].shape[1] // bq * (arrays[1].shape[1] // bk) == 1:
        shared = None if segments is None else (*segments[:2], segments[2].min(axis=0))
        return loops(*arrays, shared)

    def row(xs):
        *one, q_seg, kv_seg, q_start = (x[None] for x in xs)
        return loops(*one, (q_seg, kv_seg, q_start[0]))
    return jax.tree.map(lambda x: x[:, 0], jax.lax.map(row, (*arrays, *segments)))


def segment_starts(segments: jax.Array) -> jax.Array:
    """[B, S] the first slot of each slot's segment (segments: contiguous runs of one id)."""
    slot = jnp.broadcast_to(jnp.arange(segments.shape[1], dtype=jnp.int32), segments.shape)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]],
                             axis=1)
    return jax.lax.cummax(jnp.where(starts, slot, 0), axis=1)


def _query_segment_starts(mask: AttentionMask) -> jax.Array:
    """[B, T] the first slot of each query's segment: it never decreases along T (the loops'
    block bounds rely on that)."""
    return jnp.take(segment_starts(mask.segments), mask.q_slots, axis=1).astype(jnp.int32)


def attend_blockwise(q, k, v, mask: AttentionMask, block_q: int = 512, block_k: int = 512):
    """Flash-style GQA attention: O(T) memory forward and backward (see module docstring)."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"attention blocks must be positive, got {block_q}, {block_k}")
    segments = None if mask.segments is None else (mask.query_segments(), mask.segments,
                                                   _query_segment_starts(mask))
    return _blockwise(q, k, v, mask.q_slots, mask.kv_valid, segments, int(block_q), int(block_k))


# ---------------------------------------------------------------------- cuDNN
def attend_cudnn(q, k, v, mask: AttentionMask):
    """cuDNN flash attention; assumes right padding and ``q_slots = arange(T)`` (no cache)."""
    lengths = mask.kv_valid.sum(axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation="cudnn")


def resolve_implementation(name: str, dtype, with_cache: bool, keys: int = 0, einsum_keys: int = 0) -> str:
    """The concrete path for a configured name. ``auto``: cuDNN for no-cache bf16/fp16 calls
    on GPU (the only case its kernel and its right-padding contract cover); the einsum for a
    call over at most ``einsum_keys`` keys (the caller's bound: the decoder's keeps the
    einsum's probabilities, a differentiated forward's residual, no larger than its MLP's
    activation); else blockwise. Over short keys the blockwise path is one tile holding the
    same scores in more programs: at the real demo's 48-token rows on a CPU the teacher's
    forward compiled in 1.2 s instead of 3.1 and ran 1.11x faster (benchmarks/RESULTS.md)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {name!r}")
    if name == "cudnn" and with_cache:
        raise ValueError("attention 'cudnn' cannot express a KV cache's valid slots; use "
                         "'auto' or 'blockwise' for decoding")
    if name != "auto":
        return name
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if not with_cache and half and jax.default_backend() == "gpu":
        return "cudnn"
    return "einsum" if 0 < keys <= einsum_keys else "blockwise"


def attend(q, k, v, mask, implementation: str = "blockwise",
           block_q: int = 512, block_k: int = 512, packed_block: int | None = None):
    """Dispatch to one concrete implementation (``resolve_implementation`` picks it);
    ``packed_block``: the blockwise tiles of packed rows (``mask.segments``), if not block_q/k.

    A dense [B, T, S] bool ``mask`` (what callers passed before ``AttentionMask``) can only go
    to the einsum reference, whatever ``implementation`` says."""
    if implementation == "einsum" or not isinstance(mask, AttentionMask):
        return attend_einsum(q, k, v, mask)
    if mask.segments is not None and packed_block:
        block_q = block_k = packed_block
    if implementation == "blockwise":
        return attend_blockwise(q, k, v, mask, block_q, block_k)
    if implementation == "cudnn":   # no segment ids in cuDNN's API: packed rows go blockwise
        if mask.segments is not None:
            return attend_blockwise(q, k, v, mask, block_q, block_k)
        return attend_cudnn(q, k, v, mask)
    raise ValueError(f"unknown attention implementation {implementation!r}")


def prefill_positions(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions for a (left- or right-) padded prompt batch: 0, 1, ... over real tokens.
    An integer mask holds packed rows' segment ids (contiguous runs, 0 on pads): positions
    restart at 0 where each segment starts."""
    if attention_mask.dtype == jnp.bool_:
        return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    seg = attention_mask.astype(jnp.int32)
    slot = jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
    return jnp.where(seg > 0, slot - segment_starts(seg), 0)
