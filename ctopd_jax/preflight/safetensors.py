"""HF checkpoint folders read from their headers only: config.json, every shard's tensor table."""
from __future__ import annotations

import json
from pathlib import Path

from ctopd_jax.models.config import ModelConfig
from ctopd_jax.preflight.errors import fail


MAX_HEADER_BYTES = 100 * 2 ** 20   # the safetensors format's own limit


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of one shard ({name: {dtype, shape, data_offsets}}), checked against
    the file size; PreflightError names the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 0 or length > min(size - 8, MAX_HEADER_BYTES):
                raise fail(f"{path}: not a complete safetensors file ({size} bytes; the header "
                           "is missing or truncated); copy or download the shard again")
            raw = handle.read(length)
    except OSError as err:
        raise fail(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise fail(f"{path}: the safetensors header is not valid JSON (file damaged or "
                   "truncated); copy or download the shard again") from None
    if not isinstance(header, dict):
        raise fail(f"{path}: the safetensors header is not a table of tensors")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_bytes = size - 8 - length
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        for name, info in tensors.items():
            info["shape"] = [int(d) for d in info["shape"]]
    except (KeyError, TypeError, ValueError, IndexError):
        raise fail(f"{path}: the safetensors header lacks shapes or offsets (file damaged)") \
            from None
    if end > data_bytes:
        raise fail(f"{path}: truncated: the header describes {end:,} bytes of tensor data but "
                   f"the file holds {data_bytes:,}; copy or download the shard again")
    return tensors


def expected_hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Llama / Qwen2 config.json (HF's own layout, so this does
    not depend on how the NNX model stores its layers)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_hf_checkpoint(directory: Path, field_name: str):
    """config.json and every shard header of an HF directory; returns its ModelConfig."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise fail(f"{field_name}: {directory} has no config.json; give an HF checkpoint "
                   "directory (config.json + *.safetensors)")
    try:
        cfg = ModelConfig.from_hf_dict(json.loads(config_file.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as err:  # JSON or ModelConfigError
        raise fail(f"{field_name}: {config_file}: {err}") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({directory / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise fail(f"{field_name}: {index} is not a valid index (needs a weight_map)") \
                from None
        for shard in shards:
            if not shard.is_file():
                raise fail(f"{field_name}: {index} names the shard {shard.name}, which is "
                           "missing; copy or download it")
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise fail(f"{field_name}: no *.safetensors files in {directory}")
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    for shard in shards:
        for name, info in read_safetensors_header(shard).items():
            found[name] = (tuple(info["shape"]), shard)
    for name, shape in expected_hf_shapes(cfg).items():
        if name not in found:
            raise fail(f"{field_name}: {directory} lacks tensor {name!r} that its config.json "
                       f"implies ({cfg.family}, {cfg.num_layers} layers); a shard is missing "
                       "or config.json belongs to another model")
        got, shard = found[name]
        if got != shape:
            raise fail(f"{field_name}: tensor {name!r} in {shard.name} has shape {list(got)} but "
                       f"{config_file} implies {list(shape)}; the shard and config.json disagree")
    return cfg
