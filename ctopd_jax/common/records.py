"""Rows of jsonl / parquet files and chat-message cells, validated with `file:line` errors.

One reader serves the training prompt files (`data/prompts.py`), the evaluation sets (`data/eval_sets.py`)
and graded sample files (`evaluate.py`), so a malformed row reads the same everywhere:
`path:LINE: what is wrong; how to fix it` (`path:row N` for parquet, N counted from 1).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RecordError(ValueError):
    """A data file or row that cannot be used; the message names the file and line."""


Rows = list[tuple[str, dict[str, Any]]]   # ("path:line", row)


def read_jsonl(path: Path) -> Rows:
    """Every non-blank line of a jsonl file as a JSON object."""
    rows = []
    try:
        lines = Path(path).read_bytes().split(b"\n")
    except IsADirectoryError:
        raise RecordError(f"{path}: is a directory; give a .jsonl file") from None
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecordError(f"{path}:{number}: not UTF-8 text (byte {err.start}); save the file "
                              "as UTF-8 jsonl") from None
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordError(f"{where}: not valid JSON ({err.msg}); each line must be one "
                              "JSON object: fix or remove the line") from None
        if not isinstance(row, dict):
            raise RecordError(f"{where}: expected a JSON object per line, got "
                              f"{type(row).__name__}")
        field = _lone_surrogate(row, "")
        if field is not None:
            raise RecordError(f"{where}: {field} holds a lone surrogate escape (a \\ud800-\\udfff "
                              "without its pair), which is no character and no tokenizer encodes; "
                              "fix the escape or remove the row")
        rows.append((where, row))
    return rows


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The field (`prompt`, `messages[0].content`) of the first string holding a lone surrogate:
    JSON allows the escape "\\ud800" alone, UTF-8 (every tokenizer's input) cannot hold it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the row"
        return None
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key, "") is not None:
            return f"the key {key.encode('utf-8', 'backslashreplace').decode()!r}"
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _lone_surrogate(item, sub)
        if found is not None:
            return found
    return None


def read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq   # heavy import: only for parquet files

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for damaged files
        raise RecordError(f"{path}: cannot read as parquet: {err}") from None
    return [(f"{path}:row {number}", row)
            for number, row in enumerate(table.to_pylist(), start=1)]


def chat_messages(value: Any, key: str, where: str) -> tuple[dict[str, str], ...]:
    """A prompt cell as chat messages: a plain string is one user turn."""
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f"{where}: column {key!r} is an empty string; remove the row")
        return ({"role": "user", "content": value},)
    if hasattr(value, "tolist"):  # numpy arrays from parquet list columns
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise RecordError(f"{where}: column {key!r} must be a non-empty string or a non-empty "
                          f"list of {{role, content}} messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise RecordError(f"{where}: {key}[{i}] must be an object with string 'role' and "
                              f"'content', got {message!r}")
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)
