"""Per-row divergences (SPEC §5), masked sums and the loss normalization of SPEC §1.

Every divergence takes student and teacher logits over the same columns (the shared vocabulary,
or the k top-k entries) and returns one float32 value per row. Decisions where SPEC is silent:

* Inputs of any float dtype are cast to float32 before dividing by the temperature; the result is
  float32. No τ² factor.
* 0·log 0 = 0 exactly: terms whose weighting probability is 0 contribute 0 to the value and to
  the gradient, also when the other side's log-probability is -inf there (logits of -inf mark
  tokens outside a row's support). A term whose weighting probability is > 0 while the other
  side's is 0 is +inf, as the mathematics says.
* `akl`: p_T is sorted ascending with a stable sort (ties keep column order), the tail is the
  prefix whose cumulative mass is <= α, the head the rest. The gap weights carry no gradient.
  When both gaps are 0 (identical rows) FKL = RKL = 0 and the loss is 0, not 0/0.
* `top1_ce`: the teacher's argmax takes the lowest column among ties.
* `tvd` differentiates |x| with sign(0) = 0.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("kl", "rkl", "jsd", "skl", "srkl", "akl", "tvd", "top1_ce")


def check_divergence_args(name: str, *, temperature: float = 1.0, jsd_beta: float = 0.5,
                          skl_lambda: float = 0.1, akl_alpha: float = 0.5) -> None:
    """Raise one clear ValueError for a bad divergence name or parameter (before any work).

    The one place for these ranges (SPEC §5): config validation calls it too. Messages start
    with the setting's name (`jsd_beta=...`) so the config can prefix its section."""
    if name not in DIVERGENCES:
        raise ValueError(f"kd_loss_fn={name!r} is not a known divergence; use one of {DIVERGENCES}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"kd_temperature={temperature} must be a finite number > 0")
    for field, value in (("jsd_beta", jsd_beta), ("skl_lambda", skl_lambda),
                         ("akl_alpha", akl_alpha)):
        if not 0.0 < value < 1.0:
            raise ValueError(f"{field}={value} must be strictly inside (0, 1)")


def _kl_terms(log_p, log_q):
    """Elementwise p (log p − log q) with 0·log 0 = 0 and NaN-free gradients at p = 0."""
    p = jnp.exp(log_p)
    support = p > 0
    safe_lp = jnp.where(support, log_p, 0.0)
    safe_lq = jnp.where(support, log_q, 0.0)
    return jnp.where(support, p * (safe_lp - safe_lq), 0.0)


def kl_rows(log_p, log_q):
    """KL(p ‖ q) per row from log-probabilities."""
    return jnp.sum(_kl_terms(log_p, log_q), axis=-1)


def _log_mix(log_a, log_b, weight_a: float):
    """log(w·a + (1−w)·b), exact at w ∈ {0, 1} and at a = b = 0."""
    if weight_a == 0.0:
        return log_b
    if weight_a == 1.0:
        return log_a
    # Where both sides are -inf the mixture is -inf too; feed logaddexp finite stand-ins there
    # so its gradient (exp(-inf - -inf)) cannot turn the zero cotangent into NaN.
    both_zero = jnp.isneginf(log_a) & jnp.isneginf(log_b)
    safe_a = jnp.where(both_zero, 0.0, log_a)
    safe_b = jnp.where(both_zero, 0.0, log_b)
    mixed = jnp.logaddexp(safe_a + math.log(weight_a), safe_b + math.log1p(-weight_a))
    return jnp.where(both_zero, -jnp.inf, mixed)


def _akl_rows(log_ps, log_pt, alpha: float):
    ps = jnp.exp(log_ps)
    pt = jnp.exp(log_pt)
    order = jnp.argsort(pt, axis=-1, stable=True)
    pt_sorted = jnp.take_along_axis(pt, order, axis=-1)
    ps_sorted = jnp.take_along_axis(ps, order, axis=-1)
    tail = jnp.cumsum(pt_sorted, axis=-1) <= alpha
    gap = jax.lax.stop_gradient(jnp.abs(pt_sorted - ps_sorted))
    g_tail = jnp.sum(jnp.where(tail, gap, 0.0), axis=-1)
    g_head = jnp.sum(jnp.where(tail, 0.0, gap), axis=-1)
    fkl = kl_rows(log_pt, log_ps)
    rkl = kl_rows(log_ps, log_pt)
    total = g_head + g_tail
    safe_total = jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, (g_head * fkl + g_tail * rkl) / safe_total, 0.0)


