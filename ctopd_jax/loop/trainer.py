"""The on-policy loop of SPEC §1, nothing else.

    prompts -> per teacher (`teachers:` routes each prompt; else the one): collector.Collector
       (render, generate, re-tokenize, align)
    -> (a teacher behind a server: its token log-probs (and top-k) of the batch, on the host)
    -> per optimizer batch, per teacher, per micro-batch: objective.prepare -> teacher hidden
       rows (local teacher)
       -> student gradient of the objective's sums (step/)
    -> optax update -> engine.update_weights -> metrics -> checkpoint

Building (models, engines, prompts, optimizer) lives in build.py, host collection in collect/collector.py,
the objectives in algorithms/: adding an objective never edits this file.

Decisions where SPEC is silent:
- One iteration = one rollout of rollout_batch_size * n_samples_per_prompt responses, split into
  optimizer batches of train_batch_size (usually one) and those into micro-batches of
  micro_batch_size; `steps` counts iterations and the schedule counts optimizer updates.
- The RNG key is split once per iteration; the sampling seed of that iteration comes from it.
- A step whose loss or gradient norm is not finite is not applied; that, a gradient norm stuck
  at 0 or a loss jump (run_guard.DivergenceGuard, `guard:`) stops the run with
  `TrainingDiverged` naming the step, its values and the last good checkpoint (on disk).
- SIGTERM / SIGINT (run_guard.SignalGuard): the step in flight finishes, is checkpointed, and
  the run stops with `Stopped`; the resumed run is bit-exact with an uninterrupted one.
- Metrics: each sum is reported as Σ over the iteration ÷ the iteration's student response
  tokens (`<name>_loss`); `loss` is the trained mix, `kd_loss` its distillation part.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.algorithms.packed_rows import (budget as packing_budget, host_micro_ranges, objective_budget,
                                              pack_rows)
from ctopd_jax.align import CoverageMeter
from ctopd_jax.common import heap
from ctopd_jax.common.metrics import MetricsLogger, StartupClock, StepTimer, compile_seconds
from ctopd_jax.common.run_guard import DivergenceGuard, Stopped, TrainingDiverged
from ctopd_jax.common.setup_errors import TrainerSetupError  # (also re-exported for callers)
from ctopd_jax.config import TrainConfig, default_teacher
from ctopd_jax.loop import build, export, offload, teacher_batches
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.mean_at_k import evaluate_during_training
from ctopd_jax.loop.objective_factory import check_objective
from ctopd_jax.mesh.arrays import on_mesh, to_global
from ctopd_jax.models import lora
from ctopd_jax.rollout.async_rollouts import Drawn, Rollouts
from ctopd_jax.rollout.staleness import step_objective
from ctopd_jax.step.diagnostics import Diagnostics
from ctopd_jax.step import optimizer
from ctopd_jax.step.grad import micro_grad, zero_grads
from ctopd_jax.step.shards import stack_shards
from ctopd_jax.step.teacher import add_teacher_base, teacher_hidden_rows
from ctopd_jax.teacher_service import TeacherServiceError

COVERAGE_FIELDS = ("pairs", "student_tokens", "teacher_tokens", "mismatched", "samples")


@dataclass
class TrainResult:
    final_step: int
    run_dir: Path
    checkpoint_dir: Path
    hf_dir: Path | None
    last_metrics: dict[str, Any]


class Trainer:
    """The loop of one run: its parts come from build.assemble; `train()` runs it."""

    def __init__(self, config: TrainConfig, preflight=None):
        """`preflight` (preflight.Preflight): reuse the objective and what the cheap checks
        already loaded (tokenizers, overlap map, prompts) instead of building them again."""
        c = self.config = config
        self.run_dir = Path(c.output_dir)
        self.is_writer = jax.process_index() == 0
        startup = StartupClock(self.is_writer)
        # the objective is built and checked once, before any model loads (by preflight if it ran)
        objective = preflight.objective if preflight is not None else check_objective(c)
        parts = build.assemble(c, objective, preflight, startup)
        self.mesh, self.objective, self.stream = parts.mesh, parts.objective, parts.stream
        self.student, self.base, self.s_tok = parts.student, parts.teacher_base, parts.student_tokenizer
        self.engine, self.teachers = parts.engine, parts.teachers   # name -> build.TeacherParts
        self.default_teacher = default_teacher(c)
        startup("optimizer state")
        responses = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
        self.updates_per_iteration = responses // c.optimizer.train_batch_size
        self.tx, self.schedule, self.apply_update = build.update_fns(
            c.optimizer, c.steps * self.updates_per_iteration)
        self.graphdef, self.params, self.rest = nnx.split(self.student, lora.trainable_filter(c), ...)
        self.opt_state = optimizer.init_state(self.tx, self.params, self.mesh)
        self.rng = jax.random.key(c.seed)
        self.coverage = {name: CoverageMeter() for name in self.teachers}
        self.guard = DivergenceGuard.from_config(c.guard)
        self.update_count = 0
        self.rollouts = Rollouts(self.draw, self.collect, c.rollout, c.steps)
        self.step_objective = step_objective(self.objective, c.rollout)   # staleness-corrected
        self.diagnostics = None
        if c.algorithm.diagnostics_every:
            self.diagnostics = Diagnostics(c, self.objective, self.stream.prompts)
        startup("ready")

    @property
    def default_parts(self) -> build.TeacherParts:
        """The default teacher's parts (the only teacher without `teachers:`)."""
        return self.teachers[self.default_teacher]

    # -- checkpoint state -----------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        rng = self.rng if self.rollouts.ahead() is None else self.rollouts.ahead().before[0]
        return {"params": self.params, "opt_state": self.opt_state,
                "rng": on_mesh(jax.random.key_data(rng), self.mesh)}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.rng = jax.random.wrap_key_data(jnp.asarray(jax.device_get(
            state["rng"].addressable_data(0) if not state["rng"].is_fully_addressable else state["rng"])))
        nnx.update(self.student, self.params)

    # -- one iteration --------------------------------------------------------------------
    def micro_batch(self, teacher, host, start: int, stop: int, total_tokens: float, accumulation: int, grads,
                    timer, dropout, packed: bool = False):
        """(loss, sums, metrics, grads + its gradient) of samples [start, stop) of a batch collected
        for `teacher` (build.TeacherParts; `grads` is donated to the step; `dropout`: its LoRA
        dropout, lora.train_dropout; `packed`: packed rows, algorithms/packed_rows.py).

        When the micro-batch divides over the batch shards (data × fsdp), each shard's samples
        are prepared on their own and the loss and teacher rows run per shard (no row moves
        between devices); otherwise the micro-batch is one unit, computed alike everywhere."""
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        shards = shards if (stop - start) % shards == 0 else 1
        step = (stop - start) // shards
        with timer("prepare"):   # host work, hidden under the device's previous micro-batch
            parts = [self.objective.prepare(host, a, a + step) for a in range(start, stop, step)]
            if packed:   # one micro-batch: rows of the budget; a shard's part: rows enough for it
                parts = [pack_rows(p, packing_budget(self.config) if shards == 1 else None) for p in parts]
            batch = to_global(stack_shards(parts), self.mesh)
        mesh = self.mesh if shards > 1 else None
        t_graphdef, t_state, t_lm_head = teacher.scoring
        with timer("teacher") as since, jax.set_mesh(self.mesh):  # the models' activation constraints bind
            t_hidden = None   # a served teacher's log-probs came with the host batch (iteration)
            if teacher.served is None:
                t_hidden = teacher_hidden_rows(t_graphdef, t_state, batch.teacher_ids, batch.teacher_mask,
                                               batch.teacher_rows, mesh=mesh)
            batch, overlap = add_teacher_base(self.base, batch, teacher.overlap_arrays, mesh)
        if t_hidden is not None or batch.base_hidden is not None:
            timer.device("teacher", t_hidden if batch.base_hidden is None else batch.base_hidden, since)
        with timer("student") as since, jax.set_mesh(self.mesh):
            out = micro_grad(self.params, self.rest, batch, t_hidden, t_lm_head, overlap,
                             np.float32(total_tokens), grads, graphdef=self.graphdef,
                             accumulation=accumulation, objective=self.step_objective, mesh=mesh, dropout=dropout)
        timer.device("student", out[0], since)
        return out

    @property
    def packing(self) -> bool:
        """Packed rows: a token budget is set and the objective can pack (else its fallback)."""
        return objective_budget(self.config, self.objective) > 0

    def micro_ranges(self, host, first: int, last: int) -> list[tuple[int, int]]:
        """The micro-batches [start, stop) of samples [first, last): micro_batch_size samples
        (a teacher's last one may be short), or, packing, consecutive samples whose student
        and teacher tokens each fit rows of micro_batch_tokens (packing.micro_ranges)."""
        o = self.config.optimizer
        if not self.packing:
            return [(a, min(a + o.micro_batch_size, last)) for a in range(first, last, o.micro_batch_size)]
        return host_micro_ranges(host, first, last, packing_budget(self.config))

    def draw(self, index: int) -> Drawn:
        """Iteration `index`'s prompts and sampling seed: the RNG is split once per iteration, the
        dropout key (its LoRA dropout masks) comes from the same split."""
        before = (self.rng, self.stream.state())
        self.rng, sub = jax.random.split(self.rng)
        seed = int(jax.random.randint(sub, (), 0, 2 ** 31 - 1))
        return Drawn(index, self.stream.next_batch(), seed, jax.random.fold_in(sub, 1), before)

    def collect(self, drawn: Drawn, timer: StepTimer) -> dict[str, Any]:
        with self.offloaded(timer):
            return teacher_batches.collect(self.teachers, self.config, self.objective, drawn.prompts,
                                           drawn.seed, timer, drawn.index)

    @contextlib.contextmanager
    def offloaded(self, timer: StepTimer):
        """optimizer.offload_during_rollout: AdamW state in host memory meanwhile (room for the
        sampler's pages, offload.py)."""
        on = self.config.optimizer.offload_during_rollout
        if on:
            with timer("offload"):
                self.opt_state = offload.move(self.opt_state, offload.HOST)
        yield
        if on:
            with timer("offload"):
                self.opt_state = offload.move(self.opt_state, offload.DEVICE)

    def iteration(self, timer: StepTimer, rollout_index: int = 0) -> tuple[dict[str, Any], list[dict]]:
        o = self.config.optimizer
        collected, drawn, rollout_metrics = self.rollouts.take(rollout_index, timer)
        coverage = {name: self.coverage[name].update(host.alignment) for name, host in collected.items()}
        # packed micro-batches vary in number: each is normalised by the whole batch's tokens
        accumulation = 1 if self.packing else o.train_batch_size // o.micro_batch_size
        sums = teacher_batches.IterationSums(collected)
        infos = []
        for pieces in teacher_batches.update_pieces(collected, o.train_batch_size, bool(self.config.teachers)):
            total = sum(host.tokens(a, b) for _, host, a, b, _ in pieces)
            grads, loss = zero_grads(self.params), 0.0
            for name, host, first, last, offset in pieces:
                for start, stop in self.micro_ranges(host, first, last):
                    l, s, m, grads = self.micro_batch(
                        self.teachers[name], host, start, stop, total, accumulation, grads, timer,
                        lora.train_dropout(self.config, drawn.dropout_key, offset + start), self.packing)
                    loss = loss + l
                    sums.add(name, s, m)
            with timer("student") as since:
                self.params, self.opt_state, info = self.apply_update(
                    self.params, self.opt_state, grads, loss, np.int32(self.update_count))
                self.update_count += 1
                infos.append(info)   # fetched with the sums, once per iteration
            timer.device("student", info["grad_norm"], since)
        self.rollouts.before_push(timer)
        with timer("sync"):
            nnx.update(self.student, self.params)
            self.engine.update_weights(self.student)
        self.rollouts.after_push(rollout_index)
        metrics = sums.metrics(self.objective, collected, infos, coverage,
                               several=bool(self.config.teachers))
        metrics.update(self.engine.push_metrics(), **rollout_metrics)
        return metrics, [record for host in collected.values() for record in host.mismatch_samples()]

    # -- the loop ---------------------------------------------------------------------------
    def _checkpoint_meta(self) -> dict[str, Any]:
        ahead = self.rollouts.ahead()   # a resume draws that iteration again
        return {"data": self.stream.state() if ahead is None else ahead.before[1], "config": self.config.to_dict(),
                "update_count": self.update_count, "objective": self.objective.state_dict(),
                "guard": self.guard.state(),
                "coverage": {name: {k: getattr(cov, k) for k in COVERAGE_FIELDS}
                             for name, cov in self.coverage.items()}}

    def _resume(self, checkpointer) -> int:
        restored = checkpointer.restore_latest(self._state())
        if restored is None:
            return 0
        self._load_state(restored.state)
        self.stream.restore(restored.meta["data"])
        self.update_count = int(restored.meta["update_count"])
        self.objective.load_state_dict(restored.meta.get("objective", {}))
        self.guard.restore(restored.meta.get("guard"))
        self._restored_lines = restored.meta.get("log")   # the step's log lines (metrics_files.py)
        saved = restored.meta["coverage"]
        if "pairs" in saved:   # a checkpoint of one teacher written before `teachers:` existed
            saved = {self.default_teacher: saved}
        for name, fields in saved.items():
            for k, v in fields.items():
                setattr(self.coverage[name], k, v)
        self.engine.update_weights(self.student)
        return restored.step

    def train(self, resume: bool = False, stop=None, on_resumed=None) -> TrainResult:
        """Run to `steps`. `stop` (run_guard.SignalGuard): at each step boundary a requested stop
        checkpoints the finished step and raises run_guard.Stopped. `on_resumed(step)` runs once
        a checkpoint was restored (a refused restore writes nothing into the run)."""
        c = self.config
        ck_dir = Path(c.checkpoint.dir) if c.checkpoint.dir else self.run_dir / "checkpoints"
        checkpointer = Checkpointer(ck_dir, every=c.checkpoint.every, keep=c.checkpoint.keep,
                                    async_save=c.checkpoint.async_save)
        if not resume and checkpointer.steps():
            checkpointer.close()
            raise TrainerSetupError(f"{ck_dir} already holds checkpoints {checkpointer.steps()}; pass --resume "
                                    "to continue that run or choose another output_dir")
        self._restored_lines = None
        start = self._resume(checkpointer) if resume else 0
        if start and on_resumed is not None:
            on_resumed(start)
        if self.is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            draft = self.run_dir / "config.json.tmp"   # renamed into place: a kill leaves one whole
            draft.write_text(c.to_json())
            draft.replace(self.run_dir / "config.json")
        lg = c.logging
        logger = MetricsLogger(self.run_dir, c.steps, start_step=start, jsonl=lg.jsonl,
                               tensorboard=lg.tensorboard, progress=lg.progress, is_writer=self.is_writer,
                               config=c, restored_lines=self._restored_lines)
        logger.write(f"run {c.run_name}, objective {c.algorithm.name}; " + (
            f"resumed from step {start} ({ck_dir})" if start else
            "overlap: " + json.dumps(self.default_parts.overlap.summary() if not c.teachers else
                                     {name: t.overlap.summary() for name, t in self.teachers.items()})))
        if packing_budget(c) > 0 and not self.objective.packs:
            logger.write(f"{c.algorithm.name} cannot pack rows (its packs declaration): its micro-batches "
                         f"keep one row per sample, optimizer.micro_batch_size {c.optimizer.micro_batch_size}")
        record: dict[str, Any] = {}
        try:
            for step in range(start + 1, c.steps + 1):
                timer = StepTimer()
                try:
                    metrics, samples = self.step(step, timer)
                except TeacherServiceError as err:   # the server failed: say where to resume
                    raise TeacherServiceError(f"step {step}: {err} (last checkpoint: "
                                              f"{checkpointer.newest_whole()} in {ck_dir}; continue "
                                              "with --resume once the server answers)") from None
                reason = self.guard.check(step, metrics)
                if reason:
                    logger.log(step, metrics, samples)  # the failing step's values are kept
                    raise TrainingDiverged(f"{reason}. Last good checkpoint: "
                                           f"{checkpointer.newest_whole()} in {ck_dir}")
                stopping = stop is not None and stop.requested_everywhere()
                logged = step % lg.log_every == 0 or step == c.steps or stopping
                if c.checkpoint.save and (checkpointer.should_save(step, c.steps) or stopping):
                    # the lines this step logs ride in its checkpoint: the (async) commit may
                    # land before they do, and a resume from it starts after them
                    lines = logger.lines(step, metrics, samples) if logged else None
                    with timer("checkpoint"):
                        checkpointer.save(step, self._state(), {**self._checkpoint_meta(), "log": lines})
                        export.write_adapter(self.student, c, self.run_dir, self.is_writer)  # LoRA only
                metrics.update(timer.as_metrics())
                if logged:
                    record = logger.log(step, metrics, samples)
                if stopping:
                    checkpointer.wait()
                    raise Stopped(stop.signum, step, ck_dir)
        finally:
            self.rollouts.close()
            try:
                checkpointer.close()      # raises CheckpointWriteError if the last write failed
            finally:
                logger.close()
        hf_dir = export.export_student(self.student, self.s_tok, self.run_dir / "hf_student", self.is_writer, c) \
            if c.checkpoint.export_hf else None
        return TrainResult(c.steps, self.run_dir, ck_dir, hf_dir, record)

    def step(self, step: int, timer: StepTimer) -> tuple[dict[str, Any], list[dict]]:
        """One iteration with its diagnostics (before the update) and evaluation (after)."""
        began, compiled = time.perf_counter(), compile_seconds()
        diagnostics = {}
        if self.diagnostics is not None and self.diagnostics.due(step - 1):
            with timer("diagnostics"):
                teacher = self.default_parts   # preflight: diagnostics run with one teacher
                diagnostics = self.diagnostics.run(
                    teacher.collector, self.mesh, (self.graphdef, self.params, self.rest),
                    teacher.scoring, teacher.overlap_arrays)
        metrics, samples = self.iteration(timer, step - 1)   # rollout batch n = step − 1 (TCOD's curriculum)
        metrics.update(diagnostics)
        metrics["tokens_per_s"] = metrics["student_response_tokens"] / max(time.perf_counter() - began, 1e-9)
        with timer("eval"):
            metrics.update(evaluate_during_training(self.config, step, self.student, self.s_tok, self.engine,
                                                    self.run_dir if self.is_writer else None))
        if compile_seconds() > compiled:   # the compiler's freed host heap back to the OS (common/heap.py)
            with timer("heap_trim"):
                heap.trim()
        return metrics, samples
