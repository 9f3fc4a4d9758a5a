"""The one builder of tiny random HF transformers models (the independent reference), no
download: tests/models/hf_fixtures.py builds them from the project's ModelConfig presets,
tests/rollout/_hf_tiny.py from transformers configs of its own."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

BIAS_STD = 0.1        # HF initialises biases to 0 and norm scales to 1: perturb both so a
NORM_SCALE_STD = 0.1  # weight that lands in the wrong place changes the logits


def random_hf_model(hf_config, seed: int = 0):
    """A random Llama / Qwen2 causal LM (eval mode) for the transformers config `hf_config`,
    with non-trivial norm scales and biases; the same `seed` gives the same weights."""
    torch.manual_seed(seed)
    model_cls = LlamaForCausalLM if isinstance(hf_config, LlamaConfig) else Qwen2ForCausalLM
    model = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * BIAS_STD)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn_like(p) * NORM_SCALE_STD)
    return model
