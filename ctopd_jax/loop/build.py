"""Building what the loop runs: models on the mesh, tokenizers, the rollout engine, prompts and
the optimizer update. trainer.py only calls these.

Decisions where SPEC is silent:
- Prompts whose student rendering is longer than rollout.max_prompt_len are dropped once at
  start-up (with a warning naming the count and the first one), so the data order is fixed.
- Multi-process (jax.distributed): each process samples its shard of the prompts with its own
  engine (rollout/process_sharded.py).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from ctopd_jax.algorithms import packed_rows
from ctopd_jax.algorithms.base import TurnJudge
from ctopd_jax.collect.collector import Collector, SameTokenizerCollector, render
from ctopd_jax.collect.episode_collector import EpisodeCollector
from ctopd_jax.common import sources
from ctopd_jax.common.routing import row_teachers
from ctopd_jax.common.setup_errors import TrainerSetupError
from ctopd_jax.config import default_teacher, teacher_views
from ctopd_jax.data.prompts import PromptStream, load_prompts, resolve_named_source, response_prompts
from ctopd_jax.envs import make_environment
from ctopd_jax.loop.model_sources import model_dir, served_teacher_model_config, tokenizer_side
from ctopd_jax.loop.objective_factory import check_pair
from ctopd_jax.mesh import device_mesh as mesh_lib
from ctopd_jax.mesh.arrays import replicated
from ctopd_jax.models import PRESETS, lora
from ctopd_jax.models import weights   # weights.load_hf_checkpoint read at call time (tests trip on it)
from ctopd_jax.models.init import init_decoder
from ctopd_jax.rollout.jax_sampler import JaxSampler
from ctopd_jax.rollout.process_sharded import ProcessShardedEngine
from ctopd_jax.rollout.served import ServedRolloutEngine
from ctopd_jax.rollout.vllm_engine import VllmEngine
from ctopd_jax.step.grad import make_apply_update
from ctopd_jax.step.optimizer import make_optimizer
from ctopd_jax.step.teacher import lm_head_of
from ctopd_jax.teacher_service import ServedTeacher
from ctopd_jax.tokenization.overlap import overlap_map


def load_side(spec: str, tokenizer_spec: str, model_section, mesh, seed: int, role: str, tokenizer=None):
    """(Decoder on the mesh, TokenizerSide) for `model.student` / `model.teacher` (`tokenizer`:
    an already loaded side, e.g. from preflight)."""
    directory = model_dir(spec)
    name = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    if directory is None and name not in PRESETS:
        raise TrainerSetupError(
            f"model.{role}={spec!r}: not a checkpoint directory, a named source (demo:{role}), or a "
            f"preset ({', '.join(sorted(PRESETS))})")
    tokenizer = tokenizer if tokenizer is not None else tokenizer_side(spec, tokenizer_spec, role)
    param_dtype = model_section.param_dtype
    if role == "teacher" and model_section.teacher_param_dtype:
        param_dtype = model_section.teacher_param_dtype
    # The execution options (attention and mlp_chunk for every side; remat, remat_policy and
    # scan_layers for the student only) go into its ModelConfig, checkpoint or preset alike.
    kwargs = dict(dtype=model_section.dtype, param_dtype=param_dtype,
                  **model_section.execution_options(role))
    if directory is not None:
        model, _ = weights.load_hf_checkpoint(directory, mesh=mesh, **kwargs)  # placed on its shardings
    else:
        cfg = PRESETS[name](vocab_size=tokenizer.vocab_size, **kwargs)
        model = init_decoder(cfg, seed, mesh)  # drawn on its shardings
    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise TrainerSetupError(
            f"model.{role}: vocabulary {model.cfg.vocab_size} is smaller than its tokenizer's "
            f"{tokenizer.vocab_size}; pair the model with the tokenizer it was trained with")
    return model, tokenizer


def start_served_teacher(config, vocab_size: int, url: str | None = None):
    """The teacher behind a server (teacher_service.ServedTeacher over the `teacher:` section),
    after its start-up check (up, right engine, model and vocabulary; one line naming
    teacher.url and the fix otherwise: TeacherServerCheckError). `url`: the address of the
    server the run started itself (`teacher.launch`, which preflight does)."""
    settings = config.teacher
    if settings.launch:
        if url is None:
            raise TrainerSetupError("teacher.launch: the run's own teacher server is started by "
                                    "preflight; build the Trainer with preflight=preflight(config) "
                                    "(as python -m ctopd_jax.train does) or set teacher.url")
        settings = dataclasses.replace(settings, url=url, launch=False, launch_python="")
    teacher = ServedTeacher(settings)
    teacher.start(vocab_size=vocab_size)
    return teacher


@dataclasses.dataclass
class TeacherParts:
    """One teacher of a run (one per `teachers:` entry, else the one of model.teacher)."""
    name: str
    model: Any                      # models.Decoder on the mesh; None when the teacher is served
    served: Any                     # teacher_service.ServedTeacher (started), or None (local)
    tokenizer: Any                  # tokenization.TokenizerSide
    overlap: Any                    # tokenization.OverlapMap with the student
    overlap_arrays: dict            # its id arrays on the mesh: {"s_ids", "t_ids"}
    collector: Any                  # collector.Collector / SameTokenizerCollector / EpisodeCollector
    scoring: tuple = (None, None, None)   # (graphdef, state, lm_head) of `model`, as
                                          # teacher_hidden_rows and the loss read them


@dataclasses.dataclass
class Parts:
    """What a run is assembled from (`assemble`); the loop adds its own state."""
    mesh: Any
    objective: Any                  # algorithms.Objective, built and checked once
    student: Any                    # models.Decoder on the mesh (LoRA adapters attached)
    teachers: dict                  # name -> TeacherParts, in `teachers:` order
    teacher_base: Any               # (graphdef, state, lm_head) of model.teacher_base, or None
    student_tokenizer: Any          # tokenization.TokenizerSide
    stream: Any                     # data.PromptStream
    engine: Any                     # the rollout engine over the student


def assemble(config, objective, preflight=None, startup=lambda phase: None) -> Parts:
    """Everything a run of `objective` (built and checked: objective_factory.check_objective) needs,
    built in order (`startup(phase)` as each phase begins); what `preflight`
    (preflight.Preflight) already loaded is reused, not built again."""
    c, pre = config, preflight
    mesh = mesh_lib.make_mesh(dict(vars(c.mesh)))
    startup("student model")
    student, s_tok = load_side(c.model.student, c.model.student_tokenizer, c.model, mesh, c.seed,
                               "student", pre.student_tokenizer if pre is not None else None)
    teachers = {}
    for i, (name, view) in enumerate(teacher_views(c).items()):
        startup("served teacher" if view.teacher.served else "teacher model")
        teachers[name] = load_teacher(view, name, objective, s_tok, mesh, c.seed + 1 + i,
                                      pre.teachers[name] if pre is not None else None)
    startup("prompts")
    stream = prompt_stream(c, s_tok, objective, pre.prompts if pre is not None else None)
    lora.prepare(student, c)  # adapters attached before the engine starts (vLLM serves them)
    startup("rollout engine")
    engine = make_engine(student, s_tok, c.rollout, mesh, context_room(objective, c.rollout, s_tok),
                         log_as=Path(c.output_dir) / "rollout_server.log")
    for t in teachers.values():
        t.collector = make_collector(c, objective, s_tok, t.tokenizer, engine, t.model, mesh)
    return Parts(mesh, objective, student, teachers, load_teacher_base(c, mesh), s_tok, stream, engine)


def load_teacher(view, name: str, objective, s_tok, mesh, seed: int, checked=None) -> TeacherParts:
    """One teacher from `view` (the run's config as it sees it: config.teacher_views): its
    model on the mesh or its started server, its tokenizer and overlap map (`checked`:
    preflight.TeacherChecks, reused); the collector is added once the engine exists."""
    model = served = None
    if view.teacher.served:   # its weights stay on the server: only its tokenizer is needed here
        served = checked.served if checked is not None and checked.served is not None else \
            start_served_teacher(view, served_teacher_model_config(view).vocab_size)
        t_tok = checked.tokenizer if checked is not None else \
            tokenizer_side(view.model.teacher, view.model.teacher_tokenizer, "teacher")
    else:
        model, t_tok = load_side(view.model.teacher, view.model.teacher_tokenizer, view.model, mesh,
                                 seed, "teacher", checked.tokenizer if checked is not None else None)
    overlap = checked.overlap if checked is not None else overlap_map(t_tok, s_tok)
    if checked is None:
        check_pair(objective, overlap)
    arrays = {"s_ids": replicated(overlap.s_ids.astype(np.int32), mesh),
              "t_ids": replicated(overlap.t_ids.astype(np.int32), mesh)}
    scoring = (None, None, None)
    if model is not None:
        graphdef, state = nnx.split(model)
        scoring = (graphdef, state, lm_head_of(graphdef, state))
    return TeacherParts(name, model, served, t_tok, overlap, arrays, None, scoring)


def context_room(objective, rollout, side) -> int:
    """Prompt tokens an engine must accept beyond rollout.max_prompt_len: the later turns of an
    episode read the response so far, and SAGE-OPD's judge prompt wraps a turn and its feedback."""
    if not (objective.needs.turns or rollout.environment):
        return 0
    judge = objective.judge_prompt_tokens(side, rollout) if isinstance(objective, TurnJudge) else 0
    return rollout.generate_max_len + judge


def make_engine(student, s_tok, rollout, mesh, extra_context: int = 0, log_as=None):
    """The rollout engine of `rollout.engine` over the student policy; it accepts prompts of
    rollout.max_prompt_len + `extra_context` tokens. `log_as`: where a launched rollout
    server's log goes when it stops (the run's output_dir)."""
    if extra_context:
        rollout = dataclasses.replace(rollout, max_prompt_len=rollout.max_prompt_len + extra_context)

    def make(model):
        if rollout.engine in ("vllm_server", "sglang_server"):
            return ServedRolloutEngine(
                model, s_tok.eos_id, s_tok.pad_id, rollout, dtype=model.cfg.dtype,
                max_model_len=rollout.max_prompt_len + rollout.generate_max_len, log_as=log_as)
        if rollout.engine == "vllm":
            return VllmEngine.from_config(model, s_tok, rollout)
        return JaxSampler.from_config(model, s_tok, rollout,
                                      mesh=mesh if jax.process_count() == 1 else None)

    return make(student) if jax.process_count() == 1 else ProcessShardedEngine(make, student)


def prompt_stream(config, s_tok, objective, prompts=None):
    """The training prompts (data.path, or `prompts` already read; with their dataset responses
    when the objective trains on them) that fit rollout.max_prompt_len, as a resumable stream;
    with several teachers, each batch holds each teacher's share of the prompts."""
    d, r = config.data, config.rollout
    path = resolve_named_source(d.path) if sources.is_named(d.path) else d.path
    if prompts is None:
        prompts = response_prompts(d) if objective.needs.responses == "dataset" \
            else load_prompts(path, d.prompt_key, d.system_prompt)
    encoded = s_tok.tokenizer.encode_batch([render(s_tok, p) for p in prompts], add_special_tokens=False)
    fits = [len(e.ids) <= r.max_prompt_len for e in encoded]
    kept = [p for p, ok in zip(prompts, fits) if ok]
    if len(kept) < len(prompts):
        first = prompts[fits.index(False)]
        warnings.warn(f"data: dropped {len(prompts) - len(kept)} of {len(prompts)} prompts longer than "
                      f"rollout.max_prompt_len={r.max_prompt_len} student tokens (first: {first.source})",
                      RuntimeWarning, stacklevel=2)
    if not kept:
        raise TrainerSetupError(f"data.path {path}: no prompt fits rollout.max_prompt_len={r.max_prompt_len}")
    groups = (row_teachers([p.extra for p in kept], list(teacher_views(config)), default_teacher(config),
                           d.teacher_key) if config.teachers else None)
    return PromptStream(kept, r.rollout_batch_size, seed=d.seed, shuffle=d.shuffle, groups=groups)


@functools.lru_cache(maxsize=8)
def update_fns(section, total_steps: int):
    """(tx, schedule, jitted update) of an `optimizer:` section over `total_steps` updates,
    cached so equal runs share the compile."""
    tx, schedule = make_optimizer(section, total_steps)
    return tx, schedule, make_apply_update(tx, schedule)


def load_teacher_base(config, mesh):
    """(graphdef, state, lm_head) of model.teacher_base, or None when it is not set."""
    m = config.model
    if not m.teacher_base:
        return None
    base, _ = load_side(m.teacher_base, "", m, mesh, config.seed + 2, "teacher")
    graphdef, state = nnx.split(base)
    return graphdef, state, lm_head_of(graphdef, state)


def make_collector(config, objective, s_tok, t_tok, engine, teacher, mesh):
    """collector.Collector (cross-tokenizer) or collector.SameTokenizerCollector (`needs.reuse_sampled_ids`),
    with a second engine over the teacher when the objective may need teacher responses."""
    if not objective.needs.reuse_sampled_ids:   # packing: each optimizer batch in packed micro-batches
        budget = packed_rows.objective_budget(config, objective)
        return Collector(s_tok, t_tok, engine, config.rollout, config.optimizer.train_batch_size if budget else 1,
                         budget)
    teacher_engine = None
    if objective.needs.teacher_engine:
        # (preflight checked the objective's teacher calls fit the teacher's positions: check_models)
        teacher_engine = make_engine(teacher, t_tok, config.rollout, mesh,
                                     context_room(objective, config.rollout, t_tok))
    if objective.needs.turns or config.rollout.environment:
        env = config.rollout.environment
        return EpisodeCollector(s_tok, engine, config.rollout, objective, teacher_engine=teacher_engine,
                                environment=partial(make_environment, env) if env else None)
    o = config.optimizer
    return SameTokenizerCollector(s_tok, engine, config.rollout, objective, teacher_engine=teacher_engine,
                                  train_batch_size=o.train_batch_size, micro_batch_size=o.micro_batch_size)
