"""Batch shards of a micro-batch: each shard's samples prepared on their own, stacked, and the
objective run per shard (shard_map over data x fsdp) with its sums added over the shards."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from ctopd_jax.algorithms.base import batch_shard_axes
from ctopd_jax.algorithms.micro_batch import side_tokens, widened
from ctopd_jax.mesh.device_mesh import BATCH_AXES



def per_shard(fn, mesh, n_sharded: int, n_replicated: int):
    """`fn` on each batch shard (shard_map over data × fsdp) with its results summed over the
    shards: the first `n_sharded` arguments are split along their leading axis (each shard
    holds its own samples and shard-local row indices, `stack_shards`), the next
    `n_replicated` are whole on every shard. Without a mesh (or one batch shard) it is fn."""
    if mesh is None or mesh.shape["data"] * mesh.shape["fsdp"] == 1:
        return fn

    def summed(*args):
        with batch_shard_axes(BATCH_AXES):   # base.shard_gather works inside fn
            out = fn(*args)
        return jax.tree.map(lambda x: jax.lax.psum(x, BATCH_AXES), out)

    specs = (P(BATCH_AXES),) * n_sharded + (P(),) * n_replicated
    return jax.shard_map(summed, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)


def stack_shards(parts: list):
    """Per-shard micro-batches (algorithms.micro_batch.MicroBatch, each prepared from its own
    samples, with shard-local row indices) -> one: each side's rows first widened to the widest
    part's (micro_batch.widened moves the row indices with them), then every array zero-padded
    to the largest shape over the parts and concatenated along the leading axis, so shard s owns
    block s of every array. Zero padding is inert by the packing convention (weight 0, index 0,
    pad tokens masked)."""
    if len(parts) == 1:
        return parts[0]
    widths = {side: max(side_tokens(p)[side][0].shape[1] for p in parts) for side in side_tokens(parts[0])}
    parts = [widened(p, widths) for p in parts]

    def stacked(*arrays):
        shape = np.max([a.shape for a in arrays], axis=0)
        return np.concatenate([np.pad(a, [(0, int(n) - d) for n, d in zip(shape, a.shape)]) for a in arrays])

    return jax.tree.map(stacked, *parts)
