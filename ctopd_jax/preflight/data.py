"""The prompt file and every row of it, and the evaluation set."""
from __future__ import annotations

from pathlib import Path

from ctopd_jax.common import sources
from ctopd_jax.common.records import RecordError
from ctopd_jax.common.routing import route_rows
from ctopd_jax.config import TrainConfig, default_teacher, teacher_views
from ctopd_jax.data.eval_sets import load_dataset
from ctopd_jax.data.prompts import load_prompts, resolve_named_source
from ctopd_jax.preflight.errors import fail


def check_data(config: TrainConfig):

    d = config.data
    try:
        path = resolve_named_source(d.path) if sources.is_named(d.path) else Path(d.path)
        prompts = load_prompts(path, d.prompt_key, d.system_prompt)
    except (RecordError, OSError, UnicodeDecodeError) as err:
        text = str(err)   # file:line messages name the file already
        if "data.path" not in text and str(d.path) not in text:
            text = f"data.path {d.path}: {text}"
        raise fail(text) from None
    if config.teachers:   # every row's teacher is one of them (one line naming the row)
        try:
            routed = route_rows([p.extra for p in prompts], list(teacher_views(config)),
                                default_teacher(config), d.teacher_key, row_names=[p.source for p in prompts])
        except ValueError as err:
            raise fail(str(err)) from None
        named = sum(1 for rows in routed.values() if rows)   # each batch takes some of each
        if config.rollout.rollout_batch_size < named:
            raise fail(f"rollout.rollout_batch_size: {config.rollout.rollout_batch_size} is smaller than "
                       f"the {named} teachers the prompts name; raise it to at least {named}")
    e = config.evaluation
    eval_set = None
    if e.dataset:
        try:
            eval_set = load_dataset(e.dataset, limit=e.max_problems or None)
        except (RecordError, OSError, UnicodeDecodeError) as err:
            raise fail(f"evaluation.dataset {e.dataset}: {err}") from None
    return path, prompts, eval_set
