"""The shared-vocabulary projection (SPEC §3): equally long ``s_ids`` / ``t_ids``.

Two rules:

- ``string`` (both sides ByteLevel, as the reference): key every vocabulary entry, added tokens
  included, by its token string with ``Ġ`` replaced by ``▁``; intersect the keys. When a key
  maps to several ids on one side (only added tokens can collide), the highest id wins, as a
  ``{key: id}`` dict built in id order would.
- ``bytes`` (any other pair): key every non-added token by its byte view; keys with more than
  one id on either side (ambiguous many-to-one) and added/special tokens are excluded.

Either way the pair (student EOS, teacher EOS) is appended when either EOS is not already
paired (decision for the ``bytes`` rule, where SPEC only states it for ByteLevel pairs: the EOS
pair is a strict pair, so its row needs the EOS column). Entries are ordered by student id,
the EOS pair last. |V| counts added tokens (``get_vocab_size(with_added_tokens=True)``).
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ctopd_jax.tokenization.byte_view import BYTE_LEVEL, is_byte_fallback_piece
from ctopd_jax.tokenization.side import TokenizerSide


class NoOverlapError(ValueError):
    """The two vocabularies share no token: strict distillation has nothing to supervise."""


@dataclasses.dataclass(frozen=True, eq=False)
class OverlapMap:
    s_ids: np.ndarray   # int32 [K]
    t_ids: np.ndarray   # int32 [K]
    teacher_vocab_size: int
    student_vocab_size: int
    rule: str
    eos_appended: bool

    @property
    def shared(self) -> int:
        """|V∩| (the EOS pair included when it was appended, as the reference counts it)."""
        return int(self.s_ids.shape[0])

    @property
    def jaccard(self) -> float:
        return self.shared / (self.teacher_vocab_size + self.student_vocab_size - self.shared)

    def summary(self) -> dict:
        return {"rule": self.rule, "V_T": self.teacher_vocab_size, "V_S": self.student_vocab_size,
                "V_shared": self.shared, "jaccard": self.jaccard,
                "eos_pair_appended": self.eos_appended}


def _string_keys(side: TokenizerSide) -> dict[str, int]:
    vocab = side.tokenizer.get_vocab(with_added_tokens=True)
    return {key.replace("Ġ", "▁"): idx for key, idx in sorted(vocab.items(), key=lambda kv: kv[1])}


def _byte_keys(side: TokenizerSide) -> dict[bytes, int]:
    """Byte sequence -> the one id that has it; ambiguous sequences are left out.

    A single-byte piece such as "7" and its byte-fallback twin <0x37> cover the same byte, but
    the tokenizer only emits the twin for bytes no piece covers, so the regular piece is the
    token to pair; only two or more regular pieces with equal bytes make a key ambiguous.
    """
    ids_by_bytes = collections.defaultdict(list)
    for idx, data in enumerate(side.token_bytes):
        if not side.is_added[idx] and data:
            ids_by_bytes[data].append(idx)
    keys = {}
    for data, ids in ids_by_bytes.items():
        if len(ids) > 1:
            ids = [i for i in ids if not is_byte_fallback_piece(side.tokenizer.id_to_token(i))]
        if len(ids) == 1:
            keys[data] = ids[0]
    return keys


def overlap_map(teacher: TokenizerSide, student: TokenizerSide,
                rule: str | None = None) -> OverlapMap:
    """``rule``: "string", "bytes" or None (string for two ByteLevel sides, else bytes)."""
    if rule is None:
        rule = "string" if teacher.kind == student.kind == BYTE_LEVEL else "bytes"
    if rule not in ("string", "bytes"):
        raise ValueError(f"rule: {rule!r}; use 'string', 'bytes' or None (automatic)")
    keys = _string_keys if rule == "string" else _byte_keys
    t_keys, s_keys = keys(teacher), keys(student)
    pairs = sorted((s_keys[k], t_keys[k]) for k in t_keys.keys() & s_keys.keys())
    if not pairs:
        raise NoOverlapError(
            f"overlap: {teacher.name!r} and {student.name!r} share no token under the {rule!r} "
            "rule; cross-tokenizer strict distillation needs a shared vocabulary")
    s_ids = [s for s, _ in pairs]
    t_ids = [t for _, t in pairs]
    append = student.eos_id not in set(s_ids) or teacher.eos_id not in set(t_ids)
    if append:
        s_ids.append(student.eos_id)
        t_ids.append(teacher.eos_id)
    return OverlapMap(s_ids=np.asarray(s_ids, np.int32), t_ids=np.asarray(t_ids, np.int32),
                      teacher_vocab_size=teacher.vocab_size, student_vocab_size=student.vocab_size,
                      rule=rule, eos_appended=append)
