"""Both-side re-tokenization of decoded responses (SPEC §1.3), batched.

Per sample, on each side (its own rendered prompt, tokenizer and EOS)::

    resp = tok(response, add_special_tokens=False)
    full = tok(prompt + response, add_special_tokens=False)
    prompt_len = len(full) - len(resp)      # SentencePiece dummy prefix: see _prompt_len
    input_ids = full + [eos]                # EOS appended even for truncated samples

The response tokens are ``full[prompt_len:] + [eos]`` (``response_lens`` counts the EOS).

Row convention (decision; the same on both sides): ``loss_mask[b, p]`` is True on the LOGITS
rows that PREDICT a response token or the final EOS, i.e. ``p`` in
``[prompt_len - 1, prompt_len - 1 + response_len)``; ``labels[b, p] = input_ids[b, p + 1]``
there and ``IGNORE_INDEX`` elsewhere. The logits row of response token ``k`` (0-based, EOS is
``k = response_len - 1``) is therefore ``b * T + prompt_len - 1 + k`` in the flattened
``[B * T]`` rows; alignment indices use exactly this. Padding is on the right with ``pad_id``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.tokenization.side import TokenizerSide

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True, eq=False)
class RetokenizedBatch:
    """One side of a batch. Arrays are numpy; the first block goes to the device.

    The ``resp_*`` fields describe the response tokens WITHOUT the final EOS (what lies on the
    byte ruler of SPEC §2), flat over the batch: sample ``b`` owns
    ``resp_offsets[b]:resp_offsets[b + 1]``.
    """
    input_ids: np.ndarray        # int32 [B, T]
    loss_mask: np.ndarray        # bool [B, T]
    labels: np.ndarray           # int32 [B, T]
    attention_mask: np.ndarray   # bool [B, T]
    prompt_lens: np.ndarray      # int32 [B]
    response_lens: np.ndarray    # int32 [B], EOS included
    resp_offsets: np.ndarray     # int64 [B + 1]
    resp_ids: np.ndarray         # int32 [N]
    resp_byte_len: np.ndarray    # int64 [N], after dummy-prefix removal
    resp_pairable: np.ndarray    # bool [N], False for added/special tokens
    resp_stripped: np.ndarray    # bool [N], one dummy-prefix space removed from this token
    resp_bytes: list             # bytes per sample, the concatenation of the byte views
    responses: list              # the response texts
    eos_id: int

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def row_base(self) -> np.ndarray:
        """int64 [B]: flat logits row that predicts the first response token of each sample."""
        return (np.arange(self.batch_size, dtype=np.int64) * self.seq_len
                + self.prompt_lens.astype(np.int64) - 1)

    @property
    def num_response_tokens(self) -> int:
        """Total response tokens, EOS included: the normalization denominator of SPEC §1."""
        return int(self.response_lens.sum())


def _validate(prompts, responses) -> None:
    if not isinstance(prompts, (list, tuple)) or not isinstance(responses, (list, tuple)):
        raise TypeError("prompts/responses: expected lists of strings")
    if len(prompts) != len(responses):
        raise ValueError(f"prompts/responses: {len(prompts)} prompts but {len(responses)} "
                         "responses; give one rendered prompt per response")
    if not prompts:
        raise ValueError("responses: the batch is empty")
    for name, items in (("prompts", prompts), ("responses", responses)):
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise TypeError(f"{name}[{i}]: expected str, got {type(item).__name__}")


def _dummy_prefix_strips(side: TokenizerSide, ids: np.ndarray, offsets, text: str,
                         begin: int) -> np.ndarray:
    """Positions (>= begin) of tokens whose leading space is a SentencePiece dummy prefix: the
    first token of a text segment (input start, or right after an added token) when the
    tokenizer prepends there, whose bytes start with a space the text does not have."""
    strip = np.zeros(len(ids) - begin, dtype=bool)
    if side.dummy_prefix == "never" or len(ids) == begin:
        return strip
    starts = [0] if side.dummy_prefix == "first" else \
        [0, *(np.flatnonzero(side.is_added[ids[:-1]]) + 1)]
    for pos in starts:
        if pos < begin or pos >= len(ids) or side.is_added[ids[pos]]:
            continue
        char = offsets[pos][0]
        if side.token_bytes[ids[pos]][:1] == b" " and not text[char:char + 1].isspace():
            strip[pos - begin] = True
    return strip


def _prompt_len(side: TokenizerSide, full, resp, prompt: str) -> int:
    """SPEC §1.3's ``len(full) - len(resp)``, except for tokenizers with a SentencePiece dummy
    prefix (decision): there ``tok(response)`` alone starts with an invented ``▁`` that changes
    its segmentation (``▁Question`` alone, ``Q u e s t i o n`` after a newline), so the
    difference of lengths lands anywhere. For those the boundary is read from the character
    offsets instead: prompt tokens are the tokens of ``full`` that start inside the prompt."""
    if side.dummy_prefix == "never":
        return len(full.ids) - len(resp.ids)
    cut = len(prompt)
    return sum(1 for start, _ in full.offsets if start < cut)


def retokenize(side: TokenizerSide, prompts, responses, *, pad_to_multiple: int = 1,
               max_length: int | None = None) -> RetokenizedBatch:
    """Re-tokenize ``responses`` after their rendered ``prompts`` on one side (SPEC §1.3)."""
    _validate(prompts, responses)
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple: must be >= 1, got {pad_to_multiple}")
    # Offsets are needed only to place a SentencePiece dummy prefix; without one the faster
    # offset-free batch encoder gives the same ids.
    encode = side.tokenizer.encode_batch
    if side.dummy_prefix == "never" and hasattr(side.tokenizer, "encode_batch_fast"):
        encode = side.tokenizer.encode_batch_fast
    fulls = encode([p + r for p, r in zip(prompts, responses)], add_special_tokens=False)
    resps = encode(list(responses), add_special_tokens=False)
    batch = len(prompts)
    prompt_lens = np.empty(batch, dtype=np.int32)
    seqs, resp_ids, resp_stripped = [], [], []
    for b, (full, resp) in enumerate(zip(fulls, resps)):
        ids = np.asarray(full.ids, dtype=np.int32)
        plen = _prompt_len(side, full, resp, prompts[b])
        if plen < 1:
            raise ValueError(
                f"prompts[{b}]: renders to {plen} tokens once the response is appended; a prompt "
                "must keep at least one token (its last logits row predicts the response)")
        prompt_lens[b] = plen
        seqs.append(ids)
        resp_ids.append(ids[plen:])
        resp_stripped.append(_dummy_prefix_strips(side, ids, full.offsets,
                                                  prompts[b] + responses[b], plen))
    lengths = np.array([len(s) + 1 for s in seqs], dtype=np.int64)
    longest = int(lengths.max())
    if max_length is not None and longest > max_length:
        worst = int(lengths.argmax())
        raise ValueError(f"max_length: sample {worst} needs {longest} tokens (prompt + response + "
                         f"EOS) > max_length={max_length}; raise max_length or shorten the input")
    seq_len = -(-longest // pad_to_multiple) * pad_to_multiple
    input_ids = np.full((batch, seq_len), side.pad_id, dtype=np.int32)
    for b, ids in enumerate(seqs):
        input_ids[b, :len(ids)] = ids
        input_ids[b, len(ids)] = side.eos_id
    response_lens = np.array([len(r) + 1 for r in resp_ids], dtype=np.int32)
    pos = np.arange(seq_len)[None, :]
    first = prompt_lens[:, None] - 1
    loss_mask = (pos >= first) & (pos < first + response_lens[:, None])
    labels = np.full((batch, seq_len), IGNORE_INDEX, dtype=np.int32)
    labels[:, :-1] = np.where(loss_mask[:, :-1], input_ids[:, 1:], IGNORE_INDEX)
    flat_ids = np.concatenate(resp_ids) if resp_ids else np.zeros(0, np.int32)
    stripped = np.concatenate(resp_stripped)
    byte_len = side.token_byte_len[flat_ids] - stripped
    table = side.token_bytes
    resp_bytes = []
    for ids, strip in zip(resp_ids, resp_stripped):
        if strip.any():
            resp_bytes.append(b"".join(table[i][1:] if s else table[i]
                                       for i, s in zip(ids.tolist(), strip.tolist())))
        else:
            resp_bytes.append(b"".join([table[i] for i in ids.tolist()]))
    return RetokenizedBatch(
        input_ids=input_ids, loss_mask=loss_mask, labels=labels,
        attention_mask=pos < lengths[:, None], prompt_lens=prompt_lens,
        response_lens=response_lens,
        resp_offsets=np.concatenate([[0], np.cumsum([len(r) for r in resp_ids])]).astype(np.int64),
        resp_ids=flat_ids, resp_byte_len=byte_len,
        resp_pairable=~side.is_added[flat_ids], resp_stripped=stripped,
        resp_bytes=resp_bytes, responses=list(responses), eos_id=side.eos_id)


def retokenize_pair(teacher: TokenizerSide, student: TokenizerSide, teacher_prompts,
                    student_prompts, responses, **kwargs):
    """(teacher_batch, student_batch) for the same decoded responses (SPEC §1.3)."""
    return (retokenize(teacher, teacher_prompts, responses, **kwargs),
            retokenize(student, student_prompts, responses, **kwargs))
