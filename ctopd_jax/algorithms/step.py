"""Device side of one optimizer step: teacher scoring, student micro-batch gradients, update.

Everything here is a pure function of arrays, compiled once per bucketed shape:
- `teacher_scores`: teacher prefill over its tokens (no gradient), hidden states gathered at the
  strict teacher rows, lm_head applied per row chunk and only the V∩ columns kept -> [R, V∩].
  The rows stay on the device and go straight into the student step.
- `micro_grad`: student forward, the algorithm's KD sum, the CE sum over all response rows
  (also the log-prob diagnostics), the SPEC §1 normalization, and d(loss)/d(params).
- `apply_update`: optax update; a non-finite loss or gradient norm leaves params and optimizer
  state unchanged (the host then stops the run, see trainer.py).

Normalization (SPEC §1): with A micro-batches per optimizer batch and N student response tokens
(EOS included) in that batch, each micro-batch contributes
    mix(KD_sum, CE_sum) / (N / A) / A
so the accumulated loss and gradient equal those of the whole batch at once: Σ / N.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ctopd_jax import losses


def _row_chunked(fn, rows, chunk: int):
    """Apply fn to row chunks of `rows` [R, ...] (R a multiple of chunk after padding) and concat."""
    r = rows.shape[0]
    chunk = max(1, min(chunk, r))
    pad = (-r) % chunk
    if pad:
        rows = jnp.concatenate([rows, jnp.zeros((pad,) + rows.shape[1:], rows.dtype)])
    out = jax.lax.map(jax.checkpoint(fn), rows.reshape((-1, chunk) + rows.shape[1:]))
    return out.reshape((-1,) + out.shape[2:])[:r]


def token_logprobs(hidden_flat, lm_head, rows, targets, chunk: int):
    """log softmax(student logits)[target] at the given flat rows, float32 [R], chunked over rows."""
    h = jnp.take(hidden_flat, rows, axis=0)
    w = lm_head.astype(h.dtype)

    def one(pair):
        hc, tc = pair
        logits = jnp.einsum("rh,hv->rv", hc, w, preferred_element_type=jnp.float32)
        return jnp.take_along_axis(logits, tc[:, None], axis=1)[:, 0] - jax.nn.logsumexp(logits, axis=1)

    r = h.shape[0]
    c = max(1, min(chunk, r))
    pad = (-r) % c
    if pad:
        h = jnp.concatenate([h, jnp.zeros((pad, h.shape[1]), h.dtype)])
        targets = jnp.concatenate([targets, jnp.zeros((pad,), targets.dtype)])
    out = jax.lax.map(jax.checkpoint(one), (h.reshape(-1, c, h.shape[1]), targets.reshape(-1, c)))
    return out.reshape(-1)[:r]


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "out_dtype"))
def teacher_scores(graphdef, state, batch, t_ids, *, chunk: int, out_dtype=jnp.float32):
    """[R, V∩] teacher logits at the strict teacher rows (constant: no gradient flows here)."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(state))
    hidden = model.hidden_states(batch["teacher_ids"], batch["teacher_positions"], batch["teacher_mask"])
    hidden_flat = hidden.reshape(-1, hidden.shape[-1])
    rows = jnp.take(hidden_flat, batch["strict_teacher_rows"], axis=0)
    w_shared = jnp.take(model.lm_head_weight(), t_ids, axis=1).astype(rows.dtype)  # [H, V∩]

    def one(hc):
        return jnp.einsum("rh,hv->rv", hc, w_shared, preferred_element_type=jnp.float32).astype(out_dtype)

    return _row_chunked(one, rows, chunk)


def micro_loss(params, graphdef, rest, batch, teacher_rows, overlap, total_tokens, accumulation: int,
               algorithm, kd_ratio: float, chunk: int):
    model = nnx.merge(graphdef, params, rest)
    hidden = model.hidden_states(batch["student_ids"], batch["student_positions"], batch["student_mask"])
    hidden_flat = hidden.reshape(-1, hidden.shape[-1])
    lm_head = model.lm_head_weight()
    kd_sum = algorithm.kd_sum(hidden_flat, lm_head, batch, teacher_rows, overlap)
    if kd_ratio < 1.0:
        logp = token_logprobs(hidden_flat, lm_head, batch["response_rows"], batch["response_targets"], chunk)
    else:  # CE only as a diagnostic: no gradient work for it
        logp = token_logprobs(jax.lax.stop_gradient(hidden_flat), jax.lax.stop_gradient(lm_head),
                              batch["response_rows"], batch["response_targets"], chunk)
    ce_sum = losses.masked_sum(-logp, batch["response_weight"])
    loss_sum = losses.mix_kd_ce(kd_sum, ce_sum, kd_ratio)
    loss = losses.normalized_loss(loss_sum, total_tokens, accumulation, accumulation)
    lp_w = batch["rollout_logprob_weight"]
    aux = {
        "kd_sum": jax.lax.stop_gradient(kd_sum),
        "ce_sum": jax.lax.stop_gradient(ce_sum),
        "logprob_gap_sum": jnp.sum(lp_w * jnp.abs(batch["rollout_logprobs"] - jax.lax.stop_gradient(logp))),
        "logprob_gap_count": jnp.sum(lp_w),
    }
    return loss, aux


@functools.partial(jax.jit, static_argnames=("graphdef", "accumulation", "algorithm", "kd_ratio", "chunk"))
def micro_grad(params, rest, batch, teacher_rows, overlap, total_tokens, *, graphdef, accumulation: int,
               algorithm, kd_ratio: float, chunk: int):
    fn = functools.partial(micro_loss, graphdef=graphdef, rest=rest, batch=batch, teacher_rows=teacher_rows,
                           overlap=overlap, total_tokens=total_tokens, accumulation=accumulation,
                           algorithm=algorithm, kd_ratio=kd_ratio, chunk=chunk)
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss, aux, grads


@jax.jit
def add_trees(a, b):
    return jax.tree.map(jnp.add, a, b)


def make_apply_update(tx: optax.GradientTransformation, schedule, donate: bool = False):
    def apply_update(params, opt_state, grads, loss, update_count):
        """`update_count`: updates applied before this one (what the schedule is evaluated at)."""
        grad_norm = optax.tree.norm(grads) if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm(grads)
        ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        lr = schedule(update_count)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        return keep(new_params, params), keep(new_opt_state, opt_state), {"grad_norm": grad_norm, "lr": lr,
                                                                         "update_applied": ok}

    return jax.jit(apply_update, donate_argnums=(0, 1) if donate else ())


def scalar(x: Any) -> float:
    """Host float of a (possibly globally sharded, replicated) scalar array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(jax.device_get(x))
