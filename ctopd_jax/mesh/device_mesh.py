"""Device mesh from `--mesh data=2,fsdp=2,tensor=2`, logical-axis rules and shardings.

Parameters and activations name their axes logically ("embed", "mlp", "batch", ...);
`LOGICAL_RULES` maps each logical name to mesh axes. A mesh axis that does not divide the
dimension it would shard is dropped for that array (replicated along it) instead of failing:
tiny test models have fewer heads than a large mesh has devices, and the real models divide
evenly, so this only ever relaxes sharding on toys.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")   # the mesh axes a batch's rows are split over

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "length": (),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
}


class MeshError(ValueError):
    """A mesh specification that cannot be built on the devices present."""


def parse_mesh(text: str) -> dict[str, int]:
    """Parse "data=2,fsdp=2,tensor=2" (axes may be omitted; -1 fills the remaining devices)."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            what = f"unknown axis {name!r}" if sep else f"bad entry {part!r}"
            raise MeshError(
                f"mesh: {what}; write axis=size with axis one of {', '.join(MESH_AXES)}, "
                "e.g. --mesh data=2,fsdp=2,tensor=2")
        if name in shape:
            raise MeshError(f"mesh: axis {name!r} given twice in {text!r}")
        try:
            shape[name] = int(value)
        except ValueError:
            raise MeshError(f"mesh.{name}: {value.strip()!r} is not an integer; write a size "
                            f"such as {name}=2 (or {name}=-1 to take the remaining devices)") from None
    return shape


def resolve_mesh_shape(shape: Mapping[str, int] | None, device_count: int) -> dict[str, int]:
    """Fill omitted axes with 1 and one -1 axis with what is left; check the product."""
    shape = dict(shape or {"data": -1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise MeshError(f"mesh: unknown axes {sorted(unknown)}; use {MESH_AXES}")
    full = {axis: shape.get(axis, 1) for axis in MESH_AXES}
    fill = [axis for axis, size in full.items() if size == -1]
    for axis, size in full.items():
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{axis}: size {size} must be a positive integer or -1 (fill)")
    if len(fill) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {fill}")
    fixed = math.prod(size for size in full.values() if size != -1)
    if fill:
        if device_count % fixed:
            raise MeshError(
                f"mesh: {device_count} devices are not divisible by the fixed axes' product "
                f"{fixed}; change the sizes in --mesh")
        full[fill[0]] = device_count // fixed
    product = math.prod(full.values())
    if product != device_count:
        raise MeshError(
            f"mesh: data*fsdp*tensor = {product} but {device_count} devices are present; "
            f"make the product equal the device count (e.g. --mesh data={device_count})")
    return full


def make_mesh(shape: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all (or the given) devices with axes ("data", "fsdp", "tensor")."""
    devices = list(devices) if devices is not None else jax.devices()
    full = resolve_mesh_shape(shape, len(devices))
    sizes = tuple(full[axis] for axis in MESH_AXES)
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def logical_spec(mesh: Mesh, logical_axes: Sequence[str | None],
                 shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for logical axes; mesh axes that do not divide `shape` are dropped. Spelled
    as jit spells its outputs, without trailing unsharded axes (P('fsdp') for P('fsdp', None)):
    an array placed on the other spelling is another jit cache key than the same array returned
    by a step, so every program taking parameters compiled twice, before and after the first
    update."""
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise MeshError(f"logical axis {name!r} has no rule; known: {sorted(LOGICAL_RULES)}")
        axes = []
        size = shape[dim] if shape is not None else None
        for axis in LOGICAL_RULES[name]:
            n = mesh.shape[axis]
            if axis in used or n == 1:
                continue
            if size is not None and size % (n * math.prod(mesh.shape[a] for a in axes)):
                continue
            axes.append(axis)
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None],
                     shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(mesh, logical_axes, shape))


def variable_logical_axes(variable) -> tuple[str | None, ...] | None:
    """The logical axis names an NNX variable was annotated with (Flax renamed the key)."""
    metadata = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if metadata.get(key):
            return tuple(metadata[key])
    return None


def module_shardings(module, mesh: Mesh):
    """NamedSharding per parameter of an NNX module (replicated when not annotated)."""
    def sharding_of(variable):
        axes = variable_logical_axes(variable)
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return logical_sharding(mesh, axes, value.shape)

    state = nnx.state(module)
    return jax.tree.map(sharding_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_module(module, mesh: Mesh):
    """Place every parameter of an NNX module on its logical sharding (in place); returns it."""
    state = nnx.state(module)
    shardings = module_shardings(module, mesh)
    nnx.update(module, jax.device_put(state, shardings))
    return module


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) dimension over data and fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def initialize_distributed() -> bool:
    """Call `jax.distributed.initialize` when the environment describes several processes.

    Reads CTOPD_COORDINATOR (host:port), CTOPD_NUM_PROCESSES and CTOPD_PROCESS_ID (or the
    JAX_* names jax itself understands). Returns True when initialised. Must run before any
    other JAX call in the process.
    """
    coordinator = os.environ.get("CTOPD_COORDINATOR") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = os.environ.get("CTOPD_NUM_PROCESSES") or os.environ.get("JAX_NUM_PROCESSES")
    pid = os.environ.get("CTOPD_PROCESS_ID") or os.environ.get("JAX_PROCESS_ID")
    if not num or int(num) <= 1:
        return False
    if not coordinator or pid is None:
        raise MeshError(
            "distributed: CTOPD_NUM_PROCESSES>1 needs CTOPD_COORDINATOR=host:port and "
            "CTOPD_PROCESS_ID=<0..N-1> in the environment of every process")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=int(num),
                               process_id=int(pid))
    return True
