"""One side of a distillation pair: a tokenizer from disk with its byte view and chat template.

Only the ``tokenizers`` library is used at run time (transformers is a test reference).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ctopd_jax.tokenization.assets import PACKAGED_DIR, resolve_tokenizer_dir
from ctopd_jax.tokenization.byte_view import detect_dummy_prefix, detect_kind, vocabulary_bytes
from ctopd_jax.tokenization.chat import ChatTemplateError, render_chat


class TokenizerLoadError(FileNotFoundError):
    """A tokenizer directory that is missing, unreadable, or lacks a field we need."""


def _token_content(value) -> str | None:
    if isinstance(value, dict):  # {"content": ..., "__type": "AddedToken"}
        return value.get("content")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizerSide:
    """A loaded tokenizer plus everything the pair machinery reads from it.

    Attributes:
      token_bytes: byte view of every id (list index = id).
      token_byte_len: int64 [V] lengths of ``token_bytes`` (int64: the aligner indexes with them).
      is_added: bool [V], added tokens (special or not): on the byte ruler with their content,
        never in a strict pair (SPEC §2).
      special_ids: ids of added tokens flagged special.
      dummy_prefix: "never" | "first" | "always" (see byte_view's module docstring).
    """
    name: str
    path: Path
    tokenizer: Tokenizer
    kind: str
    token_bytes: list
    token_byte_len: np.ndarray
    is_added: np.ndarray
    special_ids: frozenset
    eos_id: int
    pad_id: int
    bos_id: int | None
    chat_template: str | None
    special_token_strings: dict
    dummy_prefix: str

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size, added tokens included (|V| of SPEC §3)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without BOS/EOS (``add_special_tokens=False``, as SPEC §1.3)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:   # the one file to fix, not a traceback at the first prompt
            raise ChatTemplateError(
                f"{self.path / 'tokenizer_config.json'}: this tokenizer has no chat_template; add "
                "the model's `chat_template` there (or a chat_template.jinja beside it)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_token_strings)

    def render_prompt(self, prompt: str | list[dict], system: str | None = None) -> str:
        """A plain prompt string (one user turn, optional system turn) or a message list."""
        if isinstance(prompt, str):
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
        else:
            messages = prompt
        return self.render_chat(messages, add_generation_prompt=True)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TokenizerLoadError(f"{what}: cannot read {path}: {err}") from err


def _parse_json(text: str, path: Path, what: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TokenizerLoadError(f"{what}: cannot read {path}: {err}") from err


def _read_json(path: Path, what: str) -> dict:
    return _parse_json(_read_text(path, what), path, what)


def load_tokenizer_side(name_or_path, *, eos_token: str | None = None,
                        pad_token: str | None = None) -> TokenizerSide:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a directory or a known name.

    EOS is ``eos_token`` of tokenizer_config.json unless ``eos_token`` is given (for an instruct
    model that is its end-of-turn token, e.g. ``<|im_end|>`` / ``<|eot_id|>``). PAD falls back
    to EOS when the config has none (padding positions are never attended or supervised).
    """
    if str(name_or_path) == "char":   # the repository's character vocabulary (char_vocab.py)
        path = PACKAGED_DIR / "char"   # char_vocab.tokenizer_dir(); not imported: `python -m` runs it
    else:
        path = resolve_tokenizer_dir(name_or_path)
    raw = _read_text(path / "tokenizer.json", "tokenizer.json")
    spec = _parse_json(raw, path / "tokenizer.json", "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_str(raw)
    except Exception as err:  # the Rust side raises a plain Exception
        raise TokenizerLoadError(f"tokenizer.json at {path} is not a valid tokenizer: {err}") from err
    config_path = path / "tokenizer_config.json"
    config = _read_json(config_path, "tokenizer_config.json") if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")

    def token_id(field: str, override: str | None, required: bool) -> int | None:
        content = override if override is not None else _token_content(config.get(field))
        if content is None:
            if required:
                raise TokenizerLoadError(
                    f"{field}: {config_path} does not name one; add \"{field}\" to it or pass "
                    f"{field}=... to load_tokenizer_side")
            return None
        idx = tokenizer.token_to_id(content)
        if idx is None:
            raise TokenizerLoadError(f"{field}: {content!r} is not in the vocabulary of {path}")
        return idx

    kind = detect_kind(spec)
    table, is_added = vocabulary_bytes(tokenizer, kind)
    added = tokenizer.get_added_tokens_decoder()
    eos_id = token_id("eos_token", eos_token, required=True)
    pad_id = token_id("pad_token", pad_token, required=False)
    specials = {f: _token_content(config.get(f)) for f in ("bos_token", "eos_token", "pad_token",
                                                            "unk_token")}
    if eos_token is not None:
        specials["eos_token"] = eos_token
    return TokenizerSide(
        name=str(name_or_path), path=path, tokenizer=tokenizer, kind=kind, token_bytes=table,
        token_byte_len=np.fromiter((len(b) for b in table), dtype=np.int64, count=len(table)),
        is_added=is_added,
        special_ids=frozenset(i for i, t in added.items() if t.special),
        eos_id=eos_id, pad_id=eos_id if pad_id is None else pad_id,
        bos_id=token_id("bos_token", None, required=False),
        chat_template=template, special_token_strings={k: v for k, v in specials.items() if v},
        dummy_prefix=detect_dummy_prefix(spec) if kind == "metaspace" else "never")


@functools.lru_cache(maxsize=8)
def cached_tokenizer_side(name_or_path: str) -> TokenizerSide:
    """``load_tokenizer_side`` memoised per name (the real vocabularies take seconds to load)."""
    return load_tokenizer_side(name_or_path)
