"""The trained student written out for other tools: an HF checkpoint folder (config.json,
safetensors, the tokenizer's files) and, with LoRA, its PEFT adapter."""
from __future__ import annotations

import shutil
from pathlib import Path

import jax

from ctopd_jax.common.kill_points import kill_point
from ctopd_jax.common.run_dir import replaced_folder
from ctopd_jax.loop.model_sources import model_dir
from ctopd_jax.mesh.arrays import local_copy
from ctopd_jax.models.lora import save_adapter
from ctopd_jax.models.weights import export_hf_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def write_adapter(student, config, run_dir: Path, is_writer: bool) -> Path | None:
    """LoRA (`lora.rank` > 0): the student's PEFT adapter in <run_dir>/adapter/, rewritten at each
    checkpoint and at the end (atomically: models.lora.save_adapter). Every process calls it (the
    adapter is gathered from the mesh); the writer writes. None without LoRA or off the writer."""
    if config.lora.rank == 0:
        return None
    model = student if jax.process_count() == 1 else local_copy(student)
    if not is_writer:
        return None
    base = model_dir(config.model.student) or config.model.student
    return save_adapter(model, Path(run_dir) / "adapter", str(base), config.lora.dropout)


def export_student(student, s_tok, out_dir: Path, is_writer: bool, config=None) -> Path | None:
    """The trained student as an HF checkpoint (written by the first process only).  With LoRA
    (`lora.rank` > 0): the PEFT adapter in <out_dir>/../adapter, and the merged HF model only
    with `checkpoint.export_merged` (then its folder is returned, else the adapter's)."""
    if config is not None and config.lora.rank > 0:
        adapter = write_adapter(student, config, Path(out_dir).parent, is_writer)
        if not config.checkpoint.export_merged:
            return adapter
    model = student if jax.process_count() == 1 else local_copy(student)
    if not is_writer:
        return None
    extra = {"eos_token_id": s_tok.eos_id, "pad_token_id": s_tok.pad_id}
    if s_tok.bos_id is not None:
        extra["bos_token_id"] = s_tok.bos_id
    # whole or not at all (run_dir.replaced_folder): a kill mid-export leaves the earlier one
    with replaced_folder(out_dir) as staging:
        export_hf_checkpoint(model, model.cfg, staging, extra_config=extra)
        kill_point("hf_export")
        for name in TOKENIZER_FILES:   # the tokenizer travels with the weights
            src = Path(s_tok.path) / name
            if src.is_file() and not (staging / name).exists():
                shutil.copy(src, staging / name)
    return Path(out_dir)
