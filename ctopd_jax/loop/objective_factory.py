"""The objective factory: the run's objective, built once and checked before any model loads.

Preflight runs it first among the checks; a Trainer built without a preflight runs it itself, so
it sits with the loop's parts (it reads the builders and the host's tokenizer check) rather than
in the assembly above them. The checks against the config alone are the objectives' own
(algorithms/checks.py); the ones that read files or the rollout side are here."""
from __future__ import annotations

from ctopd_jax.algorithms.checks import check_objective as check_against_config
from ctopd_jax.loop.build import response_prompts, tokenizer_side, uses_dataset_responses
from ctopd_jax.config import TrainConfig, teacher_views
from ctopd_jax.tokenization.same_pair import check_same_tokenizer
from ctopd_jax.rollout.staleness import check_async
from ctopd_jax.common.setup_errors import fail


def check_objective(config: TrainConfig):
    """The run's objective, built once here and checked before any model loads: against the
    run config (algorithms.checks: its own `check_run`, several teachers, a served teacher, an
    environment's episodes, the teacher's base), against `rollout.async_rollouts`, then what it
    reads from files: one tokenizer and chat template on both sides of a same-tokenizer
    objective (and for model.teacher_base), and a response in every dataset row when it trains
    on them."""
    try:
        objective = check_against_config(config)
        check_async(config, objective)
    except ValueError as err:
        raise fail(str(err)) from None
    needs, m, name = objective.needs, config.model, config.algorithm.name
    if not needs.reuse_sampled_ids:
        return objective
    try:
        student = tokenizer_side(m.student, m.student_tokenizer, "student")
        for view in teacher_views(config).values():
            teacher = tokenizer_side(view.model.teacher, view.model.teacher_tokenizer, "teacher")
            check_same_tokenizer(teacher, student, name)
        if needs.teacher_base:
            check_same_tokenizer(tokenizer_side(m.teacher_base, "", "teacher_base"), student, name,
                                 what="model.teacher_base")
    except (ValueError, OSError) as err:
        raise fail(str(err)) from None
    if uses_dataset_responses(objective):
        try:
            response_prompts(config)
        except ValueError as err:
            raise fail(str(err)) from None
    return objective

