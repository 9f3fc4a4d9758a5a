"""One GGUF file -> one transformers folder every command of the project reads: config.json,
float32 safetensors, tokenizer.json, tokenizer_config.json (with the chat template).

    convert_gguf(src, out_dir, sha256=None)

Decisions:
- All or nothing: the folder is written under a temporary name beside `out_dir`
  (`.NAME.partial-PID-*`) and renamed into place at the end, so an error or a kill leaves no
  half-written folder where a command (or the fetch cache) would take it for a finished one.
  A kill skips the clean-up, so the next conversion to the same place removes the temporary
  folders whose process is gone (a float32 model is gigabytes).
- Everything that can fail on the input (checksum, header, architecture, tokenizer metadata)
  is checked before the first tensor is dequantized.
- float32 on disk: the quantized values exactly, in the dtype the parity checks compare; shards
  of at most 4 GiB (the 1.5B model is two), read back through model.safetensors.index.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ctopd_jax.common.kill_points import kill_point
from ctopd_jax.common.run_dir import process_alive
from ctopd_jax.models.gguf_read import GGUFError, field, hf_config, hf_tensors, open_gguf
from ctopd_jax.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, tokenizer_config
from ctopd_jax.models.weights import write_safetensors_shards

MAX_SHARD_BYTES = 4 * 1024 ** 3


def sha256_of(path, progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256, read in 16 MiB blocks (`progress(bytes)` after each)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(16 * 1024 * 1024):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def check_sha256(path, expected: str) -> None:
    got = sha256_of(path)
    if got != expected.lower():
        raise GGUFError(f"{path}: sha256 is {got}, expected {expected.lower()}; the file is "
                        "damaged or another one: download or assemble it again")


def _tokenizer_files(reader, config: dict, out: Path) -> None:
    tokens = list(field(reader, "tokenizer.ggml.tokens", required=True))
    try:
        tokenizer = build_tokenizer(
            tokens, list(field(reader, "tokenizer.ggml.merges", [])),
            [int(t) for t in field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))],
            pre=field(reader, "tokenizer.ggml.pre", "default"),
            model=field(reader, "tokenizer.ggml.model", required=True))
    except GGUFTokenizerError as err:
        raise GGUFError(f"{reader.data.filename}: {err}") from None
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {name: config.get(f"{name}_id") for name in ("bos_token", "eos_token", "pad_token")}
    ids["unk_token"] = field(reader, "tokenizer.ggml.unknown_token_id")
    settings = tokenizer_config(tokens, ids, field(reader, "tokenizer.chat_template"),
                                config["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def _shards(reader) -> list[int]:
    """How many tensors go in each shard, planned from the tensor sizes as float32."""
    counts, size = [0], 0
    for tensor in reader.tensors:
        nbytes = int(tensor.n_elements) * 4
        if counts[-1] and size + nbytes > MAX_SHARD_BYTES:
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += nbytes
    return counts


def _weights(reader, config: dict, out: Path, progress: Callable[[str], None] | None) -> None:
    counts = _shards(reader)
    tensors = hf_tensors(reader, config)

    def shard(count: int) -> dict:
        taken = {}
        for _ in range(count):
            item = next(tensors, None)
            if item is None:   # the plan counted a skipped tensor (rope_freqs)
                break
            taken[item[0]] = item[1]
            kill_point("gguf_convert")   # one passage per tensor dequantized
            if progress is not None:
                progress(item[0])
        return taken

    write_safetensors_shards(out, len(counts), (shard(count) for count in counts))


def _remove_left_by_kills(out: Path) -> None:
    """The temporary folders of conversions to `out` whose process is gone (a conversion still
    running elsewhere keeps its own)."""
    prefix = f".{out.name}.partial-"
    for left in out.parent.glob(prefix + "*"):
        pid = left.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)


def convert_gguf(src, out_dir, sha256: str | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write the HF folder of GGUF file `src` at `out_dir` (which must not exist yet)."""
    src, out = Path(src), Path(out_dir)
    if out.exists():
        raise GGUFError(f"{out} already exists; remove it or choose another output folder")
    if sha256 is not None and src.is_file():
        check_sha256(src, sha256)
    reader = open_gguf(src)
    config = hf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_left_by_kills(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        _tokenizer_files(reader, config, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _weights(reader, config, staging, progress)
        os.chmod(staging, 0o755)   # mkdtemp's 0700 would hide the folder from other users
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
