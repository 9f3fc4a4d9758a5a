"""Train the two small tokenizers the CPU demo and the tests use, from text generated here.

    python -m ctopd_jax.train_tokenizers [--out ctopd_jax/assets/tokenizers]

- ``tiny_bpe``: byte-level BPE (GPT-2 style split, numbers kept whole), ChatML template (``<|im_start|>`` / ``<|im_end|>``), EOS ``<|im_end|>``, pad ``<|endoftext|>``.
  The demo TEACHER uses it.
- ``tiny_unigram``: Unigram with ``<0xHH>`` byte fallback, Metaspace (``▁``, dummy prefix on the
  first segment only, like Llama-2 SentencePiece), scores estimated by counting (see
  ``_unigram_pieces``), Llama-3 style template
  (``<|start_header_id|>`` ... ``<|eot_id|>``), EOS ``<|eot_id|>``. The demo STUDENT uses it.

The two segment differently (BPE merges vs whole-word Unigram pieces, different punctuation
handling) so the strict alignment has real mismatch groups, while the arithmetic vocabulary
(numbers, + - * =, the answer phrase) is mostly tokenized alike, so most demo positions are strict
pairs. The corpus is seeded and the Unigram is counted, so both files are reproducible.
"""
from __future__ import annotations

import collections
import json
import math
import random
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ctopd_jax.common.cli import Parser, seed
from ctopd_jax.tokenization.chat import LLAMA3_CHAT_TEMPLATE

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "tokenizers"

# The Qwen2 / cl100k-style split: words with a leading non-letter, single digits, punctuation runs.
# GPT-2's split (a leading space stays on words and numbers), with Qwen's case-insensitive
# contractions. Qwen itself isolates single digits; here numbers stay whole so that the demo's
# answer digits can be strict pairs with the student's "▁12"-style pieces.
PRE_TOKENIZER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
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
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLIT), behavior="isolated"),
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


def _unigram_pieces(corpus: list[str], pre_tokenizer, budget: int) -> list[tuple[str, float]]:
    """A unigram vocabulary estimated by counting: every character, then the most frequent
    pre-tokenized words (``▁word``), scored by log relative frequency.

    Why not ``UnigramTrainer``: on this small, repetitive corpus it keeps ``▁`` as a piece of
    its own and never proposes ``▁is`` / ``▁+`` / ``▁answer``, which would leave almost every
    demo position in a mismatch group. Counting whole words gives a SentencePiece-like
    vocabulary whose Viterbi segmentation keeps frequent words whole and splits the rest into
    characters (then bytes), which is what the demo needs.
    """
    words: collections.Counter = collections.Counter()
    chars: collections.Counter = collections.Counter()
    for line in corpus:
        for piece, _ in pre_tokenizer.pre_tokenize_str(line):
            words[piece] += 1
            chars.update(piece)
    total_chars = sum(chars.values())
    total_words = sum(words.values())
    pieces = {ch: math.log(n / total_chars) for ch, n in chars.items()}
    ranked = sorted((w for w in words if len(w) > 1), key=lambda w: (-words[w], w))
    for word in ranked[:max(0, budget - len(pieces))]:
        pieces[word] = math.log(words[word] / total_words)
    return sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0]))


def train_tiny_unigram(corpus: list[str], vocab_size: int = 640) -> tuple[Tokenizer, dict]:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    # Punctuation is split off words (as the BPE side does) so "▁9" + "." can pair with "Ġ9" + ".".
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        pre_tokenizers.Punctuation(behavior="isolated")])
    pieces = _unigram_pieces(corpus, pre_tokenizer, vocab_size - 1)
    floor = min(score for _, score in pieces) - 1.0
    # The SentencePiece byte-fallback layout: <unk> first, 256 <0xHH> pieces scored below every
    # learned piece so they are used only for characters the vocabulary lacks.
    vocab = [("<unk>", 0.0), *pieces, *((f"<0x{b:02X}>", floor) for b in range(256))]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizer
    # SentencePiece-style decoding (as Llama-2's tokenizer.json does it): ▁ -> space, bytes
    # back from <0xHH>, then drop the one leading space the dummy prefix put there.
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(_specials(["<unk>", *specials]))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }
    return tok, config


def save(tok: Tokenizer, config: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m ctopd_jax.train_tokenizers",
                    description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument("--seed", type=seed, default=0)
    args = parser.parse_args(argv)
    corpus = generate_corpus(seed=args.seed)
    for name, train in (("tiny_bpe", train_tiny_bpe), ("tiny_unigram", train_tiny_unigram)):
        tok, config = train(corpus)
        save(tok, config, args.out / name)
        print(f"{name}: vocab {tok.get_vocab_size(with_added_tokens=True)} -> {args.out / name}")


if __name__ == "__main__":
    from ctopd_jax.common.cli import run

    sys.exit(run(main, None, "python -m ctopd_jax.train_tokenizers"))
