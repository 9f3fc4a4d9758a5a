"""AdamW with the SPEC §1 defaults, as one optax GradientTransformation.

Decisions (SPEC is silent on these):
- The schedule follows transformers' `get_cosine_with_min_lr_schedule_with_warmup` (the
  reference trains through it): during warmup the factor is step / warmup (so the very first
  update has lr 0 when warmup > 0, as in the reference), after warmup progress =
  (step - warmup) / (total - warmup) and the factor is min_rate + (1 - min_rate) * half-cosine.
  optax calls the schedule with the number of updates already applied, which is the torch
  scheduler's `current_step` at the same optimizer step, so both give the same per-update rate.
- Weight decay is masked off for biases, norm scales and every parameter of rank < 2 (the
  usual "no decay on bias / LayerNorm" rule); embeddings and projection matrices are decayed
  when weight_decay > 0.
- Clipping happens before Adam (torch `clip_grad_norm_` then `optimizer.step()`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

_NO_DECAY_NAMES = ("bias", "scale", "norm")


@dataclass(frozen=True)
class OptimizerSettings:
    learning_rate: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.05
    min_lr: float = 1e-8
    total_steps: int = 100
    schedule: str = "cosine_with_min_lr"   # or "constant" (lr throughout, no warmup)
    mu_dtype: str = "float32"              # Adam's first moment; bfloat16 halves it

    def __post_init__(self):
        if self.schedule not in ("cosine_with_min_lr", "constant"):
            raise ValueError(f"optimizer.schedule must be cosine_with_min_lr or constant, got {self.schedule!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"optimizer.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.min_lr < 0 or self.min_lr > self.learning_rate:
            raise ValueError(
                f"optimizer.min_lr must be in [0, learning_rate={self.learning_rate}], got {self.min_lr}")
        if self.total_steps < 1:
            raise ValueError(f"train steps must be >= 1 to build a schedule, got {self.total_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"optimizer.max_grad_norm must be > 0 (or null to disable), got {self.max_grad_norm}")


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(math.ceil(total_steps * warmup_ratio))


def cosine_with_min_lr_schedule(learning_rate: float, total_steps: int, warmup_ratio: float = 0.05,
                                min_lr: float = 1e-8) -> optax.Schedule:
    """Per-update learning rate; `count` is the number of updates applied before this one."""
    warm = float(warmup_steps(total_steps, warmup_ratio))
    total = float(total_steps)
    min_rate = min_lr / learning_rate

    def schedule(count):
        step = jnp.asarray(count, jnp.float32)
        warm_factor = step / max(1.0, warm)
        progress = (step - warm) / max(1.0, total - warm)
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        decay_factor = jnp.maximum(0.0, cosine * (1.0 - min_rate) + min_rate)
        return learning_rate * jnp.where(step < warm, warm_factor, decay_factor)

    return schedule


def _path_names(path) -> list[str]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return names


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: rank >= 2 and not a bias / norm parameter."""

    def decide(path, leaf):
        names = [n.lower() for n in _path_names(path)]
        if jnp.ndim(leaf) < 2:
            return False
        return not any(word in name for name in names for word in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(settings: OptimizerSettings) -> tuple[optax.GradientTransformation, optax.Schedule]:
    if settings.schedule == "constant":
        schedule = optax.constant_schedule(settings.learning_rate)
    else:
        schedule = cosine_with_min_lr_schedule(settings.learning_rate, settings.total_steps,
                                               settings.warmup_ratio, settings.min_lr)
    b1, b2 = settings.betas
    parts = []
    if settings.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(settings.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=settings.eps, mu_dtype=settings.mu_dtype,
                             weight_decay=settings.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule


def settings_from_config(section, total_steps: int) -> OptimizerSettings:
    """Settings from the run config's `optimizer` section (config.OptimizerSection)."""
    return OptimizerSettings(
        learning_rate=section.lr, betas=tuple(section.betas), eps=section.eps,
        weight_decay=section.weight_decay, max_grad_norm=section.max_grad_norm,
        warmup_ratio=section.warmup_ratio, min_lr=section.min_lr, total_steps=int(total_steps),
        schedule=section.schedule, mu_dtype=section.mu_dtype,
    )
