"""Impossible values of a whole configuration, one ConfigError naming the field and the fix.

The environment name is checked by preflight (preflight/settings.py) against the rollout
side's own list, so the settings import nothing of the loop."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ctopd_jax.common.routing import check_teacher_names
from ctopd_jax.config.errors import ConfigError, require
from ctopd_jax.config.sections import LORA_TARGETS, TeacherSection, TrainConfig
from ctopd_jax.config.served import TeacherSettingError, check_settings
from ctopd_jax.mesh.device_mesh import MeshError, resolve_mesh_shape


def validate(config: TrainConfig, device_count: int | None = None) -> None:
    """Impossible values; with `device_count`, also that the mesh fits the devices."""
    r, a, o = config.rollout, config.algorithm, config.optimizer
    require(config.output_dir.strip() != "", "output_dir", "is empty, which would write the run "
             "into the current directory; name a folder for it, e.g. runs/my_run")
    _check_seeds(config)
    require(config.steps >= 1, "steps", f"{config.steps} must be >= 1")
    require(r.rollout_batch_size >= 1, "rollout.rollout_batch_size", "must be >= 1")
    require(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "must be >= 1")
    require(r.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy)")
    require(0 < r.top_p <= 1, "rollout.top_p", f"{r.top_p} must be in (0, 1]")
    require(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", "must be -1 (off) or >= 1")
    require(r.generate_max_len >= 1, "rollout.generate_max_len", "must be >= 1")
    require(r.max_prompt_len >= 1, "rollout.max_prompt_len", "must be >= 1")
    require(r.jax_decode_slots >= 1, "rollout.jax_decode_slots", "must be >= 1")
    require(r.jax_kv_cache_budget_gb > 0, "rollout.jax_kv_cache_budget_gb", "must be > 0 (GB)")
    require(r.jax_page_size >= 1, "rollout.jax_page_size", "must be >= 1 token")
    require(r.max_turns >= 1, "rollout.max_turns", "must be >= 1 turn")
    require(r.step_timeout_s > 0, "rollout.step_timeout_s", "must be > 0 seconds")
    require(0 < r.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization",
             f"{r.vllm_gpu_memory_utilization} must be in (0, 1] (a fraction of the GPU's memory)")
    config.model.validate()
    try:
        check_settings(r)
    except TeacherSettingError as err:   # one ConfigError line like the rest
        raise ConfigError(str(err)) from None
    config.teacher.validate()
    _check_teachers(config)
    require(config.model.attention != "cudnn" or r.engine != "jax", "model.attention",
             "'cudnn' cannot decode with a KV cache, which rollout.engine=jax does with the same "
             "model; use 'auto' (cuDNN where it can, blockwise for decoding)")
    a.validate()
    require(o.lr > 0, "optimizer.lr", "must be > 0")
    require(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "each must be in [0, 1)")
    require(o.eps > 0, "optimizer.eps", f"{o.eps} must be > 0 (AdamW divides by it)")
    require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    require(o.max_grad_norm > 0, "optimizer.max_grad_norm", "must be > 0")
    require(0 <= o.warmup_ratio < 1, "optimizer.warmup_ratio", "must be in [0, 1)")
    require(0 <= o.min_lr <= o.lr, "optimizer.min_lr", "must be in [0, optimizer.lr]")
    require(o.micro_batch_size >= 1, "optimizer.micro_batch_size", "must be >= 1")
    require(o.micro_batch_tokens == "auto" or o.micro_batch_tokens >= 0, "optimizer.micro_batch_tokens",
            "must be auto or >= 0 (0: one row per response, micro_batch_size of them)")
    require(o.train_batch_size >= 1, "optimizer.train_batch_size", "must be >= 1")
    require(o.train_batch_size % o.micro_batch_size == 0, "optimizer.train_batch_size",
             f"{o.train_batch_size} must be a multiple of optimizer.micro_batch_size "
             f"{o.micro_batch_size}")
    responses = r.rollout_batch_size * r.n_samples_per_prompt
    require(responses % o.train_batch_size == 0, "optimizer.train_batch_size",
             f"rollout_batch_size * n_samples_per_prompt = {responses} responses per iteration "
             f"must be a multiple of train_batch_size {o.train_batch_size}")
    require(config.checkpoint.every >= 0, "checkpoint.every", "must be >= 0")
    require(config.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    require(config.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    e = config.evaluation
    require(e.samples >= 1, "evaluation.samples", "must be >= 1")
    require(e.every >= 0, "evaluation.every", f"{e.every} must be >= 0 (0 = only at the end)")
    require(e.max_problems >= 0, "evaluation.max_problems", f"{e.max_problems} must be >= 0 "
             "(0 = all problems)")
    lo = config.lora
    require(lo.rank >= 0, "lora.rank", f"{lo.rank} must be >= 0 (0 = full fine-tuning)")
    require(lo.alpha > 0, "lora.alpha", f"{lo.alpha} must be > 0")
    require(0 <= lo.dropout < 1, "lora.dropout", f"{lo.dropout} must be in [0, 1)")
    require(lo.dropout == 0 or lo.rank > 0, "lora.dropout", f"{lo.dropout} applies to the "
             "adapters only: set lora.rank > 0 or lora.dropout: 0.0")
    require(not lo.init_adapter or lo.rank > 0, "lora.init_adapter", "loads adapters: set "
             "lora.rank to the adapter's r (0 = full fine-tuning has none)")
    require(bool(lo.target_modules) and set(lo.target_modules) <= set(LORA_TARGETS),
             "lora.target_modules", f"{list(lo.target_modules)} must be a non-empty subset of "
             f"{list(LORA_TARGETS)}")
    g = config.guard
    require(g.zero_grad_norm_steps >= 0, "guard.zero_grad_norm_steps", "must be >= 0 (0 = off)")
    require(g.loss_jump_factor == 0 or g.loss_jump_factor > 1, "guard.loss_jump_factor",
             "must be 0 (off) or > 1")
    require(g.loss_jump_window >= 1, "guard.loss_jump_window", "must be >= 1")
    require(g.loss_jump_warmup >= 1, "guard.loss_jump_warmup", "must be >= 1")
    for axis in ("data", "fsdp", "tensor"):
        size = getattr(config.mesh, axis)
        require(size == -1 or size >= 1, f"mesh.{axis}", "must be >= 1 or -1 (fill)")
    if device_count is not None:
        try:
            resolve_mesh_shape(dataclasses.asdict(config.mesh), device_count)
        except MeshError as err:
            raise ConfigError(f"{err}{device_count_hint(device_count)}") from None


def _check_teachers(config: TrainConfig) -> None:
    """`teachers:` entries: names, settings, the default; the single-teacher fields unset."""
    if not config.teachers:
        return
    try:
        check_teacher_names([t.name for t in config.teachers],
                            config.data.default_teacher or None, field="teachers")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for t in config.teachers:
        t.validate()
    require(config.teacher == TeacherSection(), "teacher",
            "is set beside teachers:; give each teacher's engine, url, ... in its teachers: entry")
    require(not config.model.teacher_tokenizer, "model.teacher_tokenizer",
            "is set beside teachers:; give each teacher's tokenizer in its teachers: entry")


SEED_LIMIT = 2 ** 32   # numpy's and the data loader's seeds are unsigned 32-bit


def _check_seeds(section: Any, prefix: str = "") -> None:
    """Every field named `seed` or `*_seed`, in any section or objective: in [0, 2**32)."""
    for f in dataclasses.fields(section):
        value, dotted = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_seeds(value, dotted + ".")
        elif f.name == "seed" or f.name.endswith("_seed"):
            require(0 <= value < SEED_LIMIT, dotted, f"{value} must be in [0, 2**32)")


def device_count_hint(device_count: int) -> str:
    """On CPU, how to get more (virtual) devices; "" elsewhere."""
    if jax.default_backend() != "cpu":
        return ""
    return (f" (on CPU, {device_count} device(s) are present: start with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N for N virtual devices)")
