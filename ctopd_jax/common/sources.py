"""Named sources: `owner:name` specs for model checkpoints, prompt files and evaluation sets.

Core modules never import an owner (the demo, say) themselves. A spec such as `demo:student`
names its owner; the first time an owner is asked for, `ctopd_jax.<owner>.sources` is imported
and registers its resolvers with `register`. So the demo ships its own model paths and data sets
and the trainer only knows this table.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

KINDS = ("model", "prompts", "dataset")
_RESOLVERS: dict[tuple[str, str], Callable[[str], object]] = {}


class SourceError(ValueError):
    """A named source that does not exist; the message names it and the fix."""


def register(kind: str, owner: str, resolver: Callable[[str], object]) -> None:
    if kind not in KINDS:
        raise ValueError(f"source kind {kind!r}; use one of {KINDS}")
    _RESOLVERS[(kind, owner)] = resolver


def is_named(spec: str) -> bool:
    owner, sep, name = spec.partition(":")
    return bool(sep and owner.isidentifier() and name and not Path(spec).exists())


def resolve(kind: str, spec: str, field: str) -> object:
    """What the owner of `spec` (`owner:name`) registered for `kind`, called with `name`."""
    owner, _, name = spec.partition(":")
    if (kind, owner) not in _RESOLVERS:
        try:
            importlib.import_module(f"ctopd_jax.{owner}.sources")
        except ImportError:
            pass
    if (kind, owner) not in _RESOLVERS:
        raise SourceError(f"{field}={spec!r}: no {kind} source named {owner!r}; give a path instead")
    return _RESOLVERS[(kind, owner)](name)
