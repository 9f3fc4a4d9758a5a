"""The project's cache folder: derived files written on demand (the demo's prompt files, the
real tokenizers built by `python -m ctopd_jax.setup_assets`).

    $CTOPD_JAX_CACHE, default ~/.cache/ctopd_jax
        demo/        the demo's prompt files (`data.path: demo:train`), rewritten when they change
        tokenizers/  qwen2.5 and llama3 (setup_assets)

A cache that cannot be written (a read-only home, a full disk) is one `CacheError` naming the
folder, the reason and the way out: point CTOPD_JAX_CACHE at a folder that may be written.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "CTOPD_JAX_CACHE"


class CacheError(ValueError):
    """The cache folder refused a write; the message names CTOPD_JAX_CACHE as the way out."""


def cache_dir(sub: str = "") -> Path:
    """`$CTOPD_JAX_CACHE/<sub>` (default ~/.cache/ctopd_jax/<sub>)."""
    base = os.environ.get(CACHE_VARIABLE)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "ctopd_jax"
    return root / sub if sub else root


def cache_write_error(path: Path, err: OSError) -> CacheError:
    """One line for a write into the cache the file system refused."""
    reason = err.strerror or str(err)
    return CacheError(f"cache {path}: {reason} ({CACHE_VARIABLE}="
                      f"{os.environ.get(CACHE_VARIABLE, '')!r}, default ~/.cache/ctopd_jax); set "
                      f"{CACHE_VARIABLE} to a folder you may write, e.g. "
                      f"{CACHE_VARIABLE}=/tmp/ctopd_jax_cache")
