"""What `model.student` / `model.teacher` name: the checkpoint folder (a named source, a folder
or a preset), the tokenizer, and a served teacher's model config. Read alike by the checks
(preflight, the objective factory), the builders and the exporters, without loading a weight."""
from __future__ import annotations

import json
from pathlib import Path

from ctopd_jax.common import sources
from ctopd_jax.common.setup_errors import TrainerSetupError
from ctopd_jax.models.config import ModelConfig
from ctopd_jax.tokenization.side import load_tokenizer_side


def model_dir(spec: str) -> Path | None:
    """The checkpoint directory a `model.student` / `model.teacher` spec names, if any."""
    if sources.is_named(spec) and not spec.startswith("preset:"):
        return Path(sources.resolve("model", spec, "model"))
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def tokenizer_side(spec: str, tokenizer_spec: str, role: str):
    """The TokenizerSide of `model.<role>`: `model.<role>_tokenizer`, else the model's folder."""
    directory = model_dir(spec)
    tok_spec = tokenizer_spec or (str(directory) if directory is not None else "")
    if not tok_spec:
        raise TrainerSetupError(f"model.{role}_tokenizer: a preset model ({spec}) needs a tokenizer; "
                                f"set model.{role}_tokenizer (e.g. tiny_bpe)")
    return load_tokenizer_side(tok_spec)


def served_teacher_model_config(config):
    """The teacher's ModelConfig read from model.teacher's config.json, for a teacher behind a
    server (`teacher.engine` vllm_server / sglang_server): the trainer then needs the teacher's
    folder for its config.json and tokenizer only, never its weights."""
    engine, spec = config.teacher.engine, config.model.teacher
    directory = model_dir(spec)
    config_file = directory / "config.json" if directory is not None else None
    if config_file is None or not config_file.is_file():
        raise TrainerSetupError(
            f"model.teacher={spec!r}: with teacher.engine={engine} the trainer reads the served "
            "teacher's config.json (its vocabulary) and tokenizer from model.teacher's folder "
            "(no weights needed); point model.teacher at that folder")
    try:
        return ModelConfig.from_hf_dict(json.loads(config_file.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as err:   # JSON or ModelConfigError
        raise TrainerSetupError(f"model.teacher: {config_file}: {err}") from None
