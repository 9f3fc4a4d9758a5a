"""The objective interface the trainer drives (docs/architecture.md, "The objective contract").

An objective is one module in `algorithms/` (or named in `algorithm.modules`) that registers a
class (config/catalog.py) with:

- `settings_class`: its config section, a frozen dataclass extending `config.AlgorithmSection`
  with the objective's own fields (`algorithm.span_lambda`, ...), validated once, by its own
  `validate()`, when the config is built (config/ looks the class up by `algorithm.name`);
- `needs`: what the host side must collect (where responses come from, which models run,
  rollout-time log-probs, whether sampled ids are reused);
- `check(overlap)`: settings that depend on the tokenizer pair (before any model loads);
- `prepare(host, start, stop)`: the `MicroBatch` (algorithms/micro_batch.py: named, documented
  fields) of one micro-batch from the host batch: pack.micro_batch's shared fields, the
  `teacher_rows` whose hidden states the teacher hands back (step/teacher.py), and its own arrays as
  `terms`, a dataclass its module defines (`@terms_class`, row fields declared with `rows(side)`);
- `packs`: whether its micro-batches may be packed (algorithms/packed_rows.py);
- `kd_sums(x)`: named loss SUMS over the micro-batch and metrics, on device;
- optionally: run state (`state_dict()` / `load_state_dict()`, saved with checkpoints, and
  `after_micro_batch(metrics)` that updates it), a `gradient_comparison()` for the diagnostics,
  and the capabilities `TurnCurriculum` / `TurnJudge` (subclass them) for turn-structured
  episodes.

The trainer adds the CE term, applies the SPEC §1 normalization to Σ_k weight_k · sum_k
(÷ total student response tokens of the optimizer batch) and differentiates. A new objective
therefore never edits the loop.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.config import AlgorithmSection
from ctopd_jax.config.catalog import register  # noqa: F401  (objective modules' decorator)
from ctopd_jax.kernels import losses
from ctopd_jax.kernels.token_rows import token_rows


# The batch-shard mesh axes while the step runs an objective per batch shard (step.shards.per_shard).
_SHARD_AXES = contextvars.ContextVar("batch_shard_axes", default=None)


@contextlib.contextmanager
def batch_shard_axes(axes):
    """While tracing the per-shard loss: `shard_gather` gathers over `axes` (the step sets it)."""
    token = _SHARD_AXES.set(axes)
    try:
        yield
    finally:
        _SHARD_AXES.reset(token)


def shard_gather(x):
    """(x of every batch shard stacked along a new leading axis in shard order, this shard's
    index) inside the step's per-shard loss; (x[None], 0) elsewhere. Shard s holds block s of
    the micro-batch, so an objective can combine per-shard statistics in the micro-batch's
    sample order (e.g. MP-OPD's sequential GRASS noise EMA)."""
    axes = _SHARD_AXES.get()
    if axes is None:
        return jnp.asarray(x)[None], jnp.int32(0)
    return jax.lax.all_gather(x, axes), jax.lax.axis_index(axes)


RESPONSE_SOURCES = ("student", "dataset", "teacher", "teacher_prefix")

# What an objective needs from the teacher's scores (`Needs.teacher_scores`):
# - "full_rows": teacher rows over the whole vocabulary (hidden rows + lm_head on the mesh): only
#   a local teacher (`teacher.engine: local`) gives them;
# - "token_logprobs": log π_T of the realised tokens only (at temperature 1), which a teacher
#   behind a server returns too (docs/served_teacher.md); the host then puts them on the rows as
#   MicroBatch.teacher_token_logprobs and the step passes no teacher hidden rows (None);
# - "topk": the realised tokens' log-probs and the teacher's top-k (ids, log-probs) at every
#   response position, which only a served teacher gives (the loop asks it for teacher.top_k);
#   the objective reads them from host.served_teacher_rows in `prepare`
#   (algorithms/served_topk.py).
TEACHER_SCORES = ("full_rows", "token_logprobs", "topk")


@dataclass(frozen=True)
class Needs:
    """What the host side collects for an objective."""
    responses: str = "student"           # one of RESPONSE_SOURCES
    teacher: bool = True                 # the teacher model scores the responses
    teacher_base: bool = False           # a third model: the teacher's pre-tuning base
    rollout_logprobs: bool = False       # engine log-probs of the sampled tokens (π_old)
    reuse_sampled_ids: bool = False      # same tokenizer: sampled ids reused, no re-tokenization
    turns: bool = False                  # turn-structured episodes (episode_collector.EpisodeCollector)
    episodes: bool = False               # may train on an environment's episodes (rollout.environment)
    teacher_engine: bool = False         # the teacher also samples (its responses, expert turns or
                                         # judge calls): a second rollout engine over the teacher
    outcome_rewards: bool = False        # episode rewards for an outcome advantage, even without an
                                         # environment (then graded by the task's answer grader)
    teacher_scores: str = "full_rows"    # one of TEACHER_SCORES: what it reads of the teacher


@dataclass(frozen=True)
class StepInputs:
    """What `kd_sums` sees on device for one micro-batch.

    hidden: student final hidden states [M*T, H] (flat rows); lm_head: [H, V_S];
    teacher_hidden: teacher hidden states [R_t, H_T] at batch.teacher_rows; teacher_lm_head:
    [H_T, V_T] (both None with a served teacher: then an objective whose needs.teacher_scores is
    "token_logprobs" reads batch.teacher_token_logprobs at its response rows, one whose
    needs.teacher_scores is "topk" the terms its `prepare` made of the served top-k);
    batch: the MicroBatch; response_logprobs: log π_S(y) at batch.response_rows over the full vocabulary
    (differentiable when the objective asks for it, see `response_logprob_grad`);
    overlap: {"s_ids", "t_ids"} [V∩] device arrays."""
    hidden: Any
    lm_head: Any
    teacher_hidden: Any
    teacher_lm_head: Any
    batch: MicroBatch
    overlap: dict
    response_logprobs: Any


@dataclass(frozen=True)
class GradientComparison:
    """What the gradient diagnostics (SPEC §6) compare: the gradients of the sums `trained` and
    `compared` of `objective.kd_sums` (an objective of the same settings, which may add the
    compared term), and, as a control, of `trained` on two random halves of the positions
    weighted by `weight`, the name of a field of the micro-batch's terms."""
    objective: "Objective"
    trained: str
    compared: str
    weight: str


class Objective:
    name: ClassVar[str] = ""
    settings_class: ClassVar[type] = AlgorithmSection
    # What the host side collects. Read it from an instance: an objective whose needs depend on
    # its settings (gkd's λ and seq_kd) computes it in a property.
    needs: Needs = Needs()
    # the objective's sums that are distillation terms (the trained loss is
    # kd_ratio · Σ_k weight_k · sum_k + (1 − kd_ratio) · CE)
    response_logprob_grad: ClassVar[bool] = False
    # what the demo (demo/compare.py) runs it with beside its pair's config: {dotted key: value}
    demo_settings: ClassVar[dict[str, Any]] = {}
    # packed rows (algorithms/packed_rows.py) move every declared row field of its micro-batch;
    # False: its loss depends on the micro-batch boundaries, it keeps one row per sample
    packs: ClassVar[bool] = True
    # rollout.async_rollouts at staleness 1 (rollout/staleness.py): "none" (full divergences per
    # state), "ratio" (its π_θ/π_rollout ratio), "tis" (truncated importance weights), or None:
    # one update of staleness is wrong for it, async refused
    stale_responses: ClassVar[str | None] = None

    def __init__(self, settings):
        if not isinstance(settings, self.settings_class):
            raise TypeError(f"{type(self).__name__} takes {self.settings_class.__name__}, "
                            f"got {type(settings).__name__}")
        self.settings = settings

    # The objective is a static argument of the jitted step: equal settings hash equal, so a
    # second trainer in the same process reuses the compiled program.
    def __hash__(self):
        return hash((type(self), self.settings))

    def __eq__(self, other):
        return type(self) is type(other) and self.settings == other.settings

    # -- run state (host side; checkpointed with the run, so a resume is bit-exact) -------------
    def state_dict(self) -> dict:
        """JSON-able run state of the objective (e.g. a noise EMA); {} when it has none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""

    def after_micro_batch(self, metrics: dict) -> dict:
        """Host, after each micro-batch's gradient (step.grad.micro_grad), in sample order: an
        objective with run-state statistics takes them out of `metrics` (already combined over
        the batch shards) and updates its state; returns the metrics to report."""
        return metrics

    # -- checks: one clear ValueError line, before any weight loads ----------------------------
    def check(self, overlap) -> None:
        """Raise one clear ValueError for settings that cannot work with this tokenizer pair."""

    def check_run(self, config) -> None:
        """Raise one clear ValueError for settings that cannot work with the rest of the run
        config (before any model loads)."""

    def check_models(self, config, teacher_cfg, teacher_side) -> None:
        """Raise one clear ValueError for settings that cannot work with the teacher's model
        config (models.ModelConfig, read from its files) and tokenizer (before any weight loads)."""

    # -- the data of a micro-batch (host side) ---------------------------------------------------
    def prepare(self, host, start: int, stop: int) -> MicroBatch:
        raise NotImplementedError

    def response_sources(self, micro_batches: int) -> list[str]:
        """Host, once per optimizer step of a same-tokenizer objective: where each of its
        `micro_batches` micro-batches takes its responses from (RESPONSE_SOURCES)."""
        return [self.needs.responses] * micro_batches

    # -- device side ---------------------------------------------------------------------------
    def gradient_comparison(self) -> "GradientComparison | None":
        """The two terms the gradient diagnostics of SPEC §6 compare (step/diagnostics.py), or
        None: this objective has nothing to diagnose."""
        return None

    def kd_weights(self) -> dict[str, float]:
        """Coefficient of each distillation sum in the KD term."""
        raise NotImplementedError

    def kd_sums(self, x: StepInputs) -> tuple[dict[str, jax.Array], dict[str, tuple]]:
        """({name: Σ of per-position terms}, {metric: (numerator, denominator)}) on device."""
        raise NotImplementedError

    def loss_weights(self) -> dict[str, float]:
        """Coefficient of every sum in the trained loss, CE included (SPEC §1 kd_ratio mix)."""
        kd_ratio = float(self.settings.kd_ratio)
        weights = {k: kd_ratio * v for k, v in self.kd_weights().items()}
        weights["ce"] = 1.0 - kd_ratio
        return weights

    def loss_sums(self, hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap):
        """All sums (the objective's and the CE) and metrics of one micro-batch."""
        s = self.settings
        grad = self.response_logprob_grad or s.kd_ratio < 1.0
        h, w = (hidden, lm_head) if grad else jax.lax.stop_gradient((hidden, lm_head))
        rows = jnp.take(h, batch.response_rows, axis=0)
        logp, _ = token_rows(rows, w, batch.response_targets, chunk_rows=s.chunked_loss_size,
                             implementation=s.implementation)
        x = StepInputs(hidden, lm_head, teacher_hidden, teacher_lm_head, batch, overlap, logp)
        sums, metrics = self.kd_sums(x)
        sums = dict(sums)
        sums["ce"] = losses.masked_sum(-logp, batch.response_weight)
        lp_w = batch.rollout_logprob_weight
        gap = jnp.abs(batch.rollout_logprobs - jax.lax.stop_gradient(logp))
        metrics = dict(metrics)
        metrics["logprob_gap"] = (jnp.sum(lp_w * gap), jnp.sum(lp_w))
        return sums, metrics


# -- optional capabilities: an objective that has one also subclasses it; the host side checks
# with isinstance (episode_collector.EpisodeCollector, build.context_room) ----------------------------

class TurnCurriculum:
    """Turn-structured episodes on a curriculum (needs.turns): how many turns the student plays,
    and how many turns of an expert path are replayed before it starts (TCOD)."""

    def turn_limit(self, rollout_index: int) -> int | None:
        """How many turns the student plays in rollout batch `rollout_index` (None: no limit)."""
        return None

    def uses_expert(self) -> bool:
        """Whether rollouts replay expert turns first (then `expert_prefix` counts them;
        needs.teacher_engine supplies expert paths a row lacks)."""
        return False

    def expert_prefix(self, rollout_index: int, length: int) -> int:
        """How many of an expert path's `length` turns are replayed before the student starts."""
        return 0


class TurnJudge:
    """A judge that labels every student turn after collection (needs.turns; SAGE-OPD)."""

    def judge_prompt_tokens(self, side, rollout) -> int:
        """Prompt tokens a judge call adds beyond an episode's context (0: no judge call)."""
        return 0

    def annotate(self, turns, episodes, samples, collector) -> None:
        """Add the labels to `turns` (turns.TurnRows) after collection."""

