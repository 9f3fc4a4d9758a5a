"""The planner's model of one run (plan.py): GPU kinds, the model shapes a spec names, parameter
counts, the memory terms per token of activations, inference and the loss chunks, and the
time terms (FLOPs over the device's rate)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from ctopd_jax.common import sources
from ctopd_jax.common.cli import UserError
from ctopd_jax.models.config import PRESETS, ModelConfig


GB = 1e9
HEADROOM = 0.05            # CUDA context, NCCL, cuDNN workspaces: outside both pools
SAMPLER_POOL = 0.90        # XLA pool fraction when the JAX sampler is the engine
VLLM_OVERHEAD_GB = 2.0     # vLLM's own activations / CUDA graphs inside its share


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float       # what the planner budgets (GB = 1e9 bytes)
    bf16_tflops: float     # dense bf16 peak by the vendor's datasheet (a lead, not a reading)


DEVICES = {
    "h100": Device("h100", 80.0, 989.0),
    "h200": Device("h200", 141.0, 989.0),
    "b200": Device("b200", 180.0, 2250.0),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------- model shapes
def _norm_name(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


# Directory-name fragments (lower case, punctuation removed) -> preset; checked in order.
_NAME_HINTS = (("llama323b", "llama3_2_3b"), ("qwen257b", "qwen2_5_7b"))


def preset_for_name(spec: str) -> str | None:
    """The preset a model spec names: `preset:X`, `X`, or a checkpoint directory whose name
    matches one (`checkpoints/Llama-3.2-3B-Instruct` -> llama3_2_3b). None if nothing matches."""
    name = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    if name in PRESETS:
        return name
    key = _norm_name(Path(name).name)
    for fragment, preset in _NAME_HINTS:
        if fragment in key:
            return preset
    for preset in PRESETS:
        if _norm_name(preset) and key.startswith(_norm_name(preset)):
            return preset
    return None


def resolve_model(spec: str, preset: str | None, role: str, dtype: str, param_dtype: str):
    """ModelConfig for `model.<role>`: forced preset, HF config.json, or a name-matched preset."""
    if preset:
        if preset not in PRESETS:
            raise UserError(f"--{role}-preset {preset!r}: not a preset; use one of "
                            f"{', '.join(sorted(PRESETS))}")
        return PRESETS[preset](dtype=dtype, param_dtype=param_dtype), f"preset {preset} (forced)"
    directory = Path(spec).expanduser()
    if sources.is_named(spec) and not spec.startswith("preset:"):   # demo:student, as train
        try:
            directory = Path(sources.resolve("model", spec, f"model.{role}"))
        except (ValueError, OSError) as err:
            raise UserError(str(err)) from None
    config_json = directory / "config.json"
    if config_json.is_file():
        try:
            hf = json.loads(config_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UserError(f"model.{role}: cannot read {config_json}: {err}") from None
        return (ModelConfig.from_hf_dict(hf, dtype=dtype, param_dtype=param_dtype),
                f"{config_json}")
    name = preset_for_name(spec)
    if name is None:
        raise UserError(
            f"model.{role}={spec!r}: no config.json there and no preset matches the name; pass "
            f"--{role}-preset with one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name](dtype=dtype, param_dtype=param_dtype), f"preset {name} (matched by name)"


def param_count(cfg) -> int:
    """Parameters of the Decoder (embedding, untied lm_head, layers, final norm)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    per_layer = h * qkv + cfg.num_heads * d * h + 3 * h * i + 2 * h
    if cfg.qkv_bias:
        per_layer += qkv
    total = cfg.vocab_size * h + cfg.num_layers * per_layer + h
    if not cfg.tie_word_embeddings:
        total += h * cfg.vocab_size
    return total


def lora_param_count(cfg, rank: int, targets) -> int:
    """Adapter parameters of LoRA rank `rank` on `targets`: r x (in + out) per projection."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"q_proj": (h, cfg.num_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
              "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return cfg.num_layers * sum(rank * sum(shapes[t]) for t in targets)


def attention_kind(cfg, override: str | None = None, gpu: bool = False) -> str:
    """The attention path to plan for: "einsum" (materialises [heads, T, T]), "blockwise"
    (O(T) plus a few [block, block] tiles a layer) or "cudnn" (O(T)). The model's `attention`
    setting when it has one ("auto" resolves as models/attention.py does: cuDNN for bf16/fp16
    on a GPU, else blockwise); a model without the setting computes the einsum."""
    kind = str(override or getattr(cfg, "attention", None) or "einsum")
    if kind == "auto":
        half = getattr(cfg, "dtype", "float32") in ("bfloat16", "float16")
        kind = "cudnn" if gpu and half else "blockwise"
    return kind


BLOCKWISE_TILES = 2  # [block_q, block_k] float32 tiles a layer holds (compile-only, CPU)


# ----------------------------------------------------------------------------- memory terms
def layer_saved_bytes_per_token(cfg, c: int, seq: int, attention: str, tensor: int = 1) -> float:
    """Bytes one layer keeps per token for its backward when nothing is rematerialised."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    sharded = c * (2 * (nq + 2 * nkv) - nkv + nq + 4 * i)
    replicated = c * 3 * h + 4 * 2 * h
    if attention == "einsum":
        sharded += cfg.num_heads * seq * (8 + c)
    else:
        sharded += cfg.num_heads * 4          # per-row log-sum-exp
    if attention == "blockwise":
        # float32 output and dq/dk/dv accumulators, and the score tiles of its loops
        block = min(getattr(cfg, "attention_block", 512), seq)
        sharded += 4 * (2 * nq + 2 * nkv)
        sharded += BLOCKWISE_TILES * cfg.num_heads * block * block * 4 / seq
    return replicated + sharded / tensor


