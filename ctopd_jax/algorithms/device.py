"""Device side of one optimizer step: the student micro-batch gradient and the update.

Pure functions of arrays, compiled once per bucketed shape:
- `micro_grad`: student forward, the objective's sums (plus CE), the SPEC §1 normalization of
  Σ_k weight_k · sum_k, and d(loss)/d(params). The teacher arrives as hidden rows
  (teacher.teacher_hidden_rows) and its lm_head; every teacher column is computed beside the
  student's, chunk by chunk.
- `apply_update`: optax update; a non-finite loss or gradient norm leaves params and optimizer
  state unchanged (the host then stops the run, see trainer.py).

Normalization (SPEC §1): with A micro-batches per optimizer batch and N student response tokens
(EOS included) in that batch, each micro-batch contributes Σ / (N / A) / A, so the accumulated
loss and gradient equal those of the whole batch at once: Σ / N.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ctopd_jax import losses
from ctopd_jax.models.kv_cache import prefill_positions


def objective_sums(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, *, graphdef, objective):
    """(sums, metrics) of the objective on one micro-batch (differentiable in params)."""
    model = nnx.merge(graphdef, params, rest)
    mask = batch["student_mask"]
    hidden = model.hidden_states(batch["student_ids"], prefill_positions(mask), mask)
    flat = hidden.reshape(-1, hidden.shape[-1])
    return objective.loss_sums(flat, model.lm_head_weight(), teacher_hidden, teacher_lm_head, batch, overlap)


def weighted_sum(sums: dict, weights: dict):
    """Σ_k weight_k · sum_k over the sums with a non-zero weight (a zero-weight sum adds
    exactly nothing, not 0 · inf)."""
    return sum((w * sums[k] for k, w in weights.items() if w != 0.0), jnp.zeros((), jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "accumulation", "objective"))
def micro_grad(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens, *,
               graphdef, accumulation: int, objective):
    def loss_fn(p):
        sums, metrics = objective_sums(p, rest, batch, teacher_hidden, teacher_lm_head, overlap,
                                       graphdef=graphdef, objective=objective)
        loss_sum = weighted_sum(sums, objective.loss_weights())
        loss = losses.normalized_loss(loss_sum, total_tokens, accumulation, accumulation)
        return loss, (jax.lax.stop_gradient(sums), jax.lax.stop_gradient(metrics))

    (loss, (sums, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, sums, metrics, grads


@jax.jit
def add_trees(a, b):
    return jax.tree.map(jnp.add, a, b)


def global_norm(tree):
    return optax.tree.norm(tree) if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm(tree)


def make_apply_update(tx: optax.GradientTransformation, schedule, donate: bool = False):
    def apply_update(params, opt_state, grads, loss, update_count):
        """`update_count`: updates applied before this one (what the schedule is evaluated at)."""
        grad_norm = global_norm(grads)
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
