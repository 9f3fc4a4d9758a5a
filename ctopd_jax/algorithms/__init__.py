"""Objective registry: `algorithm.name` -> objective class (see base.Objective).

Each objective is one module that registers itself; importing this package registers them all.
"""
from __future__ import annotations

from ctopd_jax.algorithms.base import Needs, Objective, StepInputs, register, registry
from ctopd_jax.algorithms import strict, span, simct, mp_opd  # noqa: F401,E402  (register the objectives)
from ctopd_jax.algorithms import gkd, opd, opd_full, vopd, opd2  # noqa: F401,E402  (same-tokenizer family)
from ctopd_jax.algorithms import tcod, sod, sage_opd  # noqa: F401,E402  (turn-structured family)


def get_objective(settings) -> Objective:
    """The objective named by `settings.name`, built from its own config section."""
    table = registry()
    if settings.name not in table:
        raise ValueError(f"algorithm.name={settings.name!r} is not registered; choose one of {sorted(table)}")
    return table[settings.name](settings)


__all__ = ["Needs", "Objective", "StepInputs", "get_objective", "register", "registry"]
