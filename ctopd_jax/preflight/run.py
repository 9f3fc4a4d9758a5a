"""All the cheap checks in order (the package doc), and what they loaded."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctopd_jax.config import ConfigError, TrainConfig, default_teacher, teacher_views, validate
from ctopd_jax.loop.objective_factory import check_objective
from ctopd_jax.preflight.checkpoints import check_checkpoint_state, check_output_dirs
from ctopd_jax.preflight.data import check_data
from ctopd_jax.preflight.errors import as_teacher, fail
from ctopd_jax.preflight.models import (check_init_adapter, check_lora_rank, check_model,
                                        check_served_teacher_files)
from ctopd_jax.preflight.settings import check_mesh, check_packages, check_rollout_side
from ctopd_jax.preflight.tokenizers import (check_eval_prompts, check_objective_models,
                                            check_overlap, encode_prompts, check_prompt_lengths,
                                            load_tokenizer)


@dataclass
class Preflight(contextlib.AbstractContextManager):   # `with preflight(...) as pre`
    """What the checks loaded (cheap things only), for the trainer to reuse."""
    config: TrainConfig
    prompts: list                       # data.Prompt, validated
    data_path: Path
    student_tokenizer: Any              # tokenization.TokenizerSide
    teachers: dict[str, "TeacherChecks"]   # name -> what was loaded of it (config.teacher_views)
    mesh_shape: dict[str, int]
    checkpoint_dir: Path
    checkpoint_steps: list[int]         # committed steps with a readable meta
    resume: bool
    config_changes: list = field(default_factory=list)   # resume_config.ConfigChange
    saved_config_source: str = ""
    model_dirs: dict[str, Path | None] = field(default_factory=dict)   # role -> HF dir or None
    objective: Any = None               # algorithms.Objective, built and checked once
    owned: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # stops what the
                                        # run started (teacher.launch's servers) on close()
                                        # (preflight/served_start.py)

    def close(self) -> None:
        self.owned.close()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def teacher(self) -> "TeacherChecks":
        """The default teacher's checks (the only one without `teachers:`)."""
        return self.teachers[default_teacher(self.config)]


@dataclass
class TeacherChecks:
    """What the checks loaded of one teacher."""
    config: TrainConfig                 # the run's config as this teacher sees it
    tokenizer: Any                      # tokenization.TokenizerSide
    overlap: Any                        # tokenization.OverlapMap with the student
    model_dir: Path | None              # its HF folder, or None (a preset)
    model_cfg: Any                      # its ModelConfig (config.json), or None (a preset)
    served: Any = None                  # teacher_service.ServedTeacher, started (teacher.engine
                                        # vllm_server / sglang_server) by start_served_teachers


def preflight(config: TrainConfig, *, resume: bool = False, allow_config_change: bool = False,
              device_count: int | None = None) -> Preflight:
    """Run every cheap check (module doc); raises PreflightError, returns what it loaded."""
    try:
        validate(config)
    except ConfigError as err:
        raise fail(str(err)) from None
    check_rollout_side(config)
    check_packages(config)
    objective = check_objective(config)
    mesh_shape = check_mesh(config, device_count)
    check_output_dirs(config)
    ck_dir, steps, changes, where = check_checkpoint_state(config, resume, allow_config_change)
    data_path, prompts, eval_set = check_data(config)
    student_dir, student_cfg = check_model(config.model.student, "student")
    check_lora_rank(config, student_cfg)
    student = load_tokenizer(config, "student", student_dir, student_cfg)
    if config.model.teacher_base:   # OPD²'s third model: its files, before any model loads
        check_model(config.model.teacher_base, "teacher_base")
    check_init_adapter(config)
    check_prompt_lengths(config, prompts, student, student_cfg, data_path)
    check_eval_prompts(config, objective, eval_set, student, student_cfg)
    teachers = {}
    for name, view in teacher_views(config).items():
        with as_teacher(config, name):
            teachers[name] = _check_teacher(view, objective, student, prompts)
    return Preflight(config=config, prompts=prompts, data_path=data_path,
                     student_tokenizer=student, teachers=teachers, mesh_shape=mesh_shape,
                     checkpoint_dir=ck_dir, checkpoint_steps=steps, resume=resume,
                     config_changes=changes, saved_config_source=where, objective=objective)


def _check_teacher(config: TrainConfig, objective, student, prompts) -> TeacherChecks:
    """One teacher (`config` as it sees the run): its files (a served one's config.json only;
    its server is started and checked after the checks: served_start.py), its tokenizer against its model and the student's (the
    overlap), the prompts in its tokenizer, and the objective's checks against it."""
    if config.teacher.served:
        directory, cfg = check_served_teacher_files(config)
    else:
        directory, cfg = check_model(config.model.teacher, "teacher")
    side = load_tokenizer(config, "teacher", directory, cfg)
    overlap = check_overlap(objective, side, student)
    encode_prompts(side, prompts, "teacher", "model.teacher_tokenizer")
    check_objective_models(config, objective, side, cfg)
    return TeacherChecks(config, side, overlap, directory, cfg)
