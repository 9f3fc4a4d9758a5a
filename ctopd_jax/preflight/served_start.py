"""Starting the served teachers, after every cheap check passed: the one step that talks to
another process."""
from __future__ import annotations

import contextlib
from pathlib import Path

from ctopd_jax.config import TrainConfig
from ctopd_jax.loop.build import start_served_teacher as start_client
from ctopd_jax.preflight.errors import as_teacher, fail
from ctopd_jax.teacher_service.launch import launched_server
from ctopd_jax.teacher_service.local_server import LocalServerError


def start_served_teachers(pre) -> None:
    """Start every served teacher of the checked run `pre` (preflight.Preflight): its server when
    `teacher.launch`, then the client's start-up check (up, right engine, model and
    vocabulary). What started belongs to `pre` (`with preflight(...) as pre` or `pre.close()`
    stops it); a failed start stops what had started and raises PreflightError."""
    with contextlib.ExitStack() as starting:   # a failed start-up check stops what started
        for name, t in pre.teachers.items():
            if t.config.teacher.served:
                with as_teacher(pre.config, name):
                    t.served = _start(t.config, t.model_dir, t.model_cfg, starting)
        pre.owned.enter_context(starting.pop_all())


def _start(config: TrainConfig, folder, teacher_cfg, owned: contextlib.ExitStack):
    """The started ServedTeacher (its start-up check against the teacher's vocabulary), after
    starting its server when `teacher.launch`; what it started is closed by `owned`."""
    url = None
    try:
        if config.teacher.launch:
            url = owned.enter_context(launched_server(
                config.teacher, folder, "teacher",
                max_model_len=teacher_cfg.max_position_embeddings,
                max_logprobs=config.teacher.top_k, dtype=config.model.dtype,
                keep_log_as=Path(config.output_dir) / "teacher_server.log")).url
        served = start_client(config, teacher_cfg.vocab_size, url=url)
    except LocalServerError as err:
        raise fail(f"teacher.launch: {err}; fix what its log says, or start a server yourself "
                   "and set teacher.url") from None
    except (ValueError, OSError) as err:   # TeacherServerCheckError
        raise fail(str(err)) from None
    owned.callback(served.close)
    return served
