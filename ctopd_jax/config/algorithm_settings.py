"""algorithm.name -> that objective's settings class (its config section)."""
from __future__ import annotations

import dataclasses
from typing import Any

from ctopd_jax.config.errors import ConfigError

# algorithm.name -> that objective's settings class (its config section). Each objective
# registers its class here (algorithms.base.register), so config never imports the objectives;
# importing the package `ctopd_jax` registers them all (ctopd_jax/__init__.py).
_ALGORITHM_SETTINGS: dict[str, type] = {}


def register_algorithm_settings(name: str, settings_class: type) -> None:
    """Make `algorithm.name: <name>` read its section as `settings_class`."""
    _ALGORITHM_SETTINGS[name] = settings_class


def algorithm_class(name: Any) -> type:
    """The settings class of the objective `algorithm.name` (its own config section)."""
    if name not in _ALGORITHM_SETTINGS:
        raise ConfigError(f"algorithm.name: {name!r} is not a registered objective; choose one of "
                          f"{', '.join(sorted(_ALGORITHM_SETTINGS))}")
    return _ALGORITHM_SETTINGS[name]


def is_registered(name: Any) -> bool:
    """Whether `algorithm.name: <name>` names a registered objective."""
    return name in _ALGORITHM_SETTINGS


def objectives_defining(key: str) -> list[str]:
    """The registered objectives whose config section has the field `key` (sorted)."""
    return sorted(name for name, cls in _ALGORITHM_SETTINGS.items()
                  if key in {f.name for f in dataclasses.fields(cls)})

