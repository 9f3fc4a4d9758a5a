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
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ctopd_jax.config import OptimizerSection
from ctopd_jax.mesh.arrays import on_mesh

_NO_DECAY_NAMES = ("bias", "scale", "norm")


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


def make_optimizer(section: OptimizerSection, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(clip + AdamW, its schedule) of an `optimizer:` section (config.validate checked it) over
    `total_steps` updates."""
    if section.schedule == "constant":
        schedule = optax.constant_schedule(section.lr)
    else:
        schedule = cosine_with_min_lr_schedule(section.lr, int(total_steps), section.warmup_ratio,
                                               section.min_lr)
    b1, b2 = section.betas
    return optax.chain(
        optax.clip_by_global_norm(section.max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, eps=section.eps, mu_dtype=section.mu_dtype,
                    weight_decay=section.weight_decay, mask=decay_mask)), schedule


def init_state(tx: optax.GradientTransformation, params, mesh) -> Any:
    """The optimizer state of `params`, every leaf on the mesh. Not jitted: a jitted init returned
    the AdamW moments replicated on every device (their zeros read nothing of the parameters),
    FSDP-sharded only after the first update, which then compiled twice. The scalars (step
    counts) come out on one device: on the mesh too, so saved and restored states carry mesh
    shardings throughout."""
    return jax.tree.map(lambda x: on_mesh(x, mesh), tx.init(params))
