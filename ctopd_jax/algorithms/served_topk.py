"""The two objectives a served teacher's top-k feeds (issue 25 item 2; docs/served_teacher.md).

A server returns, per response position, the realised token's log-prob and the teacher's top-k
(ids, log-probs), never a full row. So the full-row objectives `strict` and `gkd` have these
approximations, each selected by its own name:

- `teacher_topk_strict` (cross-tokenizer): at each strict pair (t, s) (SPEC §2) the columns are
  the teacher's top-k at t restricted to the shared vocabulary V∩ and mapped to student ids;
  both sides are renormalised over that set and D = `algorithm.kd_loss_fn` (SPEC §5) is taken
  at `kd_temperature` (exact at any τ: the served τ = 1 log-probs differ from the logits by one
  constant per row). k = `teacher.top_k`. Unlike `topk_strict` (the STUDENT picks its top-k
  columns, SPEC §4) the teacher picks them. A pair whose top-k holds no shared token adds 0.
  Metric `teacher_topk_mass`: the teacher probability its kept columns hold, per pair.
- `topk_gkd` (same tokenizer, a served teacher): GKD (SPEC §9, with gkd's λ draws, β and
  settings) on the support = the teacher's top-k, plus the sampled token when β > 0 (the
  token the student trains on always has a teacher value), with one tail bucket holding each
  side's remaining mass (`algorithm.topk_gkd_tail: true`, the default, needs kd_temperature 1)
  or both sides renormalised over the support (`false`).

Why new names rather than a mode of strict / gkd that switches on with a served teacher: the
name says which loss a run trains (its metrics key too), `strict` and `gkd` stay the exact
losses of a teacher on the mesh, and each class has one code path. They read only the served
top-k (`Needs.teacher_scores = "topk"`: the loop asks the server for teacher.top_k), so with
`teacher.engine: local` they are refused in favour of the exact objective (`check_run`).

The math (host: top-k -> fixed-width columns; device: renormalise, divergence) is
algorithms/served_topk_loss.py's, tested there against brute force; this module picks the rows (the
strict pairs' teacher rows, the response rows), pads them into micro-batch arrays and takes the
student's values at the columns (topk.head_columns: no [R, V] logits).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import Needs, Objective, register
from ctopd_jax.algorithms.gkd import Gkd, GkdSettings
from ctopd_jax.algorithms.micro_batch import terms_class
from ctopd_jax.algorithms.same_tokenizer import same_inputs
from ctopd_jax.algorithms.served_topk_loss import (head_columns, overlap_pairs_by_teacher_id,
                                                   topk_gkd_rows, topk_gkd_support,
                                                   topk_strict_columns, topk_strict_rows,
                                                   vocabulary_logsumexps)
from ctopd_jax.algorithms.strict import StrictPairs, strict_inputs
from ctopd_jax.config import AlgorithmSection, require, teacher_views
from ctopd_jax.kernels import losses


def require_served_teacher(config, name: str, exact: str) -> None:
    if not all(view.teacher.served for view in teacher_views(config).values()):
        raise ValueError(
            f"algorithm.name={name} approximates {exact} from a served teacher's top-k, but "
            f"teacher.engine is local; train algorithm.name={exact} (exact, with the teacher on "
            f"the mesh), or serve the teacher (teacher.engine: vllm_server or sglang_server, "
            f"with teacher.url)")


class ServedTopkInputs:
    """`prepare` of both objectives: the exact objective's micro-batch (`exact_inputs`: the
    batch, the flat rows of the collected teacher batch it reads the teacher at, the row count
    to pad to), then its terms with the served top-k at those rows (`served_terms`)."""

    def prepare(self, host, start, stop):
        batch, rows, size = self.exact_inputs(host, start, stop)
        served = host.served_teacher_rows
        terms = self.served_terms(batch.terms, host, rows, served.topk_ids[rows], served.topk_logprobs[rows], size)
        return dataclasses.replace(batch, terms=terms)


# ---------------------------------------------------------------------- teacher-top-k strict

def overlap_table(overlap) -> tuple:
    """(s_ids, pairs by teacher id) of a teacher's overlap map with the student, as
    topk_strict_columns reads them (once per collected batch: HostBatch.overlap)."""
    return (np.asarray(overlap.s_ids, np.int32),
            overlap_pairs_by_teacher_id(overlap.s_ids, overlap.t_ids, overlap.teacher_vocab_size))


@terms_class
class TopkPairs(StrictPairs):
    """The strict pairs (P, padded) with the teacher's served top-k (k columns) at each."""
    topk_student_ids: Any = None       # [P, k] int32: the student id of each column
    topk_teacher_logprobs: Any = None  # [P, k] float32: the teacher's log-prob there (-inf: none)
    topk_valid: Any = None             # [P, k] bool: a shared-vocabulary column
    topk_teacher_mass: Any = None      # [P] float32: the teacher probability the columns hold


@terms_class
class TopkSupport:
    """The served support at each response row (R, padded; k columns)."""
    topk_ids: Any = None               # [R, k] int32: the support's token ids
    topk_teacher_logprobs: Any = None  # [R, k] float32: the teacher's log-probs (-inf: padding)
    topk_valid: Any = None             # [R, k] bool


