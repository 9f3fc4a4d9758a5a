"""Where tokenizers live: committed small ones, and real ones built into a cache at setup."""
from __future__ import annotations

import os
from pathlib import Path

from ctopd_jax.common.cache import cache_dir

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"
PACKAGED_NAMES = ("tiny_bpe", "tiny_unigram")
CACHED_NAMES = ("qwen2.5", "llama3")


def cache_root() -> Path:
    """``$CTOPD_JAX_CACHE/tokenizers`` or ``~/.cache/ctopd_jax/tokenizers``."""
    return cache_dir("tokenizers")


def resolve_tokenizer_dir(name_or_path: str | os.PathLike) -> Path:
    """A directory holding tokenizer.json: an existing path (a tokenizer.json file names its
    directory), or one of the names tiny_bpe, tiny_unigram, qwen2.5, llama3."""
    text = str(name_or_path)
    if text in PACKAGED_NAMES:
        return PACKAGED_DIR / text
    if text in CACHED_NAMES:
        path = cache_root() / text
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"tokenizer {text!r}: not built yet at {path}; run "
                "`python -m ctopd_jax.setup_assets` (needs the test extras and npm)")
        return path
    path = Path(text).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {text!r}: no such directory; give a directory with tokenizer.json or one "
            f"of the names {', '.join(PACKAGED_NAMES + CACHED_NAMES)}")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer {text!r}: {path} has no tokenizer.json (only the fast "
                                "tokenizer format is read; save it with save_pretrained)")
    return path
