"""The student's weights in the layout vLLM loads: HF names and shapes, computed on the device,
handed to torch through DLPack without a host copy (rollout/vllm_engine.py's weight sync)."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.models import lora
from ctopd_jax.models.weights import flat_params, hf_shape, rule_for_nnx

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16", "float": "float32"}


@functools.partial(jax.jit, static_argnames=("in_dims", "hf_shape", "dtype"))
def _to_hf_layout(value, *, in_dims, hf_shape, dtype):
    """The HF layout of one parameter (weights.to_hf, on device), cast to the engine dtype."""
    if in_dims:
        value = value.reshape(math.prod(value.shape[:in_dims]), -1).T
    return value.reshape(hf_shape).astype(dtype)


def device_hf_arrays(model, dtype: str, device=None) -> list[tuple[str, jax.Array]]:
    """(HF name, JAX array in HF layout and `dtype`) per parameter, computed on the device.

    Sharded parameters are first gathered to `device` (default: the device of the first
    parameter) by a device-to-device copy. `lm_head.weight` is included for tied models (the
    embedding; the same array).
    """

    jdtype = jnp.dtype(_TORCH_DTYPES.get(dtype, dtype))
    out = []
    for path, var in flat_params(nnx.state(model, nnx.Param)):
        rule, name = rule_for_nnx(path)
        value = var[...]
        if device is None:
            device = next(iter(value.devices()))
        if len(value.devices()) > 1 or next(iter(value.devices())) != device:
            value = jax.device_put(value, jax.sharding.SingleDeviceSharding(device))
        value = _to_hf_layout(value, in_dims=rule.in_dims,
                              hf_shape=hf_shape(rule, tuple(value.shape)), dtype=jdtype)
        out.append((name, value))
        if path == "embed" and model.cfg.tie_word_embeddings:
            out.append(("lm_head.weight", value))
    return out


def device_named_tensors(model, dtype: str, device=None) -> list[tuple[str, Any]]:
    """`device_hf_arrays` as torch tensors through DLPack: zero copy, on the same device (a
    CUDA tensor on the GPU JAX used, a CPU tensor on CPU). Keep the list alive until vLLM
    has copied the values: the tensors alias JAX buffers. A LoRA model is merged first
    (`lora.merged`, computed on the device)."""
    import torch   # vLLM's torch: an optional, heavy dependency

    arrays = device_hf_arrays(lora.merged(model), dtype, device)
    for _, value in arrays:
        value.block_until_ready()  # torch reads them on its own stream
    return [(name, torch.from_dlpack(value)) for name, value in arrays]


def _torch_tensor(array: np.ndarray, torch_dtype):
    """Host fallback (numpy -> torch), kept for callers that hold host arrays."""
    import torch   # vLLM's torch: an optional, heavy dependency

    if array.dtype.name == "bfloat16":  # numpy has no bfloat16; reinterpret the bits
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(array, copy=True, order="C"))  # writable copy
    return tensor.to(torch_dtype)
