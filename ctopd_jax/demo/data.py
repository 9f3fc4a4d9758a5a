"""Where the demo's files live: prompt files for the trainer and the committed checkpoints.

``ctopd_jax.data.prompts.resolve_named_source`` turns ``data.path: demo:train`` into
``prompt_file("train")``; ``checkpoint_dir("teacher" | "student")`` is what ``model.teacher:
demo:teacher`` / ``model.student: demo:student`` name.

Prompt files are derived data (the task is deterministic), so they are written on demand to a
cache directory (``$CTOPD_JAX_CACHE`` or ``~/.cache/ctopd_jax``) and rewritten only when their
content would change.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ctopd_jax.common import cache as ctopd_cache
from ctopd_jax.demo import task

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
ROLES = ("teacher", "student")
SPLITS = ("train", "held_out")


def cache_dir() -> Path:
    return ctopd_cache.cache_dir("demo")


def prompt_file(split: str) -> Path:
    """A jsonl of ``{"prompt", "answer", "response"}`` rows for ``split`` (written if needed)."""
    if split not in SPLITS:
        raise ValueError(f"demo split {split!r} is unknown; use one of {SPLITS} (e.g. demo:train)")
    return cached_jsonl(f"{split}.jsonl", task.split(split))


def cached_jsonl(name: str, problems) -> Path:
    """The problems' rows (`to_row()`) as `name` in the demo cache, rewritten only when the
    content would change."""
    text = "".join(json.dumps(p.to_row()) + "\n" for p in problems)
    path = cache_dir() / name
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.replace(path)  # atomic: concurrent readers never see half a file
        except OSError as err:   # a read-only home, a full disk: one line, with the way out
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise ctopd_cache.cache_write_error(path.parent, err) from None
    return path


def checkpoint_dir(role: str) -> Path:
    """The committed HF-style checkpoint directory of the demo ``role``."""
    if role not in ROLES:
        raise ValueError(f"demo model {role!r} is unknown; use demo:teacher or demo:student")
    path = ASSET_DIR / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no checkpoint; rebuild it with `python -m ctopd_jax.demo.pretrain`")
    return path
