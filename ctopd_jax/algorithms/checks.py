"""The objective factory: the run's objective built from its config section and checked
against the rest of the run config, before anything is read from disk.

`check_objective(config)` raises one ConfigError line naming the field and the fix for: the
objective's own `check_run`; several teachers (`teachers:`) with an objective built for one; a
teacher behind a server that cannot give what the objective reads of it; an environment's
episodes for an objective that cannot train on them; a missing `model.teacher_base`. The
checks that read files (one tokenizer on both sides of a same-tokenizer objective, a response
in every dataset row), and async rollouts, are objective_factory.check_objective's.
"""
from __future__ import annotations

from ctopd_jax.config.catalog import get_objective, objectives_that
from ctopd_jax.config import ConfigError, TrainConfig, teacher_views


def _fail(message: str) -> ConfigError:
    return ConfigError(" ".join(message.split()))


def check_objective(config: TrainConfig):
    """The run's objective (algorithms.base.Objective), built once and checked (module doc)."""
    objective = get_objective(config.algorithm)
    needs, m, name = objective.needs, config.model, config.algorithm.name
    try:
        objective.check_run(config)
    except ValueError as err:
        raise _fail(str(err)) from None
    views = teacher_views(config)
    if len(views) > 1:
        _check_several_teachers(config, objective)
    for view in views.values():
        if view.teacher.served:
            _check_served_objective(view, objective)
    if config.rollout.environment and not needs.episodes:
        can = objectives_that(lambda o: o.needs.episodes)
        raise _fail(
            f"rollout.environment={config.rollout.environment}: episodes are sampled by the student and their ids "
            f"reused, which algorithm.name={name} cannot train on; use {', '.join(can)}, or set "
            "rollout.environment=''")
    if needs.teacher_base and not m.teacher_base:
        raise _fail(f"model.teacher_base: algorithm.name={name} needs the teacher's pre-tuning "
                    "base model; set model.teacher_base (e.g. demo:char_teacher_base)")
    return objective


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
        raise _fail(f"teachers: algorithm.name={name} {single[0]}, which runs with one teacher "
                    "only; use one teacher (model.teacher) or another objective")
    if config.algorithm.diagnostics_every:
        raise _fail("algorithm.diagnostics_every: the gradient diagnostics run with one teacher; "
                    "set it to 0 with teachers:")
    r, o = config.rollout, config.optimizer
    responses = r.rollout_batch_size * r.n_samples_per_prompt
    if o.train_batch_size != responses:
        raise _fail(f"optimizer.train_batch_size: {o.train_batch_size}, but with teachers: one "
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
        raise _fail(f"{where} needs the teacher's full rows, which a served teacher does not "
                    f"return (it returns token log-probs and a top-k); with a served teacher use "
                    f"{', '.join(sampled)}, or the top-k approximations {', '.join(topk)}, or "
                    f"set teacher.engine=local")
    if needs.teacher_engine:
        raise _fail(f"{where} has the teacher sample (expert turns, responses or judge calls), "
                    "which a served teacher does not do yet; change those settings (e.g. "
                    "algorithm.tcod_mode=f2b) or set teacher.engine=local")
    if needs.teacher_scores == "token_logprobs" and config.algorithm.kd_temperature != 1.0:
        raise _fail(f"algorithm.kd_temperature: {config.algorithm.kd_temperature} with teacher.engine="
                    f"{engine}, but a server returns log-probs at temperature 1 only (a realised "
                    "token's log-prob at another temperature needs the full row); set "
                    "algorithm.kd_temperature=1.0 or teacher.engine=local")
    if config.algorithm.diagnostics_every:
        raise _fail(f"algorithm.diagnostics_every: the gradient diagnostics need the teacher's "
                    f"hidden rows, which teacher.engine={engine} does not give; set it to 0")