def divergence_from_logprobs(name: str, log_ps, log_pt, *, jsd_beta: float = 0.5,
                             skl_lambda: float = 0.1, akl_alpha: float = 0.5):
    """Per-row divergence from float32 log-probabilities (already normalised, τ applied)."""
    if name == "kl":
        return kl_rows(log_pt, log_ps)
    if name == "rkl":
        return kl_rows(log_ps, log_pt)
    if name == "jsd":
        log_m = _log_mix(log_ps, log_pt, jsd_beta)
        return jsd_beta * kl_rows(log_ps, log_m) + (1.0 - jsd_beta) * kl_rows(log_pt, log_m)
    if name == "skl":
        return kl_rows(log_pt, _log_mix(log_pt, log_ps, skl_lambda))
    if name == "srkl":
        return kl_rows(log_ps, _log_mix(log_ps, log_pt, skl_lambda))
    if name == "akl":
        return _akl_rows(log_ps, log_pt, akl_alpha)
    if name == "tvd":
        return 0.5 * jnp.sum(jnp.abs(jnp.exp(log_ps) - jnp.exp(log_pt)), axis=-1)
    if name == "top1_ce":
        top = jnp.argmax(log_pt, axis=-1)[..., None]  # lowest column among ties
        p_top = jnp.exp(jnp.take_along_axis(log_pt, top, axis=-1))[..., 0]
        log_ps_top = jnp.take_along_axis(log_ps, top, axis=-1)[..., 0]
        return -p_top * log_ps_top
    raise ValueError(f"kd_loss_fn={name!r} is not a known divergence; use one of {DIVERGENCES}")


def log_softmax_f32(logits, temperature: float = 1.0):
    """float32 log-softmax of logits / τ along the last axis."""
    z = logits.astype(jnp.float32)
    if temperature != 1.0:
        z = z / temperature
    return jax.nn.log_softmax(z, axis=-1)


def divergence(name: str, student_logits, teacher_logits, *, temperature: float = 1.0,
               jsd_beta: float = 0.5, skl_lambda: float = 0.1, akl_alpha: float = 0.5):
    """Per-row divergence D(p_S, p_T) of SPEC §5 on logits [..., V]; returns float32 [...].

    The teacher side is treated as a constant (stop_gradient), as SPEC §4 requires.
    """
    check_divergence_args(name, temperature=temperature, jsd_beta=jsd_beta,
                          skl_lambda=skl_lambda, akl_alpha=akl_alpha)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {student_logits.shape} and teacher_logits "
                         f"{teacher_logits.shape} must have the same shape (project both to V∩)")
    log_ps = log_softmax_f32(student_logits, temperature)
    log_pt = jax.lax.stop_gradient(log_softmax_f32(teacher_logits, temperature))
    return divergence_from_logprobs(name, log_ps, log_pt, jsd_beta=jsd_beta,
                                    skl_lambda=skl_lambda, akl_alpha=akl_alpha)


def masked_rows(per_row, row_weight):
    """w_r · d_r in float32; rows with weight 0 are exactly 0 (value and gradient) even if d_r
    is inf/nan there."""
    w = row_weight.astype(jnp.float32)
    live = w != 0
    return jnp.where(live, w * jnp.where(live, per_row, 0.0), 0.0)


def masked_sum(per_row, row_weight):
    """Σ_r w_r · d_r in float32 (see masked_rows)."""
    return jnp.sum(masked_rows(per_row, row_weight))


def normalized_loss(sum_loss, total_student_response_tokens, num_micro_batches: int = 1,
                    accumulation_steps: int = 1):
    """SPEC §1: a micro-batch's summed loss ÷ (global response tokens / micro-batches) ÷ steps.

    `total_student_response_tokens` counts ALL student response tokens (EOS included) of the
    global batch, aligned or not. With one micro-batch and one step this is sum / total. Summing
    the returned values of the `num_micro_batches` micro-batches of a global batch (with
    `accumulation_steps == num_micro_batches`) equals the global sum / total. A batch with zero
    response tokens has loss 0 (its sum is 0 too) rather than 0/0.
    """
    if num_micro_batches < 1 or accumulation_steps < 1:
        raise ValueError("num_micro_batches and accumulation_steps must be >= 1")
    total = jnp.asarray(total_student_response_tokens, jnp.float32)
    per_micro = total / num_micro_batches
    safe = jnp.where(per_micro > 0, per_micro, 1.0)
    return jnp.where(per_micro > 0, sum_loss / safe, 0.0) / accumulation_steps


def token_ce_sum(logits, targets, mask):
    """Σ over masked positions of −log softmax(logits)[target], float32 (the CE of kd_ratio)."""
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_p, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return masked_sum(nll, mask)


def mix_kd_ce(kd_loss, ce_loss, kd_ratio: float):
    """(1 − kd_ratio)·CE + kd_ratio·KD; kd_ratio = 1 skips the CE term exactly."""
    if not 0.0 <= kd_ratio <= 1.0:
        raise ValueError(f"kd_ratio={kd_ratio} must be in [0, 1]")
    if kd_ratio == 1.0:
        return kd_loss
    if kd_ratio == 0.0:
        return ce_loss
    return (1.0 - kd_ratio) * ce_loss + kd_ratio * kd_loss
