"""The GPU a CUDA lowering targets on this GPU-less machine."""
import contextlib

import jax


def abstract_gpu():
    """jax >= 0.11 reads the GPU's compute capability during Triton lowering; with no GPU here
    it must be told which one to target (an abstract H200); jax 0.10 lowers without it."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200))
