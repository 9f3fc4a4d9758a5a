"""MP-OPD on device (SPEC §8): the LM-head Gram matrix per chunk of atoms and GRASS's rates,
run inside the gradient pass (algorithms/mp_opd.py; the host definitions: mp_opd_credits.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.base import shard_gather
from ctopd_jax.algorithms.mp_opd_credits import MAD_SCALE, MIN_NOISE_PAIRS, RHO

NOISE_KEY = "_mp_opd_grass_noise"   # private metric: the micro-batch's (s², updated) per sample


def segment_lower_median(values, valid, segment, num_segments: int):
    """(lower median of the valid `values` of each segment, their count); sorted by
    (segment, value), so segment k's values sit at [start_k, start_k + count_k)."""
    key = jnp.where(valid, segment, num_segments).astype(jnp.int32)
    _, ordered = jax.lax.sort((key, jnp.where(valid, values, 0.0)), num_keys=2)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), segment, num_segments=num_segments)
    start = jnp.cumsum(count) - count
    at = jnp.clip(start + (count - 1) // 2, 0, values.shape[0] - 1)
    return ordered[at], count


def grass_rates(b, w, live, span, pos, sample, span_sample, span_weight, grams, num_samples: int, noise_in):
    """GRASS on one batch shard (SPEC §8): (rates, per-sample arrays, per-chunk arrays, the
    micro-batch's (s², updated) sequence, this shard's index). `noise_in` = [ema, t] before the
    micro-batch; `num_samples` the shard's sample slots (atom_sample indexes them)."""

    num, spans, g = b.shape[0], span_weight.shape[0], grams.shape[1]
    seg = lambda x, ids, n: jax.ops.segment_sum(x, ids, num_segments=n)  # noqa: E731
    on = live > 0
    r = b / w
    # noise: adjacent in-chunk pairs (atom i and its predecessor), z, s² per sample
    prev = lambda x: jnp.concatenate([x[:1], x[:-1]])  # noqa: E731
    pair = on & prev(on) & (span == prev(span)) & (pos == prev(pos) + 1) & (jnp.arange(num) > 0)
    z = (r - prev(r)) / jnp.sqrt(1.0 / prev(w) + 1.0 / w)
    med, count = segment_lower_median(z, pair, sample, num_samples)
    mad, _ = segment_lower_median(jnp.abs(z - med[sample]), pair, sample, num_samples)
    s2 = (MAD_SCALE * mad) ** 2
    updated = (count >= MIN_NOISE_PAIRS) & (s2 > 0)
    # the sequential EMA over the whole micro-batch in sample order (block s = shard s)
    # one gather for both (fewer collectives in the step)
    both, index = shard_gather(jnp.stack([jnp.where(updated, s2, 0.0), updated.astype(jnp.float32)]))
    all_s2, all_updated = both[:, 0].reshape(-1), both[:, 1].reshape(-1) > 0

    def step(carry, x):
        ema, t = carry
        u, v = x
        ema = jnp.where(u, RHO * ema + (1.0 - RHO) * v, ema)
        t = t + u.astype(jnp.float32)
        return (ema, t), (ema, t)

    _, (ema_seq, t_seq) = jax.lax.scan(step, (noise_in[0], noise_in[1]), (all_updated, all_s2))
    ema = jax.lax.dynamic_slice(ema_seq, (index * num_samples,), (num_samples,))
    t = jax.lax.dynamic_slice(t_seq, (index * num_samples,), (num_samples,))
    sigma2 = jnp.where(t > 0, ema / (1.0 - jnp.power(jnp.float32(RHO), t)), 0.0)
    # α per chunk from D_c = dᵀHd and V_c, with chunk matrices [C, g] indexed by atom position
    n_c = seg(live, span, spans)
    big_w = seg(w * live, span, spans)
    big_b = seg(b * live, span, spans)
    safe_w = jnp.where(big_w > 0, big_w, 1.0)
    mean = big_b / safe_w
    d = (r - mean[span]) * live
    dm = jnp.zeros((spans, g), jnp.float32).at[span, pos].add(d)
    wm = jnp.ones((spans, g), jnp.float32).at[span, pos].add((w - 1.0) * live)
    hi = jax.lax.Precision.HIGHEST
    dd = jnp.einsum("ci,ci->c", jnp.einsum("ci,cij->cj", dm, grams, precision=hi), dm, precision=hi)
    diag = jnp.diagonal(grams, axis1=1, axis2=2)
    vv = sigma2[span_sample] * (jnp.sum(diag / wm, axis=1) - jnp.sum(grams, axis=(1, 2)) / safe_w)
    alpha = jnp.where(dd > 0, jnp.clip(vv / jnp.where(dd > 0, dd, 1.0), 0.0, 1.0), jnp.where(vv > 0, 1.0, 0.0))
    alpha = jnp.where(n_c > 1, alpha, 0.0)
    shrunk = r - alpha[span] * (r - mean[span])
    # conservation, chunk by chunk: Σ_c (Σ_{i∈c} w_i r̃_i − B_c) per sample
    e_c = (seg(w * shrunk * live, span, spans) - big_b) * span_weight
    err = jnp.abs(seg(e_c, span_sample, num_samples))
    scale = seg(jnp.abs(w * r) * live, sample, num_samples)
    bad = seg(jnp.where(on, ~jnp.isfinite(shrunk), False).astype(jnp.float32), sample, num_samples) > 0
    valid = seg(live, sample, num_samples) > 0
    fell = valid & (bad | (err > 1e-6 * jnp.maximum(scale, 1.0)))
    rates = jnp.where(fell[sample], r, shrunk)
    multi = (n_c > 1) & (span_weight > 0)
    return rates, {"valid": valid, "fell": fell, "sigma2": sigma2, "updated": updated}, \
        {"alpha": alpha, "multi": multi}, (all_s2, all_updated), index


def lm_head_gram(hidden, lm_head, rows, targets, pos, valid, atoms_per_chunk: int, chunk_rows: int):
    """H [C, g, g] per chunk: H_ij = Σ_{t∈i,u∈j} (δ_t·δ_u)(x_t·x_u), δ_t = p_t − e_{y_t} (full
    softmax, τ = 1), x_t the LM-head input; δ_t·δ_u = p_t·p_u − p_t[y_u] − p_u[y_t] + [y_t = y_u].
    float32 with Precision.HIGHEST, [blocks, K, V] logits at a time, symmetrised, no gradient."""
    hidden, lm_head = jax.lax.stop_gradient((hidden, lm_head))
    num, k = rows.shape
    per = max(1, min(num, chunk_rows // max(k, 1)))
    pad = (-num) % per
    padf = lambda x: jnp.pad(x, [(0, pad), (0, 0)])  # noqa: E731
    xs = tuple(padf(x).reshape(-1, per, k) for x in (rows, targets, pos, valid))
    hi = jax.lax.Precision.HIGHEST
    w32 = lm_head.astype(jnp.float32)

    def block(args):
        r, y, p_, v = args
        x = jnp.take(hidden, r, axis=0).astype(jnp.float32)              # [c, K, H]
        z = jnp.einsum("ckh,hv->ckv", x, w32, precision=hi)
        p = jax.nn.softmax(z, axis=-1)
        pp = jnp.einsum("ckv,clv->ckl", p, p, precision=hi)
        py = jnp.take_along_axis(p, jnp.broadcast_to(y[:, None, :], pp.shape), axis=2)  # p_k[y_l]
        dd = pp - py - jnp.swapaxes(py, 1, 2) + (y[:, :, None] == y[:, None, :]).astype(jnp.float32)
        xx = jnp.einsum("ckh,clh->ckl", x, x, precision=hi)
        g = dd * xx * v[:, :, None] * v[:, None, :]
        m = jax.nn.one_hot(p_, atoms_per_chunk, dtype=jnp.float32) * v[..., None]  # [c, K, g]
        h = jnp.einsum("cki,ckl,clj->cij", m, g, m, precision=hi)
        return 0.5 * (h + jnp.swapaxes(h, 1, 2))

    out = jax.lax.map(block, xs)
    return out.reshape(-1, atoms_per_chunk, atoms_per_chunk)[:num]
