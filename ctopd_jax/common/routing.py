"""Which teacher scores which prompt, for a run with several named teachers (`teachers:`).

Each data row picks its teacher by a field (`"teacher": "math"`) or falls back to the default;
a row naming no known teacher is one line naming the row (its index in the data file) and the
fix, raised when the data is read, before any training. Names are checked once here too, so a
config with two teachers of one name, or a default that is not among them, is refused alike.

    names = check_teacher_names(["math", "code"], default="math")
    by_teacher = route_rows(rows, names, default="math")  # {"math": [0, 2], "code": [1]}
    row_teachers(rows, names, default="math")             # ["math", "code", "math"]

The batch then splits by teacher (each with its own tokenizer, overlap map and alignment) and
metrics are reported per name; that wiring belongs to the loop, not to this module.
"""
from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


def check_teacher_names(names, default: str | None = None, field: str = "teachers") -> tuple:
    """The names in order, or one ValueError line naming the bad entry."""
    names = tuple(names)
    if not names:
        raise ValueError(f"{field}: the list is empty; name at least one teacher")
    seen = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{field}[{i}].name: {name!r} is not a name (letters, digits, _ "
                             f"and -, starting with a letter or _)")
        if name in seen:
            raise ValueError(f"{field}[{i}].name: {name!r} is used twice; give each teacher its "
                             f"own name")
        seen.add(name)
    if default is not None and default not in seen:
        raise ValueError(f"data.default_teacher: {default!r} is not one of the teachers "
                         f"({', '.join(names)})")
    return names


def row_teachers(rows, names, default: str | None = None, key: str = "teacher",
                 source: str = "data", row_names=None) -> list[str]:
    """Each row's teacher name. `row_names` (e.g. each prompt's "file:line") name a bad row
    instead of `source row <index>`."""
    known = set(names)
    chosen_names = []
    for index, row in enumerate(rows):
        where = row_names[index] if row_names is not None else f"{source} row {index}"
        chosen = row.get(key) if isinstance(row, dict) else None
        if chosen is None:
            if default is None:
                raise ValueError(f"{where}: no {key!r} field and no default teacher;"
                                 f" add the field or set the default")
            chosen = default
        if chosen not in known:
            raise ValueError(f"{where}: {key} {chosen!r} is not one of the teachers "
                             f"({', '.join(names)}); add it under teachers: or fix the row")
        chosen_names.append(chosen)
    return chosen_names


def route_rows(rows, names, default: str | None = None, key: str = "teacher",
               source: str = "data", row_names=None) -> dict[str, list[int]]:
    """Row indices per teacher name (every name present, in `names` order); `row_teachers`
    picks each row's."""
    by_teacher = {name: [] for name in names}
    for index, name in enumerate(row_teachers(rows, names, default, key, source, row_names)):
        by_teacher[name].append(index)
    return by_teacher
