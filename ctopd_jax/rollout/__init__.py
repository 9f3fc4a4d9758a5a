"""Rollout engines behind one protocol (base.py), picked by name: "jax" (default) or "vllm"."""
from ctopd_jax.rollout.base import (FINISH_LENGTH, FINISH_STOP, RolloutConfigError,
                                    RolloutEngine, RolloutResult, SamplingParams)

ENGINES = ("jax", "vllm")


def make_rollout_engine(name: str, model, eos_ids, pad_id=None, mesh=None, **kwargs):
    """Build a rollout engine for the student `model` by name.

    "jax": the native sampler (kwargs: max_batch_size, max_prompt_len); "vllm": an in-process
    vLLM engine (kwargs: max_model_len, dtype, seed, llm_kwargs); vLLM ignores `mesh`.
    """
    if name == "jax":
        from ctopd_jax.rollout.jax_sampler import JaxSampler

        return JaxSampler(model, eos_ids, pad_id, mesh=mesh, **kwargs)
    if name == "vllm":
        from ctopd_jax.rollout.vllm_engine import VllmEngine

        return VllmEngine(model, eos_ids, pad_id, **kwargs)
    raise RolloutConfigError(f"rollout.engine={name!r} is unknown; choose one of {ENGINES}")


__all__ = ["ENGINES", "FINISH_LENGTH", "FINISH_STOP", "RolloutConfigError", "RolloutEngine",
           "RolloutResult", "SamplingParams", "make_rollout_engine"]
