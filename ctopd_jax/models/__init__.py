"""Llama-3.x / Qwen2 decoder in Flax NNX, its KV cache, configs and HF weight conversion."""

from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.models.config import (ModelConfig, ModelConfigError, PRESETS, llama3_2_3b,
                                     qwen2_5_7b, tiny_llama, tiny_qwen2)
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.models.weights import (CheckpointError, export_hf_checkpoint, hf_named_tensors,
                                      load_hf_checkpoint)

__all__ = ["ModelConfig", "ModelConfigError", "PRESETS", "llama3_2_3b", "qwen2_5_7b",
           "tiny_llama", "tiny_qwen2", "Decoder", "prefill_positions",
           "CheckpointError", "export_hf_checkpoint", "hf_named_tensors", "load_hf_checkpoint"]