def model_constant_bytes_per_token(cfg, c: int, seq: int, attention: str) -> float:
    """Per token, independent of depth: embedding output and its gradient, final norm, RoPE
    tables (cos, sin) and the boolean mask (a [T, T] row per token while it is dense)."""
    h, d = cfg.hidden_size, cfg.head_dim
    mask = seq if attention == "einsum" else 0
    return c * 2 * h + 4 * 2 * h + 4 * 4 * d + mask


REMAT_LIVE_LAYERS = 1.5  # one layer's recomputed set + half as much of its gradient transients


def layer_stack_bytes(cfg, batch: int, seq: int, *, remat: bool, attention: str,
                      tensor: int = 1, compute_dtype: str | None = None) -> float:
    """Temporaries of the gradient through the layer stack alone (no embedding, no loss)."""
    c = DTYPE_BYTES[compute_dtype or cfg.dtype]
    per_layer = layer_saved_bytes_per_token(cfg, c, seq, attention, tensor)
    if remat:
        body = cfg.num_layers * c * cfg.hidden_size + REMAT_LIVE_LAYERS * per_layer
    else:
        body = cfg.num_layers * per_layer
    return batch * seq * body


def activation_bytes(cfg, batch: int, seq: int, *, remat: bool, attention: str,
                     tensor: int = 1, compute_dtype: str | None = None) -> float:
    """Temporaries of one student gradient over `batch` sequences of `seq` tokens (no loss)."""
    c = DTYPE_BYTES[compute_dtype or cfg.dtype]
    const = model_constant_bytes_per_token(cfg, c, seq, attention)
    return (layer_stack_bytes(cfg, batch, seq, remat=remat, attention=attention, tensor=tensor,
                              compute_dtype=compute_dtype) + batch * seq * const)


def inference_bytes(cfg, batch: int, seq: int, *, attention: str, tensor: int = 1) -> float:
    """Teacher prefill (no gradient): the residual stream and ONE layer's live set at a time."""
    c = DTYPE_BYTES[cfg.dtype]
    per_layer = layer_saved_bytes_per_token(cfg, c, seq, attention, tensor)
    const = model_constant_bytes_per_token(cfg, c, seq, attention)
    return batch * seq * (2 * c * cfg.hidden_size + per_layer + const)


def loss_chunk_bytes(rows: int, vocab_s: int, vocab_t: int, vocab_shared: int) -> float:
    """One chunk of the strict loss: float32 student logits, their softmax and gradient
    (3 x V_S), teacher logits and log-softmax (2 x V_T), the projected pair (2 x V∩).
    A served teacher: vocab_t = vocab_shared = 0."""
    return rows * 4 * (3 * vocab_s + 2 * vocab_t + 2 * vocab_shared)


# ----------------------------------------------------------------------------- time terms
def attention_flops(cfg, seq: int, attention: str) -> float:
    """Forward QK^T and PV FLOPs of one sequence: causal blockwise kernels skip the upper
    triangle (half), the einsum computes the full [T, T]."""
    full = 4.0 * seq * seq * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return full if attention == "einsum" else full / 2


def estimate_time(student, teacher, config, dev: Device, gpus: int, seq: int, attn: str,
                  t_attn: str, *, mfu: float, prefill_mfu: float, rollout_s: float,
                  fill: float) -> dict:
    r = config.rollout
    n = r.rollout_batch_size * r.n_samples_per_prompt
    tokens = n * seq
    gen = n * fill * r.generate_max_len
    ps_body = param_count(student) - student.vocab_size * student.hidden_size
    pt_body = param_count(teacher) - teacher.vocab_size * teacher.hidden_size
    passes = 4 if config.model.remat else 3              # forward (+ recompute) + 2 x backward
    head_s = 2.0 * student.hidden_size * student.vocab_size * gen
    head_t = 2.0 * teacher.hidden_size * teacher.vocab_size * gen
    train = passes * (2.0 * ps_body * tokens + n * attention_flops(student, seq, attn)
                      + head_s) + head_t
    prefill = 2.0 * pt_body * tokens + n * attention_flops(teacher, seq, t_attn)
    rollout = 2.0 * param_count(student) * gen + n * attention_flops(student, seq, "causal")
    peak = dev.bf16_tflops * 1e12 * gpus
    parts = {"rollout": rollout_s, "teacher prefill": prefill / (peak * prefill_mfu),
             "student step": train / (peak * mfu)}
    return {"flops": {"rollout": rollout, "teacher prefill": prefill, "student step": train},
            "seconds": parts, "total_s": sum(parts.values()),
            "assumed": f"MFU {mfu:g} train, {prefill_mfu:g} prefill "
                       f"of {dev.bf16_tflops:g} TFLOP/s dense bf16 x {gpus} GPU(s), rollout at "
                       f"its decode floor; "
                       f"responses at {fill:g} x generate_max_len"}
