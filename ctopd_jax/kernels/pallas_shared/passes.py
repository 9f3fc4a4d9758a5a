"""The loss and gradient passes shared by the Pallas strict kernels (strict_full, strict_topk).

Row math (kernels/strict/row_terms.py). With a = log p_S and b = log p_T (τ applied), every divergence
except akl is a sum of elementwise terms f(a_v, b_v) (top1_ce: f is nonzero only at the
teacher's argmax column). Its gradient w.r.t. the student logits z is

    dL/dz_u = (1/τ) · (f_a(u) − p_S(u) · Σ_v f_a(v)),     f_a = ∂f/∂a elementwise,

so a kernel needs the two log-sum-exps (pass 1, online), Σ f and Σ f_a (pass 2) and then writes
the gradient (pass 3), streaming over vocabulary tiles: no [rows, V] temporaries besides the
output. The top-k kernel runs the same three passes over its k selected columns (XLA selects).
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

from ctopd_jax.kernels.pallas_shared.tiles import Tiles
from ctopd_jax.kernels.strict.row_terms import ELEMENTWISE_DIVERGENCES, terms_and_partials

PALLAS_DIVERGENCES = ELEMENTWISE_DIVERGENCES
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
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all -inf so far: avoid -inf - -inf
    s_new = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - tiles.bcast(shift)), axis=1)
    return m_new, s_new


def finish_lse(m, s):
    return jnp.where(m == -jnp.inf, -jnp.inf, m + jnp.log(s))


def divergence_passes(tiles: Tiles, zs_ref, zt_ref, w_ref, loss_ref, grad_ref, *, name: str,
                      temperature: float, kw: dict):
    """Per-row weighted loss and dense gradient of one row block, in three streaming passes.

    Every column of the rows takes part (the top-k kernel hands over its k selected columns
    only); top1_ce's teacher argmax takes the lowest column among ties.
    """
    inv_t = 1.0 / temperature
    top1 = name == "top1_ce"
    neg_inf = -jnp.inf

    def scaled(s_ref, t_ref):
        return tiles.load(s_ref) * inv_t, tiles.load(t_ref) * inv_t

    # pass 1: log-sum-exp of both rows (+ the teacher argmax column for top1_ce)
    def stats(j, s_ref, t_ref, carry):
        ms, ss, mt, st, best = carry
        s, t = scaled(s_ref, t_ref)
        ms, ss = online_lse_update(tiles, ms, ss, s)
        mt, st = online_lse_update(tiles, mt, st, t)
        if top1:
            best = _argmax_update(tiles, j, best, t)
        return ms, ss, mt, st, best

    neg, zero = tiles.row_vec(neg_inf), tiles.row_vec(0.0)
    best0 = (neg, tiles.row_vec(INT32_MAX, jnp.int32))
    ms, ss, mt, st, best = tiles.stream(stats, (zs_ref, zt_ref),
                                        init=(neg, zero, neg, zero, best0))
    lse_s, lse_t = finish_lse(ms, ss), finish_lse(mt, st)
    top_col = best[1]

    def tile_terms(j, s_ref, t_ref):
        s, t = scaled(s_ref, t_ref)
        a = s - tiles.bcast(lse_s)
        b = t - tiles.bcast(lse_t)
        is_top = tiles.cols(j) == tiles.bcast(top_col) if top1 else None
        f, f_a = kernel_terms_and_partials(name, a, b, is_top, **kw)
        return a, f, f_a

    # pass 2: Σ f (the loss) and Σ f_a (needed by the gradient of the log-softmax)
    def sums(j, s_ref, t_ref, carry):
        _, f, f_a = tile_terms(j, s_ref, t_ref)
        return carry[0] + jnp.sum(f, axis=1), carry[1] + jnp.sum(f_a, axis=1)

    loss, fa_sum = tiles.stream(sums, (zs_ref, zt_ref), init=(zero, zero))
    w = tiles.load_rows(w_ref)
    live = w != 0
    loss_ref[...] = jnp.where(live, w * jnp.where(live, loss, 0.0), 0.0)
    scale = jnp.where(live, w, 0.0) * inv_t
    live_f = jnp.where(live, 1.0, 0.0)

    # pass 3: dL/dz = (w/τ)(f_a − p_S Σ f_a), exactly 0 on rows of weight 0
    def write(j, s_ref, t_ref, g_ref, carry):
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
