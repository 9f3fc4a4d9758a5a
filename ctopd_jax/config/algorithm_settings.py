"""algorithm.name -> that objective's settings class (its config section), read from the one
registry of objectives (config/catalog.py, which imports nothing of the project)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ctopd_jax.config import catalog
from ctopd_jax.config.errors import ConfigError


def algorithm_class(name: Any, modules: Sequence[str] = ()) -> type:
    """The settings class of the objective `algorithm.name` (its own config section), from the
    objectives' registry (after importing `algorithm.modules`)."""
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"algorithm.modules: {modules!r} must be a list of module names, e.g. "
                          "[my_pkg.my_objective]")
    try:
        return catalog.objective_class(name, modules).settings_class
    except catalog.UnknownObjective as err:
        raise ConfigError(str(err)) from None


def is_registered(name: Any, modules: Sequence[str] = ()) -> bool:
    """Whether `algorithm.name: <name>` names a registered objective (a module of
    `algorithm.modules` that cannot import is reported when the section is built)."""
    try:
        return name in catalog.registry(modules)
    except catalog.UnknownObjective:
        return False


def objectives_defining(key: str) -> list[str]:
    """The registered objectives whose config section has the field `key` (sorted)."""
    return sorted(name for name, cls in catalog.registry().items()
                  if key in {f.name for f in dataclasses.fields(cls.settings_class)})
