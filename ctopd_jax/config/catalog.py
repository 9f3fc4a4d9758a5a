"""The catalog of objectives, their one registry: `algorithm.name` -> its class (and its settings).

An objective is one module that declares everything in one place, its class:

    @register("my_method")
    class MyMethod(Objective):
        settings_class = MyMethodSettings    # its config section (algorithm.*)
        ...

Modules are discovered, never listed: the first look-up imports every module of the package
`ctopd_jax.algorithms` (pkgutil), and a config imports its own objective modules by name with
`algorithm.modules: [my_pkg.my_method]` (any importable module, e.g. on PYTHONPATH), so a new
method is one file and no other file changes (docs/objectives.md).

It sits in config/ and imports nothing of the project: the settings read each objective's
settings class through it, and the objective modules (which import config) register here.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Callable, Iterable

# the package's own objectives: every module of ctopd_jax/algorithms, found by its folder (an
# import by name, not a static one: the objectives import config, never the other way)
OBJECTIVES_PACKAGE = "ctopd_jax.algorithms"
OBJECTIVES_DIR = Path(__file__).resolve().parents[1] / "algorithms"
_OBJECTIVES: dict[str, type] = {}
_IMPORTED: set[str] = set()     # module names imported for the registry (package and user's)


class UnknownObjective(ValueError):
    """`algorithm.name` names no objective, or `algorithm.modules` a module that cannot import."""


def register(name: str):
    """Class decorator: the objective `algorithm.name: <name>`; its config section is the
    class's `settings_class`."""
    def wrap(cls):
        if name in _OBJECTIVES and _OBJECTIVES[name] is not cls:
            raise ValueError(f"algorithm {name!r} registered twice ({_OBJECTIVES[name].__module__} "
                             f"and {cls.__module__})")
        cls.name = name
        _OBJECTIVES[name] = cls
        return cls
    return wrap


def import_modules(modules: Iterable[str] = ()) -> None:
    """Import the package's own modules (once) and `modules`, registering what they declare."""
    own = [f"{OBJECTIVES_PACKAGE}.{m.name}" for m in pkgutil.iter_modules([str(OBJECTIVES_DIR)])
           if not m.name.startswith("_")]
    for module in [*own, *modules]:
        if module in _IMPORTED:
            continue
        _IMPORTED.add(module)   # before importing: a module's own imports may look objectives up
        try:
            importlib.import_module(module)
        except ImportError as err:
            _IMPORTED.discard(module)
            raise UnknownObjective(f"algorithm.modules: cannot import {module!r} ({err}); give an "
                                   "importable module name (its folder on PYTHONPATH)") from None


def registry(modules: Iterable[str] = ()) -> dict[str, type]:
    """name -> objective class: the package's objectives and those of `modules`."""
    import_modules(modules)
    return dict(_OBJECTIVES)


def objective_class(name, modules: Iterable[str] = ()) -> type:
    """The class registered as `name` (one UnknownObjective line naming the choices if none)."""
    table = registry(modules)
    if name not in table:
        raise UnknownObjective(f"algorithm.name: {name!r} is not a registered objective; choose one "
                               f"of {', '.join(sorted(table))}, or name the module that declares "
                               "it in algorithm.modules")
    return table[name]


def get_objective(settings):
    """The objective named by `settings.name`, built from its own config section."""
    return objective_class(settings.name, settings.modules)(settings)


def default_objective(name: str):
    """The objective `name` with its section's defaults (what a config naming only it gets)."""
    cls = objective_class(name)
    return cls(cls.settings_class(name=name))


def objectives_that(predicate: Callable) -> list[str]:
    """Names of the registered objectives whose default instance satisfies `predicate` (sorted)."""
    return sorted(name for name in registry() if predicate(default_objective(name)))
