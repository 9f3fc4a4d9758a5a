"""`--set a.b=c` overrides: parsed as YAML scalars, written into the config tree."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import yaml

from ctopd_jax.config.algorithm_settings import algorithm_class, is_registered, objectives_defining
from ctopd_jax.config.errors import ConfigError, one_line
from ctopd_jax.config.sections import AlgorithmSection
from ctopd_jax.config.yaml_text import load_yaml


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if "[" in key:  # teachers[math].url: the list entry with that name
            node = _named_entry(node, key, dotted)
            continue
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _named_entry(node: dict, key: str, dotted: str) -> dict:
    """`teachers[math]` in a --set key: the entry of the `teachers` list whose name is math."""
    section, _, rest = key.partition("[")
    name = rest[:-1] if rest.endswith("]") else ""
    entries = node.get(section)
    if not name or not isinstance(entries, list):
        raise ConfigError(f"--set {dotted}: {key!r} names no list entry; write "
                          f"{section}[NAME].field=value for an entry of the file's {section}:")
    for entry in entries:
        if isinstance(entry, dict) and str(entry.get("name")) == name:
            return entry
    names = ", ".join(str(e.get("name")) for e in entries if isinstance(e, dict))
    raise ConfigError(f"--set {dotted}: no {section}: entry is named {name!r}; the file's "
                      f"entries are {names or 'none'}")


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", yaml-parsed c)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: write section.key=value, e.g. --set optimizer.lr=1e-5")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {one_line(err)}") from None
    return key.strip(), value



def drop_other_objectives_keys(tree: dict, file_algorithm: Mapping[str, Any],
                                set_keys: set[str]) -> None:
    """Switching the objective on the command line (`--set algorithm.name=X` over a file that
    names another one) drops the FILE's algorithm keys that X does not define but another
    registered objective does, e.g. tiny_cpu.yaml's `ctkd_topk` (topk_strict's k) under
    `--set algorithm.name=simct`: those keys were written for the file's objective.

    The rule a user sees: the keys of the objective a config file names must belong to it, and
    so must every `--set algorithm.*` key; only the base file's keys for the objective it named
    give way when the command line picks another one. A key no objective defines is still
    refused (a typo), and so is another objective's key in a file that names the objective
    itself or given with `--set` (`build_section` then says which objectives the key belongs to).
    (Chosen over moving `ctkd_topk` out of tiny_cpu.yaml, the demo's own top-k config, and over
    ignoring every foreign key, which would hide a `--set` that does nothing.)"""
    section = tree.get("algorithm")
    if not isinstance(section, dict):
        return
    name = section.get("name", AlgorithmSection.name)
    if name == file_algorithm.get("name", AlgorithmSection.name):
        return
    modules = section.get("modules") or ()
    if not is_registered(name, modules):
        return  # `build_section` reports the unknown algorithm.name (or module)
    own = {f.name for f in dataclasses.fields(algorithm_class(name, modules))}
    for key in file_algorithm:
        if key not in own and key not in set_keys and key in section and objectives_defining(key):
            del section[key]
