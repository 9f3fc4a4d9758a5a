"""Device side of one optimizer step: the student micro-batch gradient and the update.

Pure functions of arrays, compiled once per bucketed shape:
- `micro_grad`: student forward, the objective's sums (plus CE), the SPEC §1 normalization of
  Σ_k weight_k · sum_k, and d(loss)/d(params). The teacher arrives as hidden rows
  (teacher.teacher_hidden_rows) and its lm_head; every teacher column is computed beside the
  student's, chunk by chunk.
- `apply_update`: optax update; a non-finite loss or gradient norm leaves params and optimizer
  state unchanged (the host then stops the run, see trainer.py).

`micro_grad` runs three programs: the student's layers forward (`student_forward`, compiled per
shape of the student's tokens), the objective and its gradient at the final hidden states
(`objective_grad`, per shape of the whole micro-batch), and the layers' backward
(`student_backward`, once per forward program). As the answers shorten the loss rows change
bucket far more often than the token rows do, and each such change now recompiles the
objective alone (~1 s on the real CPU pair) instead of the whole step (~5 s): the gradient is
bit-identical (the same operations, cut at the hidden states; step/pullback.py).

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

from ctopd_jax.kernels import losses
from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.step import pullback
from ctopd_jax.step.shards import per_shard


def student_hidden(params, rest, ids, mask, *, graphdef, dropout=None):
    """(final hidden states [B, T, H], lm_head weight) of the student on a micro-batch's
    tokens. `dropout` (lora.Dropout): LoRA dropout in the forward (training steps only)."""
    model = nnx.merge(graphdef, params, rest)
    return model.hidden_states(ids, prefill_positions(mask), mask, lora_dropout=dropout), model.lm_head_weight()


def hidden_sums(hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap, *, objective, mesh=None):
    """(sums, metrics) of the objective at the student's hidden states. With a mesh the
    objective runs per batch shard on that shard's rows, so no row of hidden states, logits or
    teacher columns moves between devices: only the lm_heads are gathered."""
    def local(hidden, teacher_hidden, batch, lm_head, teacher_lm_head, overlap):
        flat = hidden.reshape(-1, hidden.shape[-1])
        return objective.loss_sums(flat, lm_head, teacher_hidden, teacher_lm_head, batch, overlap)

    return per_shard(local, mesh, 3, 3)(hidden, teacher_hidden, batch, lm_head, teacher_lm_head, overlap)


def objective_sums(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, *, graphdef, objective,
                   mesh=None, dropout=None):
    """(sums, metrics) of the objective on one micro-batch (differentiable in params)."""
    hidden, lm_head = student_hidden(params, rest, batch.student_ids, batch.student_mask, graphdef=graphdef,
                                     dropout=dropout)
    return hidden_sums(hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap, objective=objective,
                       mesh=mesh)


def weighted_sum(sums: dict, weights: dict):
    """Σ_k weight_k · sum_k over the sums with a non-zero weight (a zero-weight sum adds
    exactly nothing, not 0 · inf)."""
    return sum((w * sums[k] for k, w in weights.items() if w != 0.0), jnp.zeros((), jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def student_forward(params, rest, ids, mask, dropout, *, graphdef):
    """(hidden, lm_head, Pullback to params): the layers' forward, its residuals kept."""
    arguments = (params, rest, ids, mask, dropout)
    (hidden, lm_head), back = pullback.vjp(
        lambda p: student_hidden(p, rest, ids, mask, graphdef=graphdef, dropout=dropout), params, arguments)
    return hidden, lm_head, back


@functools.partial(jax.jit, static_argnames=("accumulation", "objective", "mesh"))
def objective_grad(hidden, lm_head, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens, *,
                   accumulation: int, objective, mesh=None):
    """(loss, sums, metrics, d loss / d (hidden, lm_head)) of one micro-batch."""
    def loss_fn(hidden, lm_head):
        sums, metrics = hidden_sums(hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap,
                                    objective=objective, mesh=mesh)
        loss_sum = weighted_sum(sums, objective.loss_weights())
        loss = losses.normalized_loss(loss_sum, total_tokens, accumulation, accumulation)
        return loss, (jax.lax.stop_gradient(sums), jax.lax.stop_gradient(metrics))

    (loss, (sums, metrics)), cotangent = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(hidden, lm_head)
    return loss, sums, metrics, cotangent


