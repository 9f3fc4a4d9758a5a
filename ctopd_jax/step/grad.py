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

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ctopd_jax.kernels import losses
from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.step.shards import per_shard


def objective_sums(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, *, graphdef, objective,
                   mesh=None, dropout=None):
    """(sums, metrics) of the objective on one micro-batch (differentiable in params).
    `dropout` (lora.Dropout): LoRA dropout in the student forward (training steps only).

    The student forward runs on the whole (batch-sharded) micro-batch; with a mesh the
    objective then runs per batch shard on that shard's rows, so no row of hidden states,
    logits or teacher columns moves between devices: only the lm_heads are gathered."""
    model = nnx.merge(graphdef, params, rest)
    mask = batch.student_mask
    hidden = model.hidden_states(batch.student_ids, prefill_positions(mask), mask, lora_dropout=dropout)

    def local(hidden, teacher_hidden, batch, lm_head, teacher_lm_head, overlap):
        flat = hidden.reshape(-1, hidden.shape[-1])
        return objective.loss_sums(flat, lm_head, teacher_hidden, teacher_lm_head, batch, overlap)

    return per_shard(local, mesh, 3, 3)(hidden, teacher_hidden, batch, model.lm_head_weight(),
                                        teacher_lm_head, overlap)


def weighted_sum(sums: dict, weights: dict):
    """Σ_k weight_k · sum_k over the sums with a non-zero weight (a zero-weight sum adds
    exactly nothing, not 0 · inf)."""
    return sum((w * sums[k] for k, w in weights.items() if w != 0.0), jnp.zeros((), jnp.float32))


def _micro_grad(params, rest, batch, teacher_hidden, teacher_lm_head, overlap, total_tokens, grads_sum, *,
                graphdef, accumulation: int, objective, mesh=None, dropout=None):
    """(loss, sums, metrics, grads_sum + d loss / d params) of one micro-batch.

    `grads_sum` is the running gradient of the optimizer batch: it is added inside the step
    and DONATED, so accumulation keeps one gradient buffer (no host-side tree additions, no
    second copy). Start it with `zero_grads(params)`. `mesh`: given when the micro-batch arrays
    are stacked per batch shard (shards.stack_shards). `dropout` (lora.Dropout, from
    lora.train_dropout): LoRA dropout of this micro-batch; its rate is static (pytree aux data),
    its key an ordinary argument."""
    def loss_fn(p):
        sums, metrics = objective_sums(p, rest, batch, teacher_hidden, teacher_lm_head, overlap,
                                       graphdef=graphdef, objective=objective, mesh=mesh, dropout=dropout)
        loss_sum = weighted_sum(sums, objective.loss_weights())
        loss = losses.normalized_loss(loss_sum, total_tokens, accumulation, accumulation)
        return loss, (jax.lax.stop_gradient(sums), jax.lax.stop_gradient(metrics))

    (loss, (sums, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, sums, metrics, jax.tree.map(jnp.add, grads_sum, grads)


_micro_grad_jit = jax.jit(_micro_grad, static_argnames=("graphdef", "accumulation", "objective", "mesh"),
                          donate_argnames=("grads_sum",))


def micro_grad(*args, **kwargs):
    """`_micro_grad` compiled; then, on the host, the objective's `after_micro_batch(metrics)`:
    an objective with run-state statistics takes its run-state statistics (already combined over the batch shards)
    out of the metrics and updates its state once per micro-batch, in order (MP-OPD's GRASS
    noise EMA), so no host callback runs inside the sharded loss."""
    loss, sums, metrics, grads = _micro_grad_jit(*args, **kwargs)
    return loss, sums, kwargs["objective"].after_micro_batch(metrics), grads


micro_grad.lower = _micro_grad_jit.lower


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
