"""The objective factory: the run's objective, built once and checked before any model loads.
Every check of an objective lives here, in the order a run meets them:

- `check_objective(config)`: against the run config (the objective's own `check_run`; several
  teachers with an objective built for one; a teacher behind a server that cannot give what the
  objective reads of it; an environment's episodes for an objective that cannot train on them;
  a missing `model.teacher_base`), against `rollout.async_rollouts`, then what it reads from
  files (one tokenizer and chat template on both sides of a same-tokenizer objective, a
  response in every dataset row);
- `check_pair(objective, overlap)`: against a tokenizer pair's shared vocabulary (the
  objective's `check`, e.g. ctkd_topk <= |V∩|);
- `check_models(config, objective, teacher_cfg, teacher_side)`: against the teacher's model
  config and tokenizer (the objective's `check_models`).

Its settings' values are checked where they are read (`validate` of its config section).
Preflight runs these first among the checks; a Trainer built without a preflight runs them
itself, so the module sits with the loop's parts rather than in the assembly above them.
Each refusal is one PreflightError line naming the field and the fix."""
from __future__ import annotations

from ctopd_jax.common.setup_errors import fail
from ctopd_jax.config import TrainConfig, teacher_views
from ctopd_jax.config.catalog import get_objective, objectives_that
from ctopd_jax.data.prompts import response_prompts
from ctopd_jax.loop.model_sources import tokenizer_side
from ctopd_jax.rollout.staleness import check_async
from ctopd_jax.tokenization.same_pair import check_same_tokenizer


def check_objective(config: TrainConfig):
    """The run's objective (algorithms.base.Objective), built once and checked (module doc)."""
    try:
        objective = get_objective(config.algorithm)
        _check_against_config(config, objective)
        check_async(config, objective)
    except ValueError as err:
        raise fail(" ".join(str(err).split())) from None
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
    if needs.responses == "dataset":
        try:
            response_prompts(config.data)
        except ValueError as err:
            raise fail(str(err)) from None
    return objective


def check_pair(objective, overlap) -> None:
    """The objective against a tokenizer pair's shared vocabulary (OverlapMap)."""
    try:
        objective.check(overlap)
    except ValueError as err:
        raise fail(str(err)) from None


def check_models(config: TrainConfig, objective, teacher_cfg, teacher_side) -> None:
    """The objective against the teacher's model config and tokenizer (before any weight)."""
    try:
        objective.check_models(config, teacher_cfg, teacher_side)
    except ValueError as err:
        raise fail(str(err)) from None


def _refuse(message: str) -> ValueError:
    return ValueError(" ".join(message.split()))


def _check_against_config(config: TrainConfig, objective) -> None:
    needs, m, name = objective.needs, config.model, config.algorithm.name
    objective.check_run(config)
    views = teacher_views(config)
    if len(views) > 1:
        _check_several_teachers(config, objective)
    for view in views.values():
        if view.teacher.served:
            _check_served_objective(view, objective)
    if config.rollout.environment and not needs.episodes:
        can = objectives_that(lambda o: o.needs.episodes)
        raise _refuse(
            f"rollout.environment={config.rollout.environment}: episodes are sampled by the student and their ids "
            f"reused, which algorithm.name={name} cannot train on; use {', '.join(can)}, or set "
            "rollout.environment=''")
    if needs.teacher_base and not m.teacher_base:
        raise _refuse(f"model.teacher_base: algorithm.name={name} needs the teacher's pre-tuning "
                      "base model; set model.teacher_base (e.g. demo:char_teacher_base)")


def _check_several_teachers(config: TrainConfig, objective) -> None:
    """With `teachers:` each optimizer batch trains on every teacher's samples of one
    iteration, one teacher per micro-batch: one update per iteration, and no objective part
    that is built for a single teacher (its sampling, its base, turn episodes, diagnostics)."""
    needs, name = objective.needs, config.algorithm.name
    single = [what for what, used in (
        ("has the teacher sample (a rollout engine over it)", needs.teacher_engine),
        ("needs the teacher's base model", needs.teacher_base),
        ("trains on turn-structured episodes", needs.turns or needs.episodes
         or bool(config.rollout.environment))) if used]
    if single:
        raise _refuse(f"teachers: algorithm.name={name} {single[0]}, which runs with one teacher "
                    "only; use one teacher (model.teacher) or another objective")
    if config.algorithm.diagnostics_every:
        raise _refuse("algorithm.diagnostics_every: the gradient diagnostics run with one teacher; "
                    "set it to 0 with teachers:")
    r, o = config.rollout, config.optimizer
    responses = r.rollout_batch_size * r.n_samples_per_prompt
    if o.train_batch_size != responses:
        raise _refuse(f"optimizer.train_batch_size: {o.train_batch_size}, but with teachers: one "
                    f"update trains on all {responses} responses of an iteration (each teacher's "
                    f"micro-batches in turn); set it to {responses}")


def _check_served_objective(config: TrainConfig, objective) -> None:
    """A teacher behind a server returns the realised tokens' log-probs and its top-k at
    temperature 1: the objective must need no more of it (Needs.teacher_scores), not have it
    sample, and read token log-probs at kd_temperature 1 (a top-k renormalised over its own
    columns is exact at any τ); the gradient diagnostics need its hidden rows."""
    engine, name, needs = config.teacher.engine, config.algorithm.name, objective.needs
    where = f"teacher.engine={engine}: algorithm.name={name}"
    if needs.teacher_scores == "full_rows":
        sampled = objectives_that(lambda o: o.needs.teacher_scores == "token_logprobs")
        topk = objectives_that(lambda o: o.needs.teacher_scores == "topk")
        raise _refuse(f"{where} needs the teacher's full rows, which a served teacher does not "
                    f"return (it returns token log-probs and a top-k); with a served teacher use "
                    f"{', '.join(sampled)}, or the top-k approximations {', '.join(topk)}, or "
                    f"set teacher.engine=local")
    if needs.teacher_engine:
        raise _refuse(f"{where} has the teacher sample (expert turns, responses or judge calls), "
                    "which a served teacher does not do yet; change those settings (e.g. "
                    "algorithm.tcod_mode=f2b) or set teacher.engine=local")
    if needs.teacher_scores == "token_logprobs" and config.algorithm.kd_temperature != 1.0:
        raise _refuse(f"algorithm.kd_temperature: {config.algorithm.kd_temperature} with teacher.engine="
                    f"{engine}, but a server returns log-probs at temperature 1 only (a realised "
                    "token's log-prob at another temperature needs the full row); set "
                    "algorithm.kd_temperature=1.0 or teacher.engine=local")
    if config.algorithm.diagnostics_every:
        raise _refuse(f"algorithm.diagnostics_every: the gradient diagnostics need the teacher's "
                    f"hidden rows, which teacher.engine={engine} does not give; set it to 0")
