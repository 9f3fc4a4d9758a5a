"""Move a pytree of arrays between device memory and host memory, keeping each array's
sharding (only its memory kind changes): `optimizer.offload_during_rollout` moves the AdamW
state to pinned host memory before the rollout and back after it, so the JAX sampler's page
pool can use those bytes (plan.py counts the samples that adds; benchmarks/rollout_throughput.py
times the moves). The arrays' values are unchanged by the round trip.
"""
from __future__ import annotations

import jax

HOST, DEVICE = "pinned_host", "device"


def move(tree, memory_kind: str):
    """`tree` with every jax.Array placed in `memory_kind`; waits until the copies are done,
    so the source buffers can be freed as soon as the caller drops them."""
    def put(x):
        if not isinstance(x, jax.Array) or x.sharding.memory_kind == memory_kind:
            return x
        return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))
    return jax.block_until_ready(jax.tree.map(put, tree))


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
