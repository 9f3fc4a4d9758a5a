"""Tiny random HF Llama / Qwen2 models built from transformers configs (the reference), saved
with save_pretrained and loaded back through the project's weight loader. No download."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, Qwen2Config

from ctopd_jax.models.weights import load_hf_checkpoint
from hf_random import random_hf_model

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=512, initializer_range=0.1, hidden_act="silu")


def hf_config(family: str, **overrides):
    common = {**COMMON, **overrides}
    if family == "llama":
        return LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 32})
    return Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_hf(family: str, directory, seed: int = 0, **overrides):
    """Random HF model (hf_random: non-trivial norms / biases), saved to `directory`; returns it."""
    model = random_hf_model(hf_config(family, **overrides), seed)
    model.save_pretrained(directory)
    return model


def load_pair(family: str, directory, seed: int = 0, mesh=None, **overrides):
    hf = build_hf(family, directory, seed, **overrides)
    model, cfg = load_hf_checkpoint(directory, mesh=mesh)
    return hf, model, cfg


def hf_greedy(hf, prompt, max_new_tokens, eos_id=None):
    """HF generate, one unpadded prompt at a time, greedy; returns the new token ids."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, min_new_tokens=0,
                          eos_token_id=eos_id, pad_token_id=0 if eos_id is None else eos_id)
    new = out[0, ids.shape[1]:].tolist()
    if eos_id is not None and eos_id in new:  # HF pads after EOS with pad_token_id
        new = new[: new.index(eos_id) + 1]
    return new


def hf_response_logprobs(hf, prompt, response):
    """log p(response_t | prompt, response_<t) under the HF model (teacher forcing)."""
    full = torch.tensor([list(prompt) + list(response)], dtype=torch.long)
    with torch.no_grad():
        logits = hf(full).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[rows, torch.tensor(response)].numpy()


def random_prompts(rng, count, vocab=256, min_len=3, max_len=20):
    return [rng.integers(3, vocab, rng.integers(min_len, max_len + 1)).tolist()
            for _ in range(count)]
