"""Each model's files (a checkpoint folder or a preset) and the LoRA adapter to start from."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ctopd_jax.common import sources
from ctopd_jax.config import TrainConfig
from ctopd_jax.loop.model_sources import model_dir, served_teacher_model_config
from ctopd_jax.models import PRESETS
from ctopd_jax.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ctopd_jax.preflight.errors import fail
from ctopd_jax.preflight.safetensors import check_hf_checkpoint, read_safetensors_header


def model_dir_of(spec: str, field_name: str) -> Path | None:
    """As model_sources.model_dir: a named source (`demo:student`) or an existing directory."""
    if sources.is_named(spec) and not spec.startswith("preset:"):
        try:
            return Path(sources.resolve("model", spec, field_name))
        except (ValueError, OSError) as err:   # SourceError, the owner's own errors
            text = str(err) if field_name in str(err) else f"{field_name}={spec!r}: {err}"
            raise fail(text) from None
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def check_model(spec: str, role: str):
    """(directory or None, ModelConfig or None) for model.<role>."""
    field_name = f"model.{role}"
    directory = model_dir_of(spec, field_name)
    if directory is not None:
        return directory, check_hf_checkpoint(directory, field_name)
    name = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    if name not in PRESETS:
        raise fail(f"{field_name}={spec!r}: not a checkpoint directory (no such directory), "
                   f"demo:{role}, or a preset ({', '.join(sorted(PRESETS))}); fix the path")
    return None, None


def model_cfg(config: TrainConfig, role: str, cfg):
    """The ModelConfig of model.<role>: its config.json (read by check_model) or its preset."""
    return cfg if cfg is not None else PRESETS[getattr(config.model, role).split(":", 1)[-1]]()


def check_served_teacher_files(config: TrainConfig):
    """(teacher folder, its ModelConfig): the folder's config.json only (its weights stay on the
    server)."""
    try:
        return model_dir(config.model.teacher), served_teacher_model_config(config)
    except (ValueError, OSError) as err:   # TrainerSetupError, SourceError
        raise fail(str(err)) from None


def lora_projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection LoRA may target, from the model's config (HF's layout)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def check_lora_rank(config: TrainConfig, student_cfg) -> None:
    """lora.rank at most the smaller side of every projection it targets: B A of an (out, in)
    projection has rank <= min(out, in), so a larger rank only adds parameters that cannot
    change the update (and above hidden_size it is a typo). Read from config.json, before any
    weight loads."""
    rank = config.lora.rank
    if rank <= 0:
        return
    cfg = model_cfg(config, "student", student_cfg)
    shapes = lora_projection_shapes(cfg)
    name, (out, inp) = min(((n, shapes[n]) for n in config.lora.target_modules),
                           key=lambda item: min(item[1]))
    if rank > min(out, inp):
        raise fail(f"lora.rank: {rank} is above what the student's {name} ({out} x {inp}, "
                   f"hidden_size {cfg.hidden_size}) can hold: an adapter's update has rank at "
                   f"most {min(out, inp)}; set lora.rank to {min(out, inp)} or less")


def check_init_adapter(config: TrainConfig) -> None:
    """lora.init_adapter: a PEFT LoRA folder whose settings match the `lora:` section and whose
    weights file is whole; models/lora.load_adapter applies the same rules once the student has
    loaded (with the tensors themselves), this finds them before any model loads."""

    lo = config.lora
    if not lo.init_adapter:
        return
    folder = Path(lo.init_adapter)
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except OSError:
        raise fail(f"lora.init_adapter: {folder} has no readable {ADAPTER_CONFIG}; give a PEFT "
                   "LoRA adapter folder (what the trainer writes as adapter/)") from None
    except (ValueError, UnicodeDecodeError):
        raise fail(f"lora.init_adapter: {folder / ADAPTER_CONFIG} is not valid JSON") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA" or \
            cfg.get("use_dora") or cfg.get("use_rslora"):
        raise fail(f"lora.init_adapter: {folder} is not a plain LoRA adapter")
    targets = cfg.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else targets)
    alpha = cfg.get("lora_alpha")
    for field_name, got, want, same in (
            ("rank", cfg.get("r"), lo.rank, cfg.get("r") == lo.rank),
            ("alpha", alpha, lo.alpha, isinstance(alpha, (int, float)) and math.isclose(alpha, lo.alpha)),
            ("target_modules", targets, sorted(lo.target_modules), targets == sorted(lo.target_modules))):
        if not same:
            raise fail(f"lora.{field_name}: {want!r} but the adapter {folder} has {got!r}; set "
                       f"lora.{field_name} to match it")
    read_safetensors_header(folder / ADAPTER_WEIGHTS)
