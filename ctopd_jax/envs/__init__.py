"""Environments for multi-turn rollouts (tool use, text games), picked by name.

"calculator": `<calc>EXPR</calc>` tool calls, final answer rewarded against the prompt's
`answer` (setting: max_calls); "text_world": a small text adventure whose task comes from the
prompt's `task_id` (no settings). The protocol and `run_step` are in base.py.
"""
from __future__ import annotations

import inspect

from ctopd_jax.envs.base import EnvConfigError, Environment, StepResult, run_step
from ctopd_jax.envs.calculator import Calculator
from ctopd_jax.envs.text_world import TextWorld

_REGISTRY = {Calculator.name: Calculator, TextWorld.name: TextWorld}
ENVIRONMENTS: tuple[str, ...] = tuple(_REGISTRY)

__all__ = ["ENVIRONMENTS", "EnvConfigError", "Environment", "StepResult", "make_environment",
           "run_step"]


def make_environment(name: str, **settings) -> Environment:
    """A new environment object (one per concurrent episode) of the registered `name`.

    An unknown name or setting is an EnvConfigError naming the field and the choices.
    """
    if name not in _REGISTRY:
        raise EnvConfigError(f"rollout.environment={name!r} is unknown; choose one of "
                             f"{ENVIRONMENTS}")
    cls = _REGISTRY[name]
    known = [p for p in inspect.signature(cls).parameters]
    for key in settings:
        if key not in known:
            raise EnvConfigError(f"environment {name!r} has no setting {key!r}; its settings "
                                 f"are {known or 'none'}")
    return cls(**settings)
