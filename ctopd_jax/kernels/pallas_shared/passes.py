"""The loss and gradient passes shared by the Pallas strict kernels (strict_full, strict_topk).

Row math (kernels/strict/row_terms.py). With a = log p_S and b = log p_T (τ applied), every
divergence except akl is a sum of elementwise terms f(a_v, b_v) (top1_ce: f is nonzero only at
the teacher's argmax column). Its gradient w.r.t. the student logits z is

    dL/dz_u = (1/τ) · (f_a(u) − p_S(u) · Σ_v f_a(v)),     f_a = ∂f/∂a elementwise,

so a kernel needs the two log-sum-exps (pass 1, online), Σ f and Σ f_a (pass 2) and then writes
the gradient (pass 3), streaming over vocabulary tiles: no [rows, V] temporaries besides the
output. kl and rkl skip pass 2 (ONLINE_SUM). The top-k kernel runs the same passes over its
k selected columns (XLA selects).
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

from ctopd_jax.kernels.pallas_shared.tiles import Tiles, kernel_mode, pad_blocks, strict_pallas_call
from ctopd_jax.kernels.strict.row_terms import ELEMENTWISE_DIVERGENCES, terms_and_partials

PALLAS_DIVERGENCES = ELEMENTWISE_DIVERGENCES
# Divergences whose Σ f is an expectation pass 1 accumulates online (E_p[x − y] minus the
# difference of the log-sum-exps), so their rows are streamed twice, not three times: every
# row is read 4 times and written once instead of read 6 times (the bytes bound the kernel).
ONLINE_SUM = ("kl", "rkl")
INT32_MAX = 2 ** 31 - 1


def _log1p(y):
    """log(1 + y) to float32 accuracy from log alone (u = 1 + y rounded; exact where u == 1)."""
    u = 1.0 + y
    return jnp.where(u == 1.0, y, jnp.log(u) * (y / jnp.where(u == 1.0, 1.0, u - 1.0)))


def _eval_inlined(jaxpr, consts, *args):
    """Evaluate a jaxpr with nested calls inlined and the primitives Mosaic GPU lacks rewritten.

    Forward-mode differentiation leaves `add_any` (tangent sums) and `custom_jvp_call`
    (logaddexp), and logaddexp calls `log1p`: none of them has a Mosaic GPU lowering rule.
    """
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if name == "add_any":
            out = [jax.lax.add(*vals)]
        elif name == "log1p":
            out = [_log1p(vals[0])]
        elif inner is not None and name in ("jit", "pjit", "custom_jvp_call", "closed_call"):
            closed = inner if hasattr(inner, "jaxpr") else jax.extend.core.ClosedJaxpr(inner, ())
            out = _eval_inlined(closed.jaxpr, closed.consts, *vals)
        else:
            out = eqn.primitive.bind(*vals, **eqn.params)
            out = out if eqn.primitive.multiple_results else [out]
        for v, x in zip(eqn.outvars, out):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def kernel_terms_and_partials(name: str, a, b, is_top, **kw):
    """row_terms.terms_and_partials, inlined into primitives that Mosaic GPU lowers."""
    if is_top is None:
        fn = lambda a, b: terms_and_partials(name, a, b, None, **kw)  # noqa: E731
        args = (a, b)
    else:
        fn = lambda a, b, top: terms_and_partials(name, a, b, top, **kw)  # noqa: E731
        args = (a, b, is_top)
    closed = jax.make_jaxpr(fn)(*args)
    return tuple(_eval_inlined(closed.jaxpr, closed.consts, *args))


def online_lse_update(tiles: Tiles, m, s, x):
    """One step of a streaming log-sum-exp over the columns: (max, Σ exp(x − max))."""
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    shift = _finite(m_new)  # all -inf so far: avoid -inf - -inf
    s_new = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - tiles.bcast(shift)), axis=1)
    return m_new, s_new


def _finite(m):
    return jnp.where(m == -jnp.inf, 0.0, m)


def online_expectation_update(tiles: Tiles, acc, x, y, mx, sx, mx_new, my, my_new):
    """One step of acc = Σ exp(x − mx) · ((x − mx) − (y − my)) over the columns seen, mx and my
    the running maxima of the two rows (sx = Σ exp(x − mx) before this tile).

    A new maximum shifts every term seen so far by a constant, so acc first moves by
    −sx · (Δmx − Δmy), then rescales like sx. Measuring both rows from their own maxima keeps
    the terms at the size of the logits' spread, not of their offsets, so float32 keeps a small
    divergence between far-apart logits. A term whose exp(x − mx) is 0 counts 0 (0 · log 0).
    """
    hx, hy, hx_new, hy_new = _finite(mx), _finite(my), _finite(mx_new), _finite(my_new)
    rescale = jnp.exp(mx - hx_new)
    seen = jnp.where(rescale > 0, (acc - sx * ((hx_new - hx) - (hy_new - hy))) * rescale, 0.0)
    x_rel = x - tiles.bcast(hx_new)
    e = jnp.exp(x_rel)
    terms = jnp.where(e > 0, e * (x_rel - (y - tiles.bcast(hy_new))), 0.0)
    return seen + jnp.sum(terms, axis=1)


def finish_lse(m, s):
    return jnp.where(m == -jnp.inf, -jnp.inf, m + jnp.log(s))


def divergence_passes(tiles: Tiles, zs_ref, zt_ref, w_ref, loss_ref, grad_ref, *, name: str,
                      temperature: float, kw: dict):
    """Per-row weighted loss and dense gradient of one row block, in three streaming passes
    (two for kl and rkl, see ONLINE_SUM).

    Every column of the rows takes part (the top-k kernel hands over its k selected columns
    only); top1_ce's teacher argmax takes the lowest column among ties.
    """
    inv_t = 1.0 / temperature
    top1 = name == "top1_ce"
    neg_inf = -jnp.inf

    def scaled(s_ref, t_ref):
        return tiles.load(s_ref) * inv_t, tiles.load(t_ref) * inv_t

    # pass 1: log-sum-exp of both rows (+ the teacher argmax column for top1_ce; + for kl and
    # rkl the running Σ exp(x − max)·(x − y) of the side their expectation is over)
    def stats(j, s_ref, t_ref, carry):
        ms, ss, mt, st, best, acc = carry
        s, t = scaled(s_ref, t_ref)
        ms_new, ss_new = online_lse_update(tiles, ms, ss, s)
        mt_new, st_new = online_lse_update(tiles, mt, st, t)
        if name == "rkl":     # E_pS[(s − ms) − (t − mt)]
            acc = online_expectation_update(tiles, acc, s, t, ms, ss, ms_new, mt, mt_new)
        elif name == "kl":    # E_pT[(t − mt) − (s − ms)]
            acc = online_expectation_update(tiles, acc, t, s, mt, st, mt_new, ms, ms_new)
        if top1:
            best = _argmax_update(tiles, j, best, t)
        return ms_new, ss_new, mt_new, st_new, best, acc

    neg, zero = tiles.row_vec(neg_inf), tiles.row_vec(0.0)
    best0 = (neg, tiles.row_vec(INT32_MAX, jnp.int32))
    ms, ss, mt, st, best, acc = tiles.stream(stats, (zs_ref, zt_ref),
                                             init=(neg, zero, neg, zero, best0, zero))
    lse_s, lse_t = finish_lse(ms, ss), finish_lse(mt, st)
    top_col = best[1]

    def tile_terms(j, s_ref, t_ref):
        s, t = scaled(s_ref, t_ref)
        a = s - tiles.bcast(lse_s)
        b = t - tiles.bcast(lse_t)
        is_top = tiles.cols(j) == tiles.bcast(top_col) if top1 else None
        f, f_a = kernel_terms_and_partials(name, a, b, is_top, **kw)
        return a, f, f_a

    # pass 2: Σ f (the loss) and Σ f_a (needed by the gradient of the log-softmax); kl and rkl
    # have both from pass 1 already (ONLINE_SUM)
    def sums(j, s_ref, t_ref, carry):
        _, f, f_a = tile_terms(j, s_ref, t_ref)
        return carry[0] + jnp.sum(f, axis=1), carry[1] + jnp.sum(f_a, axis=1)

    # with lse = m + log Σ exp(x − m): RKL = E_pS[(s − ms) − (t − mt)] − log ss + log st
    if name == "rkl":    # Σ f_a = Σ p_S (a − b + 1) = RKL + 1
        loss = acc / ss - jnp.log(ss) + jnp.log(st)
        fa_sum = loss + 1.0
    elif name == "kl":   # Σ f_a = −Σ p_T = −1
        loss = acc / st - jnp.log(st) + jnp.log(ss)
        fa_sum = tiles.row_vec(-1.0)
    else:
        loss, fa_sum = tiles.stream(sums, (zs_ref, zt_ref), init=(zero, zero))
    w = tiles.load_rows(w_ref)
    live = w != 0
    loss_ref[...] = jnp.where(live, w * jnp.where(live, loss, 0.0), 0.0)
    scale = jnp.where(live, w, 0.0) * inv_t
    live_f = jnp.where(live, 1.0, 0.0)

    # pass 3: dL/dz = (w/τ)(f_a − p_S Σ f_a), exactly 0 on rows of weight 0
    def write(j, s_ref, t_ref, g_ref, carry):
        if name == "rkl":   # p_S (a − b − RKL) = p_S (d − E_pS[d]) with d measured from the
            # maxima as in pass 1, so a rounding of the log-sum-exps cannot shift d against E[d]
            s, t = scaled(s_ref, t_ref)
            p = jnp.exp(s - tiles.bcast(lse_s))
            x = s - tiles.bcast(_finite(ms))
            d = jnp.where(p > 0, x - jnp.where(p > 0, t - tiles.bcast(_finite(mt)), 0.0), 0.0)
            g = tiles.bcast(scale) * p * (d - tiles.bcast(acc / ss))
        else:
            a, _, f_a = tile_terms(j, s_ref, t_ref)
            g = tiles.bcast(scale) * (f_a - jnp.exp(a) * tiles.bcast(fa_sum))
        g_ref[...] = jnp.where(tiles.bcast(live_f) != 0, g, 0.0)
        return carry

    tiles.stream(write, (zs_ref, zt_ref), (grad_ref,), init=zero)


def _argmax_update(tiles: Tiles, j, best, t):
    """Running teacher argmax (value, column), the lowest column first among ties."""
    best_v, best_c = best
    t_max = jnp.max(t, axis=1)
    col = jnp.min(jnp.where(t == tiles.bcast(t_max), tiles.cols(j), INT32_MAX), axis=1)
    better = (t_max > best_v) | ((t_max == best_v) & (col < best_c))
    return jnp.where(better, t_max, best_v), jnp.where(better, col, best_c)


def divergence_rows(zs_bar, zt_bar, w, *, divergence: str, temperature: float, kw: dict,
                    interpret: bool, block_rows: int, block_cols: int, mode, name: str):
    """(loss, gradient) of `divergence_passes` over the rows padded to blocks, one Pallas call:
    both still padded (the callers cut them to their rows and columns)."""
    zs, zt, wp, tile = pad_blocks(zs_bar, zt_bar, w, block_rows, block_cols)
    tiles = Tiles(block_rows, tile, zs.shape[1] // tile, mode or kernel_mode(interpret))

    def kernel(zs_ref, zt_ref, w_ref, loss_ref, grad_ref):
        divergence_passes(tiles, zs_ref, zt_ref, w_ref, loss_ref, grad_ref, name=divergence,
                          temperature=float(temperature), kw=kw)

    return strict_pallas_call(kernel, zs, zt, wp, tiles=tiles, name=name)
