"""The objectives: one module each, found by config/catalog.py (no list of them here).

`from ctopd_jax.algorithms import get_objective, registry` reads the registry; the objective
interface is algorithms/base.py. This package file imports only the registry, which imports
nothing of the project: config reads the settings classes through it.
"""
from __future__ import annotations

from ctopd_jax.config.catalog import (default_objective, get_objective, objective_class,
                                           objectives_that, register, registry)

__all__ = ["default_objective", "get_objective", "objective_class", "objectives_that", "register",
           "registry"]
