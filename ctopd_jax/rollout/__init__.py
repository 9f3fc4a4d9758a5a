"""Rollout engines behind one protocol (base.py), picked by name: "jax" (default) or "vllm"."""
from ctopd_jax.rollout.base import (FINISH_LENGTH, FINISH_STOP, RolloutConfigError, RolloutEngine,
                                    RolloutResult, SamplingParams)
from ctopd_jax.rollout.jax_sampler import JaxSampler
from ctopd_jax.rollout.vllm_engine import VllmEngine

ENGINES = ("jax", "vllm")


def make_rollout_engine(name: str, model, eos_ids, pad_id=None, mesh=None, **kwargs):
    """Build a rollout engine for the student `model` by name.

    "jax": the native sampler (kwargs: max_batch_size (decode slots), max_prompt_len,
    kv_cache_budget_gb, page_size); "vllm": an in-process
    vLLM engine (kwargs: max_model_len, dtype, seed, llm_kwargs); vLLM ignores `mesh`.
    """
    if name == "jax":
        return JaxSampler(model, eos_ids, pad_id, mesh=mesh, **kwargs)
    if name == "vllm":
        return VllmEngine(model, eos_ids, pad_id, **kwargs)
    raise RolloutConfigError(f"rollout.engine={name!r} is unknown; choose one of {ENGINES}")


def sampling_params_from_config(rollout, seed: int = 0) -> SamplingParams:
    """SamplingParams from the run config's `rollout` section (SPEC §1: stop at the EOS)."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=max(0, rollout.top_k), max_new_tokens=rollout.generate_max_len,
                          n=rollout.n_samples_per_prompt, seed=seed)


def engine_from_config(rollout, model, eos_ids, pad_id=None, mesh=None):
    """The engine named by `rollout.engine`, sized by the section's prompt/response lengths."""
    if rollout.engine == "vllm":
        return make_rollout_engine(
            "vllm", model, eos_ids, pad_id,
            max_model_len=rollout.max_prompt_len + rollout.generate_max_len,
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
            sleep_between_rollouts=rollout.vllm_sleep_between_rollouts)
    return make_rollout_engine(rollout.engine, model, eos_ids, pad_id, mesh=mesh,
                               max_prompt_len=rollout.max_prompt_len,
                               max_batch_size=rollout.jax_decode_slots,
                               kv_cache_budget_gb=rollout.jax_kv_cache_budget_gb,
                               page_size=rollout.jax_page_size)


__all__ = ["engine_from_config", "sampling_params_from_config", "ENGINES", "FINISH_LENGTH", "FINISH_STOP", "RolloutConfigError", "RolloutEngine",
           "RolloutResult", "SamplingParams", "make_rollout_engine"]