@register("teacher_topk_strict")
class TeacherTopkStrict(ServedTopkInputs, Objective):
    settings_class = AlgorithmSection
    stale_responses = "none"   # a top-k divergence per state
    needs = Needs(teacher_scores="topk")

    def check_run(self, config) -> None:
        require_served_teacher(config, self.name, "strict")

    def served_columns(self, pairs: StrictPairs, topk_ids, topk_logprobs, table, size: int) -> TopkPairs:
        """`pairs` with the teacher's top-k at them (ids, log-probs [n, k]), padded to `size`
        rows; `table`: overlap_table of the pair's overlap map."""
        cols = topk_strict_columns(topk_ids, topk_logprobs, *table)
        return TopkPairs(**vars(pairs), topk_student_ids=padded_rows.padded_rows(cols.student_ids, size),
                         topk_teacher_logprobs=padded_rows.padded_rows(cols.teacher_logprobs, size, -np.inf),
                         topk_valid=padded_rows.padded_rows(cols.valid, size, False),
                         topk_teacher_mass=padded_rows.padded(cols.teacher_mass, size, np.float32)[0])

    def exact_inputs(self, host, start, stop):
        batch, a = strict_inputs(host, start, stop), host.alignment
        pairs = a.teacher_rows[(a.pair_sample >= start) & (a.pair_sample < stop)]
        return batch, pairs, batch.terms.strict_weight.shape[0]

    def served_terms(self, pairs, host, rows, topk_ids, topk_logprobs, size):
        table = host.once("teacher_topk_overlap", lambda h: overlap_table(h.overlap))
        return self.served_columns(pairs, topk_ids, topk_logprobs, table, size)

    def kd_weights(self):
        return {"teacher_topk_strict": 1.0}

    def kd_sums(self, x):
        s, b = self.settings, x.batch.terms
        rows = jnp.take(x.hidden, b.strict_student_rows, axis=0)
        per_pair = topk_strict_rows(
            head_columns(rows, x.lm_head, b.topk_student_ids), b.topk_teacher_logprobs,
            b.topk_valid, kd_loss_fn=s.kd_loss_fn, temperature=s.kd_temperature,
            jsd_beta=s.jsd_beta, skl_lambda=s.skl_lambda, akl_alpha=s.akl_alpha)
        w = b.strict_weight
        return ({"teacher_topk_strict": losses.masked_sum(per_pair, w)},
                {"teacher_topk_mass": (jnp.sum(w * b.topk_teacher_mass), jnp.sum(w))})


# --------------------------------------------------------------------------------- top-k GKD

@dataclass(frozen=True)
class TopkGkdSettings(GkdSettings):
    # one more outcome holding each side's mass outside the support, else renormalise
    topk_gkd_tail: bool = True

    def validate(self) -> None:
        super().validate()
        require(not self.topk_gkd_tail or self.kd_temperature == 1.0, "algorithm.topk_gkd_tail",
                f"the tail bucket needs the teacher's full-vocabulary probabilities at "
                f"kd_temperature={self.kd_temperature}, which a server returns only at 1; set "
                f"algorithm.topk_gkd_tail=false or algorithm.kd_temperature=1.0")


@register("topk_gkd")
class TopkGkd(ServedTopkInputs, Gkd):
    settings_class = TopkGkdSettings

    @property
    def needs(self) -> Needs:
        return dataclasses.replace(super().needs, teacher_scores="topk")

    def check_run(self, config) -> None:
        require_served_teacher(config, self.name, "gkd")

    def served_support(self, topk_ids, topk_logprobs, sampled_ids, sampled_logprobs,
                       size: int) -> TopkSupport:
        """The support at the response rows (the top-k [n, k] and the sampled token [n] with
        its served log-prob), padded to `size` rows."""
        support = topk_gkd_support(topk_ids, topk_logprobs, sampled_ids, sampled_logprobs,
                                   include_sampled=self.settings.gkd_beta > 0)
        return TopkSupport(topk_ids=padded_rows.padded_rows(support.ids, size),
                           topk_teacher_logprobs=padded_rows.padded_rows(support.teacher_logprobs, size, -np.inf),
                           topk_valid=padded_rows.padded_rows(support.valid, size, False))

    def exact_inputs(self, host, start, stop):
        batch = same_inputs(host, start, stop)
        return batch, padded_rows.response_batch_rows(host.teacher, start, stop), batch.response_rows.shape[0]

    def served_terms(self, terms, host, rows, topk_ids, topk_logprobs, size):
        sampled = host.teacher.labels.reshape(-1)[rows]
        return self.served_support(topk_ids, topk_logprobs, sampled,
                                   host.served_teacher_rows.token_logprobs[rows], size)

    def kd_weights(self):
        return {"topk_gkd": 1.0}

    def kd_sums(self, x):
        s, b, support = self.settings, x.batch, x.batch.terms
        tau = s.kd_temperature
        rows = jnp.take(x.hidden, b.response_rows, axis=0)
        student, tail = head_columns(rows, x.lm_head, support.topk_ids) / tau, None
        if s.topk_gkd_tail:   # the tail needs full-vocabulary log-softmax(z / τ) at the support
            # (minus the row's logsumexp) and the log-mass outside it, summed outside it rather
            # than as 1 − the support's, which cancels in float32; without the tail the
            # support's renormalisation removes the logsumexp
            lse, outside = vocabulary_logsumexps(rows, x.lm_head, support.topk_ids, support.topk_valid,
                                                 temperature=tau, chunk_rows=s.chunked_loss_size)
            student, tail = student - lse[:, None], outside - lse
        per_row = topk_gkd_rows(student, support.topk_teacher_logprobs, support.topk_valid,
                                beta=float(s.gkd_beta), tail=s.topk_gkd_tail, temperature=tau,
                                student_tail=tail)
        return {"topk_gkd": losses.masked_sum(per_row, b.response_weight)}, {}
