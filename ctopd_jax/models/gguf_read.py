"""Read a llama.cpp GGUF file as a transformers checkpoint: its config.json dict and its tensors
under HF names, dequantized to float32 by the `gguf` package (the format's own reader; no block
decoder is written here).

Decisions:
- Llama and Qwen2 only, the two families `Decoder` implements; any other `general.architecture`
  is a `GGUFError` naming it, before a tensor is read.
- A file is checked whole before anything is written: the magic, a header the reader can parse,
  and every tensor's bytes inside the file (a download cut short is the usual damage).
- llama.cpp's converter permutes the rows of Llama's q/k projections (its RoPE rotates adjacent
  pairs, transformers' rotates halves); `unpermute_rope_rows` undoes it. Qwen2 files are written
  unpermuted by the same converter, so they are read as they are.
- A file without `output.weight` ties the output head to the embedding (SmolLM2); one with it
  (the Qwen2.5 files, where the head was quantized apart from the embedding) is untied.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np

from ctopd_jax.models.config import ModelConfig, ModelConfigError

FAMILIES = ("llama", "qwen2")
MAGIC = b"GGUF"

# GGUF tensor name -> HF name ({i}: the layer).
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")
_IGNORED = re.compile(r"^rope_freqs\.weight$")   # llama3 rope factors; read from the metadata


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file, the problem and the fix."""


def open_gguf(path) -> gguf.GGUFReader:
    """The reader of a complete GGUF file, or a GGUFError saying what is wrong with it."""
    src = Path(path)
    if not src.is_file():
        raise GGUFError(f"{src}: no such file; give the path of a .gguf file")
    with src.open("rb") as handle:
        magic = handle.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{src}: not a GGUF file (it starts {magic!r}, a GGUF file starts "
                        f"{MAGIC!r}); give a llama.cpp .gguf model file")
    try:
        reader = gguf.GGUFReader(src, "r")
    except (ValueError, IndexError, KeyError, OSError) as err:   # numpy views past the end
        raise GGUFError(f"{src}: truncated or damaged GGUF file ({' '.join(str(err).split())}); "
                        "download or assemble it again") from None
    size = src.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFError(f"{src}: truncated GGUF file: tensor {tensor.name} ends at byte {end} "
                            f"but the file has {size} bytes; download or assemble it again")
    return reader


def field(reader: gguf.GGUFReader, key: str, default=None, *, required: bool = False):
    """One metadata value (a string, a number or a list), or `default`."""
    entry = reader.fields.get(key)
    if entry is None:
        if required:
            raise GGUFError(f"GGUF metadata has no {key!r}; the file was not written by "
                            "llama.cpp's converter for a Llama / Qwen2 model")
        return default
    return entry.contents()


def architecture(reader: gguf.GGUFReader) -> str:
    arch = field(reader, "general.architecture", required=True)
    if arch not in FAMILIES:
        raise GGUFError(f"GGUF general.architecture is {arch!r}; only {' and '.join(FAMILIES)} "
                        "models convert (the decoder implements those two)")
    return arch


def hf_config(reader: gguf.GGUFReader) -> dict:
    """The transformers config.json dict the file's metadata describes."""
    arch = architecture(reader)

    def need(key):
        return field(reader, f"{arch}.{key}", required=True)

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(field(reader, f"{arch}.rope.dimension_count", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = len(field(reader, "tokenizer.ggml.tokens", required=True))
    # float32 metadata (eps, theta) read back at its shortest decimal (1e-05, not 9.99e-06)
    eps = float(str(np.float32(need("attention.layer_norm_rms_epsilon"))))
    theta = float(str(np.float32(field(reader, f"{arch}.rope.freq_base", 10000.0))))
    if field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"GGUF {arch}.rope.scaling.type is set; RoPE scaling from GGUF files "
                        "is not supported")
    try:
        cfg = ModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")), num_heads=heads,
            num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim, rope_theta=theta, rms_norm_eps=eps,
            tie_word_embeddings="output.weight" not in names, qkv_bias=arch == "qwen2",
            max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
            family=arch)
    except ModelConfigError as err:
        raise GGUFError(f"GGUF metadata describes no valid model: {err}") from None
    out = cfg.to_hf_dict()
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = int(value)
    return out


def hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor name, None for one to skip; GGUFError for an unknown one."""
    if _IGNORED.match(name):
        return None
    match = _LAYER.match(name)
    template = name if match is None else name.replace(f"blk.{match.group(1)}.", "blk.{i}.", 1)
    if template not in _NAMES:
        raise GGUFError(f"GGUF tensor {name!r} has no place in a Llama / Qwen2 decoder; the file "
                        "holds another architecture than its metadata says")
    return _NAMES[template].format(i=match.group(1) if match else "")


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Its converter reorders each head's rows from
    [first half | second half] to interleaved pairs; this puts row 2j back at j and row 2j+1
    at j + head_dim/2 (works on biases too: rows are the first axis)."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return (weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def hf_tensors(reader: gguf.GGUFReader, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for every tensor, one dequantized at a time."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        # ggml lists dimensions fastest first; numpy (and HF) slowest first
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        value = np.asarray(value, dtype=np.float32).reshape(shape)
        if config["model_type"] == "llama":
            proj = name.split(".")[-2]
            if proj in heads:
                value = unpermute_rope_rows(value, heads[proj])
        yield name, np.ascontiguousarray(value)
