"""The output folders and the checkpoint directory: writable, not another run's, resumable."""
from __future__ import annotations

from pathlib import Path

import jax

from ctopd_jax.common.run_dir import RunDirError, check_not_foreign, check_not_in_use, check_writable
from ctopd_jax.config import TrainConfig, teacher_views
from ctopd_jax.loop.checkpoint import checkpoint_metas
from ctopd_jax.preflight.errors import PreflightError, fail
from ctopd_jax.preflight.models import model_dir_of
from ctopd_jax.preflight.resume_config import ConfigChangeError, check_resume_config, read_saved_config


def checkpoint_dir_of(config: TrainConfig) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else \
        Path(config.output_dir) / "checkpoints"


def check_output_dirs(config: TrainConfig) -> None:

    inputs = _input_folders(config)
    try:
        check_writable(config.output_dir, "output_dir")
        check_not_foreign(config.output_dir, "output_dir", inputs)
        if config.checkpoint.dir:
            check_writable(config.checkpoint.dir, "checkpoint.dir")
            check_not_foreign(config.checkpoint.dir, "checkpoint.dir", inputs, checkpoint_folder=True)
        if jax.process_index() == 0:   # the locks' owner; the others would see process 0's locks
            check_not_in_use(config.output_dir)
            check_not_in_use(checkpoint_dir_of(config), "checkpoint.dir")
    except RunDirError as err:
        raise fail(str(err)) from None


def _input_folders(config: TrainConfig) -> dict[str, Path]:
    """field -> the folder of every model, tokenizer, adapter and data file the run reads (a
    named source resolved; one that does not resolve is reported by its own check later)."""
    folders = {}
    for name, view in teacher_views(config).items():
        for role in ("student", "teacher", "teacher_base", "student_tokenizer", "teacher_tokenizer"):
            spec = getattr(view.model, role)
            own = config.teachers and role in ("teacher", "teacher_tokenizer")   # the entry's
            field_name = f"teachers[{name}].{role}" if own else f"model.{role}"
            try:
                directory = model_dir_of(spec, field_name) if spec else None
            except PreflightError:
                directory = None
            if directory is not None:
                folders[field_name] = directory
    for field_name, spec in (("lora.init_adapter", config.lora.init_adapter),
                             ("data.path", config.data.path),
                             ("evaluation.dataset", config.evaluation.dataset)):
        path = Path(spec).expanduser() if spec else None
        if path is not None and path.exists():
            folders[field_name] = path if path.is_dir() else path.parent
    return folders


def check_checkpoint_state(config: TrainConfig, resume: bool, allow_change: bool):

    directory = checkpoint_dir_of(config)
    metas = checkpoint_metas(directory)
    steps = [s for s, _ in metas]
    if steps and not resume:
        raise fail(f"checkpoint.dir {directory} already holds checkpoints of steps {steps}; "
                   "pass --resume to continue that run, or set another output_dir")
    if not resume:
        return directory, [], [], ""
    if not steps:
        raise fail(f"--resume: no checkpoint in {directory} to resume from; drop --resume to "
                   "start a fresh run, or point output_dir / checkpoint.dir at the run")
    readable = [s for s, meta in metas if meta is not None]
    if not readable:
        raise fail(f"--resume: none of the checkpoints in {directory} (steps {steps}) is "
                   "readable (their meta files are damaged or missing); start a fresh run "
                   "in another output_dir")
    if max(readable) > config.steps:   # the run would log "resumed" and train nothing
        raise fail(f"steps: {config.steps}, but the checkpoint in {directory} is at step "
                   f"{max(readable)} already; set steps to {max(readable)} or more to continue "
                   "that run, or start a fresh run in another output_dir")
    try:
        saved, where = read_saved_config(config.output_dir, directory)
        changes = check_resume_config(saved, config.to_dict(), allow_change, where)
    except ConfigChangeError as err:
        raise fail(str(err)) from None
    return directory, readable, changes, where
