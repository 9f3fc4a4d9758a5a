"""The repository's own character vocabulary (`load_tokenizer_side("char")`): one token per
printable ASCII character, plus the chat and special tokens. Teacher and student of the
same-tokenizer demo pair (ctopd_jax/assets/demo_char/) share it.

    python -m ctopd_jax.tokenization.char_vocab      # (re)writes ctopd_jax/assets/tokenizers/char/

Every id:

    0  <|pad|>        padding (never attended, never supervised)
    1  <|bos|>        beginning of text (the chat template starts with it)
    2  <|end|>        end of a turn; the EOS (an assistant turn ends with it)
    3  <|system|>     opens a system turn
    4  <|user|>       opens a user turn
    5  <|assistant|>  opens an assistant turn (the generation prompt)
    6  <unk>          any character outside the table below
    7  "\\t"          tab
    8  "\\n"          newline
    9 .. 103          the printable ASCII characters " " (0x20) .. "~" (0x7E), in byte order:
                      id = 9 + (ord(c) − 0x20)

Chat template (one token per role marker, no whitespace added):
    <|bos|>{for each message: <|ROLE|>content<|end|>}[<|assistant|> when add_generation_prompt]

Format: a `tokenizers` BPE model with no merges over the byte-level alphabet (GPT-2's
printable-character table, so the byte view of every token is exact: ctopd_jax.tokenization.
byte_view), ByteLevel pre-tokenizer without regex splitting or prefix space, ByteLevel decoder;
ids 0–6 are added special tokens. A non-ASCII character becomes <unk> per byte.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ctopd_jax.common.cli import Parser
from ctopd_jax.tokenization.assets import PACKAGED_DIR
from ctopd_jax.tokenization.byte_view import gpt2_printable_table

NAME = "char"
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<unk>")
CHARACTERS = "\t\n" + "".join(chr(c) for c in range(0x20, 0x7F))
CHAT_TEMPLATE = ("{{- bos_token }}{%- for message in messages %}"
                 "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}")


def tokenizer_dir() -> Path:
    return PACKAGED_DIR / NAME


def build_tokenizer():
    """The `tokenizers.Tokenizer` of the table in the module docstring."""

    table = gpt2_printable_table()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[table[ord(ch)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
            "eos_token": "<|end|>", "pad_token": "<|pad|>", "unk_token": "<unk>",
            "model_max_length": 512, "chat_template": CHAT_TEMPLATE}


def write(out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or tokenizer_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(build_tokenizer().to_str(pretty=True) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out_dir


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=None,
                        help="default: ctopd_jax/assets/tokenizers/char/")
    print(write(parser.parse_args(argv).out_dir))
    return 0


PROG = "python -m ctopd_jax.tokenization.char_vocab"

if __name__ == "__main__":
    from ctopd_jax.common.cli import run

    sys.exit(run(main, None, PROG))
