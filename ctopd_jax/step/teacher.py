"""The only teacher path: a prefill-only forward that hands back HIDDEN rows.

`teacher_hidden_rows(graphdef, state, ids, mask, rows)` runs the frozen teacher over its padded
tokens [B, T] (no gradient, no dropout: eval mode) and returns the final post-norm hidden states
at the flat rows [R] of the [B*T] positions the objective asked for (strict pairs, span groups,
every response position ...). Every teacher quantity the objectives use — V∩ columns, top-k
entries, realised-token log-probs, logsumexp, full rows — is then computed chunk by chunk beside
the student's, from (hidden rows, `lm_head`), inside the student step (kernels.strict,
kernels.token_rows). So no [R, V] or [R, V∩] teacher array exists between stages: what crosses
is [R, H], H ≪ V.

Positions follow the attention mask (`prefill_positions`), so left- and right-padded batches
give the same rows as an unpadded forward.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ctopd_jax.mesh.device_mesh import BATCH_AXES
from ctopd_jax.models.attention import prefill_positions


@functools.partial(jax.jit, static_argnames=("graphdef",))
def teacher_hidden(graphdef, state, ids, mask):
    """Teacher final hidden states [B, T, H] of its tokens: compiled per token shape only."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(state))
    return jax.lax.stop_gradient(model.hidden_states(ids, prefill_positions(mask), mask))


@functools.partial(jax.jit, static_argnames=("mesh",))
def gather_rows(hidden, rows, mesh=None):
    """hidden [B, T, H] at flat rows [R] of [B*T] -> [R, H]. With `mesh` the arrays are stacked
    per batch shard (step.shards.stack_shards): each shard gathers its own rows (shard-local
    indices) from its own sequences, so no hidden row crosses devices."""
    def gather(hidden, rows):
        return jnp.take(hidden.reshape(-1, hidden.shape[-1]), rows.astype(jnp.int32), axis=0)

    if mesh is not None and mesh.shape["data"] * mesh.shape["fsdp"] > 1:
        spec = jax.sharding.PartitionSpec(BATCH_AXES)
        gather = jax.shard_map(gather, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    return gather(hidden, rows)


def teacher_hidden_rows(graphdef, state, ids, mask, rows, mesh=None):
    """Teacher final hidden states [R, H] at flat rows [R] of [B*T] (a constant): two programs,
    the forward and the gather, so that a new count of rows (the loss rows change bucket as the
    answers shorten) compiles the gather alone, not the teacher's layers (~1 s at Qwen2.5-0.5B
    on the CPU, ~5 s at 1.5B)."""
    return gather_rows(teacher_hidden(graphdef, state, ids, mask), rows, mesh=mesh)


def lm_head_of(graphdef, state):
    """The teacher's [H, V_T] output projection (tied or untied), as a constant array."""
    return jax.lax.stop_gradient(nnx.merge(graphdef, state).lm_head_weight())


def add_teacher_base(base, batch, overlap, mesh):
    """(batch, overlap) with the base's hidden rows at the teacher rows (MicroBatch.base_hidden)
    and its lm_head (overlap["base_lm_head"], replicated); unchanged without a base."""
    if base is None:
        return batch, overlap
    graphdef, state, lm_head = base
    hidden = teacher_hidden_rows(graphdef, state, batch.teacher_ids, batch.teacher_mask,
                                 batch.teacher_rows, mesh=mesh)
    return dataclasses.replace(batch, base_hidden=hidden), dict(overlap, base_lm_head=lm_head)
