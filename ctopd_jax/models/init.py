"""Random initialisation of a Decoder of any size in seconds, straight onto its shardings.

`nnx.jit(lambda: Decoder(cfg, rngs=...))` traces every layer's constructor into one program
whose size grows with the layer count: the 3B preset took 21-24 s to compile on a 2-core CPU
and 50 s on an H200 (79 s for the 7B). Here the module is built abstractly (no values), and
each parameter is drawn by a one-tensor program keyed on its (shape, dtype, init, sharding):
a preset compiles about ten such programs whatever its depth, and each value is produced
directly on its mesh sharding (no host round trip).

Values: parameter ``p`` gets ``draw(fold_in(key(seed), crc32(p)))`` from the distribution its
constructor declares (``_param``'s ``init`` metadata: normal(0, 0.02) in float32 then cast,
ones or zeros), so the same seed gives the same values on any mesh (threefry is
partitionable) and renaming one parameter does not reshuffle the others. They are not the
values `Decoder(cfg, rngs=nnx.Rngs(seed))` draws, only the same distribution.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.mesh.device_mesh import logical_sharding, variable_logical_axes
from ctopd_jax.models.config import ModelConfig
from ctopd_jax.models.decoder import INIT_STD, Decoder


@functools.lru_cache(maxsize=None)
def _drawer(shape: tuple[int, ...], dtype, init: str, sharding):
    """The jitted draw of one tensor: (seed, tensor id) -> value on `sharding`. Both arguments
    are host scalars, which every process of a multi-process mesh passes alike."""
    def draw(seed, tensor_id):
        if init == "ones":
            value = jnp.ones(shape, jnp.float32)
        elif init == "zeros":
            value = jnp.zeros(shape, jnp.float32)
        else:
            key = jax.random.fold_in(jax.random.key(seed), tensor_id)
            value = jax.random.normal(key, shape, jnp.float32) * INIT_STD
        return value.astype(dtype)
    return jax.jit(draw, out_shardings=sharding)


def tensor_id(path: str) -> int:
    """The stable number a parameter's key is folded with (crc32 of its dotted path)."""
    return zlib.crc32(path.encode()) & 0x7FFF_FFFF


def draw_plan(cfg: ModelConfig, mesh=None):
    """(graphdef, [(path, abstract variable, jitted draw, tensor id)]): what init_decoder runs,
    one entry per parameter (benchmarks/init_compile.py compiles it without running it)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    entries = []
    for path, var in nnx.to_flat_state(abstract):
        sharding = None
        if mesh is not None:
            axes = variable_logical_axes(var) or (None,) * len(var.shape)
            sharding = logical_sharding(mesh, axes, tuple(var.shape))
        draw = _drawer(tuple(var.shape), jnp.dtype(var.dtype), var.get_metadata()["init"], sharding)
        entries.append((path, var, draw, tensor_id(".".join(str(k) for k in path))))
    return graphdef, entries


def init_decoder(cfg: ModelConfig, seed: int, mesh=None) -> Decoder:
    """A randomly initialised Decoder; with `mesh`, each parameter on its logical sharding."""
    graphdef, entries = draw_plan(cfg, mesh)
    leaves = [(path, var.replace(draw(np.uint32(seed), np.uint32(tid))))
              for path, var, draw, tid in entries]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))
