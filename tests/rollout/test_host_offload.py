"""loop/offload: a sharded optimizer-like state goes to pinned host memory and back unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ctopd_jax.loop import offload
from ctopd_jax.mesh.device_mesh import make_mesh


def test_round_trip_keeps_values_and_shardings():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor"))
    params = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), sharding), "b": jnp.ones(3)}
    state = optax.adamw(1e-3).init(params)
    state = jax.tree.map(lambda x: x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    host = offload.move(state, offload.HOST)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(host)}
    assert kinds == {"pinned_host"}
    back = offload.move(host, offload.DEVICE)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert b.sharding == a.sharding and b.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert offload.tree_bytes(back) == offload.tree_bytes(state) > 0
