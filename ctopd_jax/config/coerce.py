"""A section built from a mapping: each value checked against its field's type hint, converting
only lossless cases (1e3 for an integer); unknown keys refused, naming the known ones."""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Mapping

from ctopd_jax.config.algorithm_settings import algorithm_class, objectives_defining
from ctopd_jax.config.errors import ConfigError
from ctopd_jax.config.sections import AlgorithmSection, RolloutSection

# keys written as the user reads them whose field name cannot be a Python keyword
KEYWORD_KEYS = {RolloutSection: {"async": "async_rollouts"}}

_NON_FINITE = ("nan", "inf", "infinity")


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check `value` against the type hint `hint`, converting only lossless cases."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise ConfigError(f"{name}: {value!r} is not one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: {value!r} does not have type {hint}")
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"{name}: expected a list, got {value!r}")
            return tuple(_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{name}: expected a list of {len(args)} values like "
                              f"[{', '.join(a.__name__ for a in args)}], got {value!r}")
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{name}: expected null, got {value!r}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        # 1e3 and 1000.0 are integers written as floats: lossless, so accepted
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in _NON_FINITE:
            value = float("nan")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number (e.g. 1e-5), got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name}: {value!r} is not a finite number; give a finite value")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return build_section(hint, value, name)
    raise ConfigError(f"{name}: unsupported type {hint}")


def build_section(cls: type, values: Any, prefix: str = "") -> Any:
    where = prefix or "config"
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys, got {values!r}")
    if cls is AlgorithmSection:
        cls = algorithm_class(values.get("name", AlgorithmSection.name), values.get("modules") or ())
    for key, field_name in KEYWORD_KEYS.get(cls, {}).items():
        if key in values:
            if field_name in values:
                raise ConfigError(f"{where}.{key}: is {where}.{field_name} under another name; "
                                  "set one of the two")
            values = {(field_name if k == key else k): v for k, v in values.items()}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    not_names = [k for k in values if not isinstance(k, str)]
    if not_names:  # `1: x` or `null: x` in YAML: sorting them with the names would crash
        raise ConfigError(f"{where}: key {not_names[0]!r} is not a name; use one of the known "
                          f"keys of {where}: {', '.join(sorted(known))}")
    # an absent section is built from {} too: `algorithm` then gets its objective's class
    values = {**{f.name: {} for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(hints[f.name]) and f.name not in values}, **values}
    unknown = sorted(set(values) - known)
    if unknown and issubclass(cls, AlgorithmSection):
        owned = {k: objectives_defining(k) for k in unknown}
        if all(owned.values()):  # keys of other objectives: say whose they are
            name = values.get("name", AlgorithmSection.name)
            raise ConfigError("; ".join(
                f"algorithm.{k} belongs to {', '.join(owners)}; remove it when "
                f"algorithm.name={name}" for k, owners in owned.items()))
    if unknown:
        dotted = ", ".join(f"{prefix + '.' if prefix else ''}{k}" for k in unknown)
        raise ConfigError(f"unknown config key(s) {dotted}; known keys of {where}: "
                          f"{', '.join(sorted(known))}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix + '.' if prefix else ''}{k}")
              for k, v in values.items()}
    return cls(**kwargs)
