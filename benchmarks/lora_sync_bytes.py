"""Bytes the trainer hands to vLLM per weight sync, LoRA adapter vs merged weights, at a preset.

    python benchmarks/lora_sync_bytes.py [--preset llama3_2_3b] [--rank 16] [--targets q_proj ...]

Counted from the model config's shapes (no weights; nothing allocated):
- merged (what `VllmEngine.update_weights` pushes without adapter sync, `device_hf_arrays`):
  every Decoder parameter once, plus `lm_head.weight` again for a tied model (the engine sends
  it even when tied), in the engine dtype;
- adapter (adapter sync: the `lora.save_adapter` file vLLM loads): r x (in + out) per adapted
  projection per layer (`plan.model.lora_param_count`), in the adapter's dtype (the LoRA params' own:
  float32 master weights write float32), plus the safetensors header (tensor names, shapes
  and offsets; computed here the way safetensors lays it out, to within a few bytes).
The full count is cross-checked against `nnx.eval_shape` of the Decoder (abstract shapes).
"""
from __future__ import annotations

import argparse
import json

from ctopd_jax.models.config import PRESETS
from ctopd_jax.models.lora import TARGETS, _hf_module
from ctopd_jax.plan.model import lora_param_count, param_count

BYTES = {"bfloat16": 2, "float32": 4}


def abstract_param_count(cfg) -> int:
    import math

    from flax import nnx

    from ctopd_jax.models.decoder import Decoder

    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return sum(math.prod(v.shape) for _, v in nnx.to_flat_state(state))


def adapter_header_bytes(cfg, rank: int, targets, dtype: str) -> int:
    """safetensors header of the adapter file: 8-byte length + JSON, padded to 8 bytes."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    io = {"q_proj": (h, cfg.num_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
          "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
          "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    header, offset = {}, 0
    for layer in range(cfg.num_layers):
        for name in targets:
            prefix = "base_model.model." + _hf_module(layer, TARGETS[name][0], name)
            fan_in, fan_out = io[name]
            for suffix, shape in ((".lora_A.weight", [rank, fan_in]), (".lora_B.weight", [fan_out, rank])):
                size = shape[0] * shape[1] * BYTES[dtype]
                header[prefix + suffix] = {"dtype": {"bfloat16": "BF16", "float32": "F32"}[dtype],
                                           "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":"))
    return 8 + len(text) + (-len(text)) % 8


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3_2_3b", choices=sorted(PRESETS))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]()
    full = param_count(cfg)
    assert full == abstract_param_count(cfg), (full, abstract_param_count(cfg))
    pushed = full + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    adapter = lora_param_count(cfg, args.rank, args.targets)
    print(f"{args.preset}: {full:,} parameters ({'tied' if cfg.tie_word_embeddings else 'untied'} "
          f"embeddings; the merged sync sends {pushed:,} values, lm_head included); LoRA rank "
          f"{args.rank} on {', '.join(args.targets)}: {adapter:,} adapter parameters")
    out = {}
    for dtype, width in BYTES.items():
        merged_bytes = pushed * width
        adapter_bytes = adapter * width + adapter_header_bytes(cfg, args.rank, args.targets, dtype)
        out[dtype] = (merged_bytes, adapter_bytes)
        print(f"  {dtype:>8}: merged {merged_bytes / 1e9:.3f} GB, adapter {adapter_bytes / 1e6:.2f} MB "
              f"(header {adapter_header_bytes(cfg, args.rank, args.targets, dtype) / 1e3:.1f} kB); "
              f"adapter / merged = {adapter_bytes / merged_bytes:.5f} (merged is "
              f"{merged_bytes / adapter_bytes:.0f}x)")
    return out


if __name__ == "__main__":
    main()
