"""The run's configuration as each of its teachers sees it."""
from __future__ import annotations

import dataclasses

from ctopd_jax.config.sections import TeacherSection, TrainConfig


def teacher_views(config: TrainConfig) -> dict[str, TrainConfig]:
    """name -> the run's config as one teacher sees it (model.teacher, model.teacher_tokenizer
    and `teacher:` from its entry), so every single-teacher check and builder serves each of
    several teachers unchanged. Without `teachers:`, the one teacher, named "teacher"."""
    if not config.teachers:
        return {"teacher": config}
    return {t.name: dataclasses.replace(
        config, teachers=(),
        model=dataclasses.replace(config.model, teacher=t.checkpoint, teacher_tokenizer=t.tokenizer),
        teacher=TeacherSection(**{f.name: getattr(t, f.name) for f in dataclasses.fields(TeacherSection)}))
        for t in config.teachers}


def default_teacher(config: TrainConfig) -> str:
    """The name of the teacher of rows that name none (data.default_teacher, else the first)."""
    return config.data.default_teacher or next(iter(teacher_views(config)))