@functools.partial(jax.jit, donate_argnames=("grads_sum",))
def student_backward(forward_args, back, cotangent, grads_sum):
    """grads_sum + d loss / d params, from the forward's pullback and the objective's cotangent
    (`forward_args`: the forward's arguments, which the pullback reads again)."""
    grads, = back(forward_args, cotangent)
    return jax.tree.map(jnp.add, grads_sum, grads)


def micro_grad(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens, grads_sum, *,
               graphdef, accumulation: int, objective, mesh=None, dropout=None):
    """(loss, sums, metrics, grads_sum + d loss / d params) of one micro-batch.

    `grads_sum` is the running gradient of the optimizer batch: it is added inside the step
    and DONATED, so accumulation keeps one gradient buffer (no host-side tree additions, no
    second copy). Start it with `zero_grads(params)`. `mesh`: given when the micro-batch arrays
    are stacked per batch shard (shards.stack_shards). `dropout` (lora.Dropout, from
    lora.train_dropout): LoRA dropout of this micro-batch; its rate is static (pytree aux data),
    its key an ordinary argument.

    Then, on the host, the objective's `after_micro_batch(metrics)`: an objective with
    run-state statistics takes them (already combined over the batch shards) out of the
    metrics and updates its state once per micro-batch, in order (MP-OPD's GRASS noise EMA), so
    no host callback runs inside the sharded loss."""
    forward_args = (params, rest, batch.student_ids, batch.student_mask, dropout)
    hidden, lm_head, back = student_forward(*forward_args, graphdef=graphdef)
    loss, sums, metrics, cotangent = objective_grad(hidden, lm_head, batch, teacher_hidden, teacher_lm_head,
                                                    overlap, total_tokens, accumulation=accumulation,
                                                    objective=objective, mesh=mesh)
    grads = student_backward(forward_args, back, cotangent, grads_sum)
    return loss, sums, objective.after_micro_batch(metrics), grads


STEP_PROGRAMS = (student_forward, objective_grad, student_backward)


def lower_micro_grad(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens, grads_sum, *,
                     graphdef, accumulation: int, objective, mesh=None, dropout=None) -> list:
    """The three programs of `micro_grad`, lowered (jax `Lowered`) at these arguments without
    running them: for FLOP counts and HLO checks."""
    forward_args = (params, rest, batch.student_ids, batch.student_mask, dropout)
    hidden, lm_head, back = jax.eval_shape(functools.partial(student_forward, graphdef=graphdef), *forward_args)
    objective_args = (hidden, lm_head, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens)
    _, _, _, cotangent = jax.eval_shape(functools.partial(objective_grad, accumulation=accumulation,
                                                          objective=objective, mesh=mesh), *objective_args)
    return [student_forward.lower(*forward_args, graphdef=graphdef),
            objective_grad.lower(*objective_args, accumulation=accumulation, objective=objective, mesh=mesh),
            student_backward.lower(forward_args, back, cotangent, grads_sum)]


def zero_grads(params):
    """A zero gradient tree shaped and sharded like params: the start of an accumulation. Each
    leaf takes its parameter's own sharding, the one the step's summed gradients come back with:
    a jitted zeros_like came back single-device on one device, and the step then compiled twice
    for every shape, once for an update's first micro-batch and once for the others."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding), params)


def global_norm(tree):
    return optax.tree.norm(tree) if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm(tree)


def make_apply_update(tx: optax.GradientTransformation, schedule):
    """The jitted AdamW update. The parameters and the optimizer state are donated on every
    backend: their new values take the old ones' memory (without it, on the CPU, each update
    held two copies of both: 6 GB more at a 0.5B student's)."""
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

    return jax.jit(apply_update, donate_argnums=(0, 1))


def _local(x):
    """This process's copy of a (possibly globally sharded, replicated) array."""
    return x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x


def scalar(x: Any) -> float:
    """Host float of a (possibly globally sharded, replicated) scalar array."""
    return float(jax.device_get(_local(x)))


def host_floats(tree):
    """`tree` with every (replicated) scalar array as a host float, in one transfer: the loop
    keeps an iteration's sums on the device and fetches them here once, at its end."""
    return jax.tree.map(float, jax.device_get(jax.tree.map(_local, tree)))
