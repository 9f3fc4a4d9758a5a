"""Per-token byte views of a vocabulary (SPEC §2).

Two vocabulary kinds are understood:

- ``byte_level`` (GPT-2 family, Qwen2/2.5, Llama-3): every character of a token string stands
  for one byte through GPT-2's printable-character table; we invert that table.
- ``metaspace`` (SentencePiece-style: Metaspace pre-tokenizer or a ``▁`` -> space decoder):
  ``▁`` is a space, ``<0xHH>`` is that one byte (byte fallback), anything else is UTF-8.

Added tokens (special or not) are their content as UTF-8 whatever the kind.

Dummy prefix (decision; SPEC asks to document it): a SentencePiece tokenizer may put a ``▁`` in
front of a text segment that the text does not contain. The per-VOCABULARY view here keeps
``▁`` as a space always; the per-SEQUENCE view (``sequence_byte_lengths``) removes that one
space from the first token of a text segment when the tokenizer added it, so the bytes of an
encoded string are the bytes of the string. See ``TokenizerSide.dummy_prefix``.
"""
from __future__ import annotations

import json
import re

import numpy as np

BYTE_LEVEL = "byte_level"
METASPACE = "metaspace"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def gpt2_printable_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves,
    the other 68 bytes to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# char -> chr(byte), so str.translate + latin-1 encode inverts the table at C speed
_TO_LATIN1 = {ord(ch): b for b, ch in gpt2_printable_table().items()}


def byte_level_token_bytes(token: str) -> bytes:
    """Bytes of a ByteLevel token string; a string outside the table (never produced by the
    model itself) falls back to its UTF-8."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def is_byte_fallback_piece(token: str) -> bool:
    """A SentencePiece ``<0xHH>`` piece: the one-byte fallback for bytes no piece covers."""
    return bool(_BYTE_PIECE.match(token))


def metaspace_token_bytes(token: str, replacement: str = "▁") -> bytes:
    match = _BYTE_PIECE.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(replacement, " ").encode("utf-8")


def _walk(node, kind_hits: set[str]) -> None:
    """Collect the component types in a tokenizer.json tree (pre-tokenizer, decoder, ...)."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "ByteLevel":
            kind_hits.add(BYTE_LEVEL)
        elif kind == "Metaspace":
            kind_hits.add(METASPACE)
        elif kind == "Replace" and "▁" in json.dumps(node.get("pattern", "")):
            kind_hits.add(METASPACE)
        for value in node.values():
            _walk(value, kind_hits)
    elif isinstance(node, list):
        for value in node:
            _walk(value, kind_hits)


def detect_kind(spec: dict) -> str:
    """``byte_level`` or ``metaspace`` from a parsed tokenizer.json; ValueError otherwise."""
    hits: set[str] = set()
    for part in ("pre_tokenizer", "decoder", "normalizer"):
        _walk(spec.get(part), hits)
    if hits == {BYTE_LEVEL}:
        return BYTE_LEVEL
    if hits == {METASPACE} or (METASPACE in hits and spec.get("model", {}).get("byte_fallback")):
        return METASPACE
    raise ValueError(
        f"tokenizer kind: found components {sorted(hits) or 'none'}; supported are ByteLevel "
        "(GPT-2/Qwen/Llama-3) and Metaspace/SentencePiece tokenizers. Convert the tokenizer to "
        "one of these kinds.")


def detect_dummy_prefix(spec: dict) -> str:
    """Where a SentencePiece-style tokenizer inserts a dummy ``▁``: "never", "first" (only the
    segment at the start of the input) or "always" (every text segment)."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace":
                scheme = node.get("prepend_scheme")
                if scheme is None:  # older files: add_prefix_space=True meant "always"
                    scheme = "always" if node.get("add_prefix_space", True) else "never"
                found.append(scheme)
            if node.get("type") == "Prepend" and node.get("prepend") == "▁":
                found.append("first")
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(spec.get("pre_tokenizer"))
    visit(spec.get("normalizer"))
    return found[0] if found else "never"


def vocabulary_bytes(tokenizer, kind: str) -> tuple[list[bytes], np.ndarray]:
    """Byte view of every id (added tokens included) and a bool mask of the added ids."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    size = max(size, max(added, default=-1) + 1)
    to_bytes = byte_level_token_bytes if kind == BYTE_LEVEL else metaspace_token_bytes
    table: list[bytes] = [b""] * size
    is_added = np.zeros(size, dtype=bool)
    for token, idx in tokenizer.get_vocab(with_added_tokens=False).items():
        table[idx] = to_bytes(token)
    for idx, token in added.items():
        table[idx] = token.content.encode("utf-8")
        is_added[idx] = True
    return table, is_added
