"""Objective registry: `algorithm.name` -> objective class (see base.Objective).

Each objective is one module that registers itself; importing this package registers them all.
"""
from __future__ import annotations

from ctopd_jax.algorithms.base import Needs, Objective, StepInputs, register, registry
from ctopd_jax.algorithms import strict, span, simct, mp_opd  # noqa: F401,E402  (register the objectives)
from ctopd_jax.algorithms import gkd, opd, opd_full, vopd, opd2  # noqa: F401,E402  (same-tokenizer family)
from ctopd_jax.algorithms import tcod, sod, sage_opd  # noqa: F401,E402  (turn-structured family)
from ctopd_jax.algorithms import served_topk  # noqa: F401,E402  (a served teacher's top-k)


def get_objective(settings) -> Objective:
    """The objective named by `settings.name`, built from its own config section."""
    table = registry()
    if settings.name not in table:
        raise ValueError(f"algorithm.name={settings.name!r} is not registered; choose one of {sorted(table)}")
    return table[settings.name](settings)


def default_objective(name: str) -> Objective:
    """The objective `name` with its section's defaults (what a config naming only it gets)."""
    table = registry()
    if name not in table:
        raise ValueError(f"algorithm.name={name!r} is not registered; choose one of {sorted(table)}")
    return table[name](table[name].settings_class(name=name))


def objectives_that(predicate) -> list[str]:
    """Names of the registered objectives whose default instance satisfies `predicate` (sorted)."""
    return sorted(name for name in registry() if predicate(default_objective(name)))


__all__ = ["Needs", "Objective", "StepInputs", "default_objective", "get_objective",
           "objectives_that", "register", "registry"]
