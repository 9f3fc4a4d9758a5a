"""A `tokenizers` tokenizer.json (and tokenizer_config.json) from a GGUF file's tokenizer.ggml.*
metadata: the vocabulary in id order, the merges, each token's type, the special ids, the chat
template.

Decisions:
- Byte-level BPE only (`tokenizer.ggml.model` "gpt2", what Llama-3, Qwen2 and SmolLM ship);
  a SentencePiece vocabulary ("llama") is refused with the field named.
- The split before BPE is not in the vocabulary: GGUF names it (`tokenizer.ggml.pre`) and each
  name stands for one model family's pre-tokenizer, rebuilt here for the ones this project
  converts. An unknown name is refused rather than guessed: a wrong split tokenizes every
  number or space run differently from the model's training.
- Control tokens (type 3) become special added tokens (never split, skipped when decoding
  with skip_special_tokens); user-defined ones (type 4) added but not special, as the model's
  own files have them (Qwen's <tool_call>, FIM markers).
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

CONTROL, USER_DEFINED = 3, 4
# Qwen2's split (its tokenizer.json's regex): contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newline runs, other whitespace.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3's split: as Qwen2's but digits in runs of up to three.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        _byte_level(use_regex=False)])


# tokenizer.ggml.pre -> (normalizer or None, pre-tokenizer factory)
PRE_TOKENIZERS = {
    "qwen2": (normalizers.NFC, lambda: _split(QWEN2_SPLIT)),
    "llama-bpe": (None, lambda: _split(LLAMA3_SPLIT)),
    # SmolLM (the StarCoder family's split): each digit alone, then GPT-2's byte-level regex
    "smollm": (None, lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)])),
    "gpt2": (None, lambda: _byte_level(use_regex=True)),
    "default": (None, lambda: _byte_level(use_regex=True)),
}


class GGUFTokenizerError(ValueError):
    """The GGUF tokenizer metadata cannot be rebuilt (the message names the field)."""


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int],
                    pre: str, model: str = "gpt2") -> Tokenizer:
    """The tokenizer the metadata describes (ids = positions in `tokens`)."""
    if model != "gpt2":
        raise GGUFTokenizerError(f"GGUF tokenizer.ggml.model is {model!r}; only byte-level BPE "
                                 "('gpt2': Llama-3, Qwen2, SmolLM) converts")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"GGUF tokenizer.ggml.pre is {pre!r}; known splits: "
                                 f"{sorted(PRE_TOKENIZERS)} (add the family's split to "
                                 "ctopd_jax/models/gguf_tokenizer.py)")
    if len(token_types) != len(tokens):
        raise GGUFTokenizerError(f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries "
                                 f"for {len(tokens)} tokens; the file is damaged")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not "
                                     "'left right'; the file is damaged")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     byte_fallback=False))
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    if normalizer is not None:
        tokenizer.normalizer = normalizer()
    tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=kind == CONTROL, normalized=False)
             for i, kind in enumerate(token_types) if kind in (CONTROL, USER_DEFINED)]
    tokenizer.add_tokens(added)
    return tokenizer


def tokenizer_config(tokens: list[str], ids: dict[str, int | None],
                     chat_template: str | None, max_length: int) -> dict:
    """tokenizer_config.json: the special tokens by content, the chat template, no BOS added
    (the chat templates of these models write what they need)."""
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
           "add_eos_token": False, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    for name, token_id in ids.items():
        if token_id is not None and 0 <= token_id < len(tokens):
            out[name] = tokens[token_id]
    if chat_template:
        out["chat_template"] = chat_template
    return out
