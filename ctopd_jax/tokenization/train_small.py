"""Train the two small tokenizers the CPU demo and the tests use, from text generated here.

    python -m ctopd_jax.tokenization.train_small [--out ctopd_jax/assets/tokenizers]

- ``tiny_bpe``: byte-level BPE, digits split one by one (Qwen-style pre-tokenizer regex),
  ChatML template (``<|im_start|>`` / ``<|im_end|>``), EOS ``<|im_end|>``, pad ``<|endoftext|>``.
  The demo TEACHER uses it.
- ``tiny_unigram``: Unigram with ``<0xHH>`` byte fallback, Metaspace (``▁``, dummy prefix on the
  first segment only, like Llama-2 SentencePiece), Llama-3 style template
  (``<|start_header_id|>`` ... ``<|eot_id|>``), EOS ``<|eot_id|>``. The demo STUDENT uses it.

The two disagree on purpose (digits single vs merged, spaces attached differently) so that the
strict alignment has real mismatch groups, while the arithmetic vocabulary is covered well by
both. Output is deterministic for a fixed seed (the corpus is seeded; the trainers are
deterministic on one thread).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"

# The Qwen2 / cl100k-style split: words with a leading non-letter, single digits, punctuation runs.
QWEN_STYLE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

_WORDS = {"plus": "+", "minus": "-", "times": "*"}
_FILLER = (
    "Let's think step by step. First, we compute the first operation. Then we use the result. "
    "So the final answer is the number below. Check: the result is correct. "
    "A number is even or odd. The sum of two numbers, the difference, the product. "
    "How many apples does she have left? He buys some pens and gives away a few. "
    "Please reason step by step, and put your final answer within \\boxed{}. "
    "You are a helpful assistant. Question Answer Solution Compute What is the total?"
)


def _eval(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def generate_corpus(num_lines: int = 6000, seed: int = 0) -> list[str]:
    """Arithmetic word problems and worked answers in several surface forms (digits, + - * =,
    short English), plus a little generic text so other inputs are not all byte fallback."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b, c = rng.randint(0, 99), rng.randint(0, 20), rng.randint(0, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        word = {v: k for k, v in _WORDS.items()}[op1]
        first = _eval(a, op1, b)
        ans = _eval(first, op2, c)
        form = rng.randrange(4)
        if form == 0:
            lines.append(f"Question: What is {a} {word} {b}? Answer: {first}")
        elif form == 1:
            lines.append(f"Compute {a} {op1} {b} {op2} {c}.")
            lines.append(f"{a} {op1} {b} = {first}. {first} {op2} {c} = {ans}. The answer is {ans}.")
        elif form == 2:
            lines.append(f"{a}{op1}{b}={first}, so {first}{op2}{c}={ans}. \\boxed{{{ans}}}")
        else:
            lines.append(f"Tom has {a} apples and gets {b} more. Now he has {a + b} apples.")
    lines.extend(_FILLER.split(". ") * 20)
    # Rendered chat scaffolding, so role names and headers become whole tokens.
    for role in ("system", "user", "assistant"):
        lines.extend([f"<|im_start|>{role}\n", f"<|start_header_id|>{role}<|end_header_id|>\n\n"] * 50)
    lines.extend(["Hello, world! (1, 2, 3) [x] {y} #$%&'\"/:;<>@^_`|~"] * 10)
    return lines


def _specials(tokens: list[str]) -> list[AddedToken]:
    return [AddedToken(t, special=True, normalized=False) for t in tokens]


def train_tiny_bpe(corpus: list[str], vocab_size: int = 800) -> tuple[Tokenizer, dict]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_STYLE_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), show_progress=False, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(_specials(specials))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    return tok, config


def train_tiny_unigram(corpus: list[str], vocab_size: int = 640) -> tuple[Tokenizer, dict]:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=["<unk>"], unk_token="<unk>",
        max_piece_length=8)
    tok.train_from_iterator(corpus, trainer)
    # The trainer has no byte-fallback option: append the 256 <0xHH> pieces with a score below
    # every learned piece (so they are used only for characters the vocabulary lacks) and
    # switch byte_fallback on, the layout SentencePiece uses.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    floor = min(score for _, score in vocab) - 1.0
    vocab.extend([f"<0x{b:02X}>", floor] for b in range(256))
    spec["model"]["byte_fallback"] = True
    # SentencePiece-style decoding (as Llama-2's tokenizer.json does it): ▁ -> space, bytes
    # back from <0xHH>, then drop the one leading space the dummy prefix put there.
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(_specials(specials))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": LLAMA3_STYLE_TEMPLATE,
    }
    return tok, config


def save(tok: Tokenizer, config: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    corpus = generate_corpus(seed=args.seed)
    for name, train in (("tiny_bpe", train_tiny_bpe), ("tiny_unigram", train_tiny_unigram)):
        tok, config = train(corpus)
        save(tok, config, args.out / name)
        print(f"{name}: vocab {tok.get_vocab_size(with_added_tokens=True)} -> {args.out / name}")


if __name__ == "__main__":
    main()
