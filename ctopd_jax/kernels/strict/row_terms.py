"""Divergences as sums of elementwise terms, with their partial derivatives.

With a = log p_S and b = log p_T (τ applied), every divergence except akl is Σ_v f(a_v, b_v)
(top1_ce: f is nonzero only at the teacher's argmax column, given as `is_top`). Its gradient
w.r.t. the student logits z is

    dL/dz_u = (1/τ) · (f_a(u) − p_S(u) · Σ_v f_a(v)),     f_a = ∂f/∂a elementwise,

which the XLA chunk function and the Pallas kernels both use instead of reverse-mode autodiff:
one streaming pass for the two log-sum-exps, one for Σ f and Σ f_a, one writing the gradient.
f_a is the forward-mode derivative of the same elementwise code, and that code is built from
ctopd_jax.kernels.losses' helpers, so the divergence definitions live in one place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ctopd_jax.kernels import losses

ELEMENTWISE_DIVERGENCES = ("kl", "rkl", "jsd", "skl", "srkl", "tvd", "top1_ce")


def elementwise_terms(name: str, a, b, is_top, *, jsd_beta: float, skl_lambda: float):
    """f(a, b) elementwise for one divergence (see module docstring); float32 arrays."""
    if name == "kl":
        return losses._kl_terms(b, a)
    if name == "rkl":
        return losses._kl_terms(a, b)
    if name == "jsd":
        log_m = losses._log_mix(a, b, jsd_beta)
        return jsd_beta * losses._kl_terms(a, log_m) + (1 - jsd_beta) * losses._kl_terms(b, log_m)
    if name == "skl":
        return losses._kl_terms(b, losses._log_mix(b, a, skl_lambda))
    if name == "srkl":
        return losses._kl_terms(a, losses._log_mix(a, b, skl_lambda))
    if name == "tvd":
        return 0.5 * jnp.abs(jnp.exp(a) - jnp.exp(b))
    if name == "top1_ce":
        safe_a = jnp.where(is_top, a, 0.0)
        return jnp.where(is_top, -jnp.exp(b) * safe_a, 0.0)
    raise ValueError(f"divergence {name!r} is not a sum of elementwise terms; "
                     f"use one of {ELEMENTWISE_DIVERGENCES}")


def terms_and_partials(name: str, a, b, is_top, **kw):
    """(f, ∂f/∂a) elementwise, by forward-mode differentiation of elementwise_terms."""
    return jax.jvp(lambda x: elementwise_terms(name, x, b, is_top, **kw), (a,),
                   (jnp.ones_like(a),))
