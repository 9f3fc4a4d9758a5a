"""Model configuration shared by the Llama-3.x and Qwen2/2.5 decoder.

Both families are one architecture with switches (q/k/v bias, "llama3" RoPE scaling, tied
embeddings), so one frozen dataclass describes them.  `from_hf_dict` / `to_hf_dict` translate to
and from a transformers 5.x ``config.json``.

Decisions where the HF format is loose:
- transformers 5.x writes RoPE settings under ``rope_parameters`` (``rope_theta`` inside it);
  older files use top-level ``rope_theta`` plus ``rope_scaling``.  Both are read; ``to_hf_dict``
  writes the 5.x layout and also the top-level ``rope_theta`` so older readers (vLLM) agree.
- Features the decoder does not implement (``mlp_bias``, Llama ``attention_bias`` which also
  biases o_proj, sliding windows, activations other than SiLU, rope types other than default /
  llama3) are rejected with an error naming the field, instead of silently loading a model that
  computes something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

FAMILIES = ("llama", "qwen2")
ATTENTION_IMPLEMENTATIONS = ("auto", "einsum", "blockwise", "cudnn")
# "full" saves only each layer's input; "blocks" also rematerialises the attention and MLP
# halves inside the layer's recompute (smallest backward working set, one more forward of
# each half); the dots policies keep matmul outputs (less recompute, more memory), see
# jax.checkpoint_policies.
REMAT_POLICIES = ("none", "full", "blocks", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelConfigError(ValueError):
    """A model config field is missing, unsupported or inconsistent (the message names it)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None, or the HF "llama3" dict: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings.  Stored as a tuple of pairs so the dataclass stays
    # hashable (it is a static argument under jit); `rope_scaling_dict` gives the dict back.
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    family: str = "llama"
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # Execution options (not part of the HF config): see attention.py and decoder.py.
    # remat_policy "" follows the older switch: remat=True is "full", False is "none";
    # a non-empty remat_policy wins over remat.  `layer_remat_policy` gives the result.
    remat: bool = False
    remat_policy: str = ""
    attention: str = "auto"        # auto | einsum (reference) | blockwise | cudnn
    attention_block: int = 512     # query and key block of the blockwise path
    # ... over packed rows: smaller tiles skip more of what no query of a row's segments needs
    # (128 was the fastest of 64/128/256/512 on the CPU long tail, benchmarks/RESULTS.md)
    packed_attention_block: int = 128
    scan_layers: bool = False      # run the layers under lax.scan (memory path; no-cache only)
    mlp_chunk: int = 0             # tokens per row in one rematerialised MLP chunk; 0 = whole

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ModelConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"model.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"model.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ModelConfigError(f"model.attention must be one of {ATTENTION_IMPLEMENTATIONS}, "
                                   f"got {self.attention!r}")
        if self.remat_policy and self.remat_policy not in REMAT_POLICIES:
            raise ModelConfigError(
                f"model.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        for name in ("attention_block", "packed_attention_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if (not isinstance(self.mlp_chunk, int) or isinstance(self.mlp_chunk, bool)
                or self.mlp_chunk < 0):
            raise ModelConfigError(
                f"model.mlp_chunk must be a non-negative integer, got {self.mlp_chunk!r}")
        if self.family not in FAMILIES:
            raise ModelConfigError(f"model.family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ModelConfigError(
                    f"model.{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            scaling = self.rope_scaling_dict
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ModelConfigError(
                    f"model.rope_scaling is missing {missing}; a llama3 rope scaling needs "
                    f"{list(_LLAMA3_KEYS)}")
            extra = sorted(set(scaling) - set(_LLAMA3_KEYS))
            if extra:
                raise ModelConfigError(f"model.rope_scaling has unknown keys {extra}")
            if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                raise ModelConfigError(
                    "model.rope_scaling.high_freq_factor must exceed low_freq_factor")

    # ------------------------------------------------------------------ helpers
    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def layer_remat_policy(self) -> str:
        """One of REMAT_POLICIES: remat_policy if set, else from the remat switch."""
        return self.remat_policy or ("full" if self.remat else "none")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def params_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides) -> "ModelConfig":
        """Reads a transformers ``config.json`` dict; ``overrides`` set dtype/param_dtype and the
        execution options (remat, remat_policy, attention, attention_block,
        packed_attention_block, scan_layers, mlp_chunk)."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ModelConfigError(
                f"config.json model_type must be one of {FAMILIES}, got {model_type!r}")

        def need(key):
            if key not in hf:
                raise ModelConfigError(f"config.json is missing required field {key!r}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"config.json hidden_act must be 'silu', got {act!r}")
        if hf.get("mlp_bias"):
            raise ModelConfigError("config.json mlp_bias=true is not supported by this decoder")
        if model_type == "llama" and hf.get("attention_bias"):
            raise ModelConfigError(
                "config.json attention_bias=true (llama, biases o_proj too) is not supported")
        if hf.get("use_sliding_window"):
            raise ModelConfigError("config.json use_sliding_window=true is not supported")

        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling")
        if legacy_scaling:
            rope = {**dict(legacy_scaling), **rope}
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "llama3":
            rope_scaling = {k: rope[k] for k in _LLAMA3_KEYS if k in rope}
            missing = [k for k in _LLAMA3_KEYS if k not in rope]
            if missing:
                raise ModelConfigError(f"config.json rope_parameters is missing {missing}")
            rope_scaling["original_max_position_embeddings"] = int(
                rope_scaling["original_max_position_embeddings"])
        else:
            raise ModelConfigError(
                f"config.json rope_type {rope_type!r} is not supported (use 'default' or 'llama3')")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = hf.get("head_dim") or hidden // heads
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            family=model_type,
            **overrides,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers 5.x ``config.json`` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        if self.family == "qwen2" and not self.qkv_bias:
            raise ModelConfigError("family 'qwen2' always has q/k/v bias: set model.qkv_bias=true")
        if self.family == "llama" and self.qkv_bias:
            raise ModelConfigError(
                "HF Llama has no q/k/v-only bias: set model.qkv_bias=false or family='qwen2'")
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {"rope_type": "llama3", **self.rope_scaling_dict,
                               "rope_theta": self.rope_theta}
        out = {
            "architectures": ["LlamaForCausalLM" if self.family == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope_parameters,
            "rope_theta": self.rope_theta,
            "dtype": self.param_dtype,
        }
        if self.family == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        else:
            out.update(use_sliding_window=False)
        return out


# ---------------------------------------------------------------------- presets
def tiny_llama(**overrides) -> ModelConfig:
    """Tiny Llama-3 style config with llama3 RoPE scaling.

    head_dim 32 because vLLM's CPU attention rejects 16, and heads * head_dim == hidden_size
    because some engines derive head_dim from hidden_size / heads and ignore the field."""
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, rope_theta=500000.0,
                rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64},
                rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False,
                max_position_embeddings=512, family="llama")
    return ModelConfig(**{**base, **overrides})


def tiny_qwen2(**overrides) -> ModelConfig:
    """Tiny Qwen2 style config: q/k/v bias, tied embeddings, head_dim 32."""
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, rope_theta=1000000.0, rope_scaling=None,
                rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
                max_position_embeddings=512, family="qwen2")
    return ModelConfig(**{**base, **overrides})


def llama3_2_3b(**overrides) -> ModelConfig:
    """meta-llama/Llama-3.2-3B(-Instruct) as published in its config.json."""
    base = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
                num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                rms_norm_eps=1e-5, tie_word_embeddings=True, qkv_bias=False,
                max_position_embeddings=131072, family="llama", dtype="bfloat16",
                param_dtype="bfloat16")
    return ModelConfig(**{**base, **overrides})


def qwen2_5_7b(**overrides) -> ModelConfig:
    """Qwen/Qwen2.5-7B(-Instruct) as published in its config.json."""
    base = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
                rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True,
                max_position_embeddings=32768, family="qwen2", dtype="bfloat16",
                param_dtype="bfloat16")
    return ModelConfig(**{**base, **overrides})


PRESETS = {"tiny_llama": tiny_llama, "tiny_qwen2": tiny_qwen2, "llama3_2_3b": llama3_2_3b,
           "qwen2_5_7b": qwen2_5_7b}
