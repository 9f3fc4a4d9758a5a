"""Tiny GGUF files written with gguf.GGUFWriter, as llama.cpp's converter lays them out: HF
weights of a random transformers model (hf_fixtures) under GGUF names, Llama's q/k rows
reordered for llama.cpp's RoPE, a byte-level vocabulary with its merges and special tokens.
Nothing here calls the converter under test."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

from hf_fixtures import hf_model
from ctopd_jax.models.config import tiny_llama, tiny_qwen2

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HF_TO_GGUF = {   # written from llama.cpp's tensor naming (gguf.constants), one family per row
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def vocabulary() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())   # the 256 byte-level characters
    return alphabet + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)


def tiny_config(family: str):
    """A tiny config whose vocabulary is `vocabulary()` (default RoPE: GGUF carries no llama3 scaling)."""
    size = len(vocabulary())
    if family == "llama":
        return tiny_llama(vocab_size=size, rope_scaling=None, rope_theta=10000.0,
                          tie_word_embeddings=True)
    return tiny_qwen2(vocab_size=size, tie_word_embeddings=False)


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's order: within each head, rows j and j + head_dim/2 of the HF
    weight become neighbours 2j and 2j + 1."""
    per_head = weight.shape[0] // heads
    half = per_head // 2
    order = np.empty(per_head, np.int64)
    order[0::2] = np.arange(half)
    order[1::2] = np.arange(half) + half
    return weight.reshape(heads, per_head, -1)[:, order].reshape(weight.shape)


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def write_gguf(path: Path, family: str, *, arch: str | None = None, pre: str | None = None,
               seed: int = 0):
    """A GGUF file of a random tiny `family` model; returns its transformers model (the weights
    written). `arch` writes another general.architecture with the same tensors."""
    cfg = tiny_config(family)
    model = hf_model(cfg, seed)
    arch = arch or family
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or ("qwen2" if family == "qwen2" else "smollm"))
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = tensor.detach().float().numpy().copy()
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            value = llama_cpp_rows(value, heads)
        writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
