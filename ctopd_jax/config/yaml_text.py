"""YAML text as people write it: numbers such as 1e-5 read as floats, a key given twice refused."""
from __future__ import annotations

import re
from typing import Any

import yaml


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads numbers as people write them.

    YAML 1.1 (PyYAML) only takes a float with a dot and a signed exponent (`1.0e-5`), so
    `1e-5`, `1E5`, `.5e3` and `1.0e38` come back as strings. This loader adds a float resolver
    for every decimal form Python's `float()` reads, and is used for config files and `--set`
    values alike (`load_yaml`)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                  |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice; PyYAML would silently keep the last one, so a run
    would train with values the file's first section did not say."""


def _refuse_duplicate_keys(node: yaml.Node, prefix: str = "") -> None:
    """Walk the composed node tree; the first key seen twice in one mapping raises
    DuplicateKeyError naming the dotted key and both lines (1-based)."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                name = f"{prefix}{key}"
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise DuplicateKeyError(
                        f"line {line}: key {name!r} appears twice (first on line "
                        f"{first_line[key]}); keep one of them (YAML would silently use the last)")
                first_line[key] = line
                _refuse_duplicate_keys(value_node, name + ".")
            else:
                _refuse_duplicate_keys(value_node, prefix)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, prefix)


def load_yaml(text: str) -> Any:
    """Parse YAML text with `YamlLoader` (numbers such as 1e-5 are floats); a key given twice
    in one mapping raises DuplicateKeyError."""
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
