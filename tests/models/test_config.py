"""ModelConfig <-> HF config.json, presets against the published configs, field-named errors."""

import math

import jax
import pytest
from flax import nnx
from transformers import LlamaConfig, Qwen2Config

from ctopd_jax.models import (Decoder, ModelConfig, ModelConfigError, llama3_2_3b, qwen2_5_7b,
                              tiny_llama, tiny_qwen2)

# The config.json files as published on the hub (transformers 4.x layout: top-level rope_theta,
# rope_scaling), trimmed of token ids and dtype.
LLAMA_3_2_3B_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 128256,
}
QWEN2_5_7B_JSON = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}


def test_presets_equal_published_config_json():
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    assert ModelConfig.from_hf_dict(LLAMA_3_2_3B_JSON, **bf16) == llama3_2_3b()
    assert ModelConfig.from_hf_dict(QWEN2_5_7B_JSON, **bf16) == qwen2_5_7b()


@pytest.mark.parametrize("preset,billions", [(llama3_2_3b, 3.21), (qwen2_5_7b, 7.62)])
def test_preset_parameter_counts_match_model_cards(preset, billions):
    abstract = nnx.eval_shape(lambda: Decoder(preset(), rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert abs(count / 1e9 - billions) < 0.01, count


@pytest.mark.parametrize("cfg", [tiny_llama(), tiny_qwen2(), llama3_2_3b(), qwen2_5_7b()],
                         ids=["tiny_llama", "tiny_qwen2", "llama3_2_3b", "qwen2_5_7b"])
def test_round_trip_through_transformers_config_classes(cfg):
    hf_cls = LlamaConfig if cfg.family == "llama" else Qwen2Config
    hf_dict = hf_cls(**cfg.to_hf_dict()).to_dict()
    overrides = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    assert ModelConfig.from_hf_dict(hf_dict, **overrides) == cfg
    assert hf_dict["num_key_value_heads"] == cfg.num_kv_heads


@pytest.mark.parametrize("change,field", [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=33), "head_dim"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(family="gpt2"), "family"),
    (dict(dtype="float64"), "dtype"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
])
def test_invalid_values_name_the_field(change, field):
    with pytest.raises(ModelConfigError, match=field):
        tiny_llama(**change)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("hidden_size"), "hidden_size"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.update(mlp_bias=True), "mlp_bias"),
    (lambda d: d.update(attention_bias=True), "attention_bias"),
    (lambda d: d.update(model_type="mistral"), "model_type"),
    (lambda d: d["rope_scaling"].pop("low_freq_factor"), "low_freq_factor"),
    (lambda d: d["rope_scaling"].update(rope_type="yarn"), "rope_type"),
])
def test_unsupported_hf_fields_are_named(edit, field):
    hf = {**LLAMA_3_2_3B_JSON, "rope_scaling": dict(LLAMA_3_2_3B_JSON["rope_scaling"])}
    edit(hf)
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf_dict(hf)


def test_config_is_hashable_for_jit_static_use():
    assert hash(tiny_llama()) == hash(tiny_llama())
    assert tiny_llama().rope_scaling_dict["factor"] == 8.0
