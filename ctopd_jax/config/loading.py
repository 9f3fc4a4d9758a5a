"""A run's configuration from a YAML file, `--set` overrides and `--mesh`, built and validated."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ctopd_jax.config.coerce import build_section
from ctopd_jax.config.errors import ConfigError, one_line
from ctopd_jax.config.overrides import drop_other_objectives_keys, parse_override, set_dotted
from ctopd_jax.config.sections import TrainConfig
from ctopd_jax.config.validate import validate
from ctopd_jax.config.yaml_text import DuplicateKeyError, load_yaml
from ctopd_jax.mesh.device_mesh import MeshError, parse_mesh


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                mesh: str | None = None) -> TrainConfig:
    """Read a YAML file, apply `--set` overrides and a `--mesh` flag, build and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: file not found; pass a YAML file such as "
                              "configs/tiny_cpu.yaml")
        try:
            tree = load_yaml(path.read_text(encoding="utf-8")) or {}
        except DuplicateKeyError as err:
            raise ConfigError(f"--config {path}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"--config {path}: not valid YAML: {one_line(err)}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: not a UTF-8 text file; pass a YAML file") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    file_algorithm = dict(tree["algorithm"]) if isinstance(tree.get("algorithm"), dict) else {}
    set_algorithm_keys = set()
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        if key.startswith("algorithm."):
            set_algorithm_keys.add(key.split(".", 2)[1])
    drop_other_objectives_keys(tree, file_algorithm, set_algorithm_keys)
    if "teachers" in tree and not tree["teachers"]:   # `teachers: []` would silently mean one
        raise ConfigError("teachers: is empty; list at least one teacher (each with name and "
                          "checkpoint), or remove the key to train with model.teacher")
    if mesh:
        try:
            tree["mesh"] = {**{"data": 1}, **parse_mesh(mesh)}
        except MeshError as err:
            raise ConfigError(f"--mesh {mesh}: {err}") from None
    return _finish(build_section(TrainConfig, tree))


# String fields that name a file or folder: a leading `~` is the user's home, as in a shell
# (Path() alone would create a folder literally named `~` in the current directory).
PATH_FIELDS = frozenset({
    "output_dir", "checkpoint.dir", "data.path", "evaluation.dataset", "lora.init_adapter",
    "model.student", "model.teacher", "model.student_tokenizer", "model.teacher_tokenizer",
    "model.teacher_base"})


def _expand_home(section: Any, prefix: str = "") -> Any:
    changes = {}
    for f in dataclasses.fields(section):
        value, dotted = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            expanded = _expand_home(value, dotted + ".")
            if expanded is not value:
                changes[f.name] = expanded
        elif dotted in PATH_FIELDS and isinstance(value, str) and value.startswith("~"):
            changes[f.name] = os.path.expanduser(value)
    return dataclasses.replace(section, **changes) if changes else section


def _finish(config: TrainConfig) -> TrainConfig:
    config = _expand_home(config)
    validate(config)
    return config


def from_dict(tree: Mapping[str, Any]) -> TrainConfig:
    return _finish(build_section(TrainConfig, dict(tree)))
