"""SimCT (SPEC §7; `span_ctkd` in its released code): `algorithm.name: simct`.

Segments come from align.simct (the released decoded-string walk, one loss row per segment).
Each row has |V∩| + 1 columns on both sides:

    [ z̄(first position of the segment) over V∩ , span score ]

with the span score the mean over that side's tokens of the segment (anchor included) of the
raw logit of each realised id (`span_score_mode: raw_logit`, the released default) or of its
full-vocabulary log-probability (`mean_logprob`, the paper's Eq. 7; the V∩ columns are then
full-vocabulary log-softmax values, gathered after normalising, so a row is invariant to a
constant added to any position's logits). A 1:1 segment has −1e9 in the extra column on both
sides (so its row equals the Strict-full row). Loss: `kd_loss_fn` per row, teacher constant,
summed; the trainer divides by the student response tokens (SPEC §1) and adds CE for
`kd_ratio < 1`.

`simct_gh_mask: true` keeps a row iff Z ≥ 0.5 with Z = the teacher's full-vocabulary softmax mass
(τ = 1) on the V∩ columns at the segment's first teacher position plus, for a span row,
exp(mean teacher log-prob of the span's tokens), clamped at 1; a masked row adds 0.

Device path (no [rows, V] array of all rows at once): rows are processed in chunks of
`chunked_loss_size` inside a `lax.scan` whose body is rematerialised (`jax.checkpoint`), so
the forward keeps only per-chunk scalars and the backward recomputes one chunk's logits at a
time. The V∩ columns come from hidden rows @ lm_head[:, ids] (the columns gathered once); the
full-vocabulary logsumexp (mean_logprob, G(h)) is one [chunk, V] matmul per chunk. Span scores
are per-token quantities: raw logits are one dot product per token (h_t · W[:, y_t]); log-probs
come from kernels.token_rows (chunked, recomputing backward).

Decisions: with τ ≠ 1 the whole row (V∩ columns and the extra column) is divided by τ before
the divergence's log-softmax, as every §5 divergence does with logits; in `mean_logprob` the
row values themselves are log-probs at τ = 1. `align_ratio` is a ratio of sums over the whole
batch (Σ aligned tokens / Σ sample tokens, as a (num, den) metric), so it does not depend on how
the batch is cut into micro-batches and batch shards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import Objective, register
from ctopd_jax.algorithms.micro_batch import rows, terms_class
from ctopd_jax.align.simct import simct_segments
from ctopd_jax.config import AlgorithmSection
from ctopd_jax.kernels import losses
from ctopd_jax.kernels.token_rows import token_rows

NO_SPAN = -1e9  # the extra column of a 1:1 segment, on both sides


@dataclass(frozen=True)
class SimCTSettings(AlgorithmSection):
    span_score_mode: Literal["raw_logit", "mean_logprob"] = "raw_logit"  # the span column
    simct_gh_mask: bool = False          # the paper's G(h) mask (off in the release)


def host_segments(host):
    """SimCT segments of the whole collected batch (computed once per batch)."""
    return host.once("simct_segments", lambda h: simct_segments(h.teacher, h.student))


@terms_class
class SimctTerms:
    """The SimCT rows of a micro-batch: S segments (one loss row each), the N student and Q
    teacher tokens of its span segments (each padded)."""
    simct_student_first: Any = rows("student")   # [S] int32: each segment's first student row
    simct_teacher_first: Any = rows("teacher")   # [S] int32: its first teacher row
    simct_weight: Any = None                     # [S] float32: 1 real segment, 0 padding
    simct_is_span: Any = None                    # [S] float32: 1 span segment, 0 1:1
    simct_student_count: Any = None              # [S] float32: student tokens of a span segment
    simct_teacher_count: Any = None              # [S] float32: teacher tokens of a span segment
    simct_student_rows: Any = rows("student")    # [N] int32: every student row of the spans
    simct_student_targets: Any = None            # [N] int32: the token each predicts
    simct_student_group: Any = None              # [N] int32: its segment
    simct_student_token_weight: Any = None       # [N] float32: 1 real, 0 padding
    simct_teacher_span_rows: Any = rows("teacher")  # [Q] int32: every teacher row of the spans
    simct_teacher_targets: Any = None            # [Q] int32
    simct_teacher_group: Any = None              # [Q] int32
    simct_teacher_token_weight: Any = None       # [Q] float32
    # align_ratio parts (SPEC §7): Σ_segments max(lengths) and Σ_samples max(lengths), and the
    # samples. [1] arrays, not 0-d: per-shard parts are stacked along a leading axis (the step's
    # stack_shards) and summed on the device (psum over shards, sums over micro-batches)
    simct_aligned_tokens: Any = None
    simct_sample_tokens: Any = None
    simct_samples: Any = None


def segment_arrays(host, start: int, stop: int, student_len: int, teacher_len: int,
                   min_rows: int = 64) -> SimctTerms:
    """Rows of the segments of samples [start, stop) in micro-batch layout: the first row of
    each segment on each side, and every token row of the span segments (for span scores)."""
    seg = host_segments(host)
    sel = (seg.segments[:, 0] >= start) & (seg.segments[:, 0] < stop)
    g, span = seg.segments[sel].astype(np.int64), seg.is_span[sel]
    n = len(g)
    size = padded_rows.rows_bucket(n, min_rows)
    s_seq, t_seq = host.student.seq_len, host.teacher.seq_len
    first_s = padded_rows.rebase(g[:, 3], s_seq, start, student_len)
    first_t = padded_rows.rebase(g[:, 1], t_seq, start, teacher_len)
    sg, tg = g[span], np.flatnonzero(span)
    s_rows, s_group = padded_rows.expand_ranges(sg[:, 3], sg[:, 4] - sg[:, 3])
    t_rows, t_group = padded_rows.expand_ranges(sg[:, 1], sg[:, 2] - sg[:, 1])
    s_size, t_size = padded_rows.rows_bucket(len(s_rows), min_rows), padded_rows.rows_bucket(len(t_rows), min_rows)
    s_len, t_len = (g[:, 4] - g[:, 3]), (g[:, 2] - g[:, 1])
    s_count = np.zeros(n, np.float32)
    t_count = np.zeros(n, np.float32)
    s_count[span], t_count[span] = s_len[span], t_len[span]
    resp_s = host.student.response_lens[start:stop].astype(np.int64)
    resp_t = host.teacher.response_lens[start:stop].astype(np.int64)
    return SimctTerms(**{
        "simct_student_first": padded_rows.padded(first_s, size)[0],
        "simct_teacher_first": padded_rows.padded(first_t, size)[0],
        "simct_weight": padded_rows.padded(np.ones(n), size)[1],
        "simct_is_span": padded_rows.padded(span, size, np.float32)[0],
        "simct_student_count": padded_rows.padded(s_count, size, np.float32)[0],
        "simct_teacher_count": padded_rows.padded(t_count, size, np.float32)[0],
        "simct_student_rows": padded_rows.padded(padded_rows.rebase(s_rows, s_seq, start, student_len), s_size)[0],
        "simct_student_targets": padded_rows.padded(host.student.labels.reshape(-1)[s_rows], s_size)[0],
        "simct_student_group": padded_rows.padded(tg[s_group] if len(s_group) else s_group, s_size)[0],
        "simct_student_token_weight": padded_rows.padded(s_rows, s_size)[1],
        "simct_teacher_span_rows": padded_rows.padded(padded_rows.rebase(t_rows, t_seq, start, teacher_len), t_size)[0],
        "simct_teacher_targets": padded_rows.padded(host.teacher.labels.reshape(-1)[t_rows], t_size)[0],
        "simct_teacher_group": padded_rows.padded(tg[t_group] if len(t_group) else t_group, t_size)[0],
        "simct_teacher_token_weight": padded_rows.padded(t_rows, t_size)[1],
        "simct_aligned_tokens": np.float32([np.maximum(s_len, t_len).sum()]),
        "simct_sample_tokens": np.float32([np.maximum(resp_s, resp_t).sum()]),
        "simct_samples": np.float32([stop - start]),
    })


def realised_scores(hidden, lm_head, targets, mode: str, chunk_rows: int, implementation: str):
    """Per-token span-score terms: the raw logit of the realised id, or its full-vocabulary
    log-probability (τ = 1)."""
    if mode == "raw_logit":
        cols = jnp.take(lm_head, targets.astype(jnp.int32), axis=1)  # [H, N]
        return jnp.einsum("nh,hn->n", hidden.astype(jnp.float32), cols.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    lp, _ = token_rows(hidden, lm_head, targets, chunk_rows=chunk_rows, implementation=implementation)
    return lp


def segment_mean(values, group, weight, count, num: int):
    total = jax.ops.segment_sum(values * weight, group, num_segments=num)
    return total / jnp.maximum(count, 1.0)


def _row_values(h, w_bar, w_full, extra, log_prob: bool):
    """[c, V∩ + 1] row values of one chunk; also the V∩ log-softmax mass terms when asked."""
    z_bar = jnp.dot(h, w_bar.astype(h.dtype), preferred_element_type=jnp.float32)
    lse = None
    if w_full is not None:
        z = jnp.dot(h, w_full.astype(h.dtype), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(z, axis=-1)
        if log_prob:
            z_bar = z_bar - lse[:, None]
    return jnp.concatenate([z_bar, extra[:, None]], axis=1), z_bar, lse


def simct_rows_sum(settings, hs, lm_head, s_extra, ht, t_lm_head, t_extra, s_ids, t_ids, weight,
                   t_span_mean=None):
    """(Σ_r keep_r·w_r·D_r, kept rows) over SimCT rows: first-position hidden rows of both sides
    [R, H], the extra-column values [R] and the weights [R]. Teacher inputs are constants."""
    s = settings
    log_prob = s.span_score_mode == "mean_logprob"
    ht, t_extra = jax.lax.stop_gradient((ht, t_extra))
    ws_bar = jnp.take(lm_head, s_ids, axis=1)
    wt_bar = jax.lax.stop_gradient(jnp.take(t_lm_head, t_ids, axis=1))
    t_lm_head = jax.lax.stop_gradient(t_lm_head)
    gh = bool(s.simct_gh_mask)
    if t_span_mean is None:
        t_span_mean = jnp.full(weight.shape, -jnp.inf, jnp.float32)
    num = weight.shape[0]
    c = max(1, min(int(s.chunked_loss_size), num))
    pad = (-num) % c
    padf = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    xs = tuple(padf(a).reshape((num + pad) // c, c, *a.shape[1:])
               for a in (hs, s_extra, ht, t_extra, weight.astype(jnp.float32),
                         jax.lax.stop_gradient(t_span_mean)))
    inv_t = 1.0 / float(s.kd_temperature)

    def chunk(ws_bar, lm_head, xs):
        h_s, e_s, h_t, e_t, w, t_mean = xs
        row_s, _, _ = _row_values(h_s, ws_bar, lm_head if log_prob else None, e_s, log_prob)
        row_t, zt_bar, lse_t = _row_values(h_t, wt_bar, t_lm_head if (log_prob or gh) else None,
                                           e_t, log_prob)
        log_ps = jax.nn.log_softmax(row_s * inv_t, axis=-1)
        log_pt = jax.lax.stop_gradient(jax.nn.log_softmax(row_t * inv_t, axis=-1))
        d = losses.divergence_from_logprobs(s.kd_loss_fn, log_ps, log_pt, jsd_beta=s.jsd_beta,
                                            skl_lambda=s.skl_lambda, akl_alpha=s.akl_alpha)
        keep = jnp.ones_like(w)
        if gh:
            shared = zt_bar if log_prob else zt_bar - lse_t[:, None]
            mass = jnp.sum(jnp.exp(shared), axis=-1) + jnp.exp(t_mean)
            keep = (jnp.minimum(mass, 1.0) >= 0.5).astype(jnp.float32)
        kw = jax.lax.stop_gradient(w * keep)
        return jnp.sum(losses.masked_rows(d, kw)), jnp.sum(kw)

    body = jax.checkpoint(chunk)

    def step(carry, x):
        total, kept = body(ws_bar, lm_head, x)
        return (carry[0] + total, carry[1] + kept), None

    (total, kept), _ = jax.lax.scan(step, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), xs)
    return total, kept


@register("simct")
class SimCT(Objective):
    settings_class = SimCTSettings
    stale_responses = "none"   # a divergence per segment row

    def prepare(self, host, start, stop):
        batch = padded_rows.micro_batch(host, start, stop)
        terms = segment_arrays(host, start, stop, batch.student_ids.shape[1], batch.teacher_ids.shape[1])
        # the teacher hands back the first rows of the segments, then the span-token rows
        return dataclasses.replace(batch, terms=terms, teacher_rows=np.concatenate(
            [terms.simct_teacher_first, terms.simct_teacher_span_rows]))

    def kd_weights(self):
        return {"simct": 1.0}

    def kd_sums(self, x):
        s, b = self.settings, x.batch.terms
        num = b.simct_weight.shape[0]
        mode = s.span_score_mode
        is_span = b.simct_is_span
        hs = jnp.take(x.hidden, b.simct_student_first, axis=0)
        ht, ht_span = x.teacher_hidden[:num], x.teacher_hidden[num:]
        s_tok = jnp.take(x.hidden, b.simct_student_rows, axis=0)
        s_terms = realised_scores(s_tok, x.lm_head, b.simct_student_targets, mode,
                                  s.chunked_loss_size, s.implementation)
        t_terms = jax.lax.stop_gradient(realised_scores(ht_span, x.teacher_lm_head, b.simct_teacher_targets,
                                                        mode, s.chunked_loss_size, s.implementation))
        s_score = segment_mean(s_terms, b.simct_student_group, b.simct_student_token_weight,
                               b.simct_student_count, num)
        t_score = segment_mean(t_terms, b.simct_teacher_group, b.simct_teacher_token_weight,
                               b.simct_teacher_count, num)
        span = is_span > 0
        s_extra = jnp.where(span, s_score, NO_SPAN)
        t_extra = jnp.where(span, t_score, NO_SPAN)
        t_span_mean = None
        if s.simct_gh_mask:
            if mode == "mean_logprob":
                t_mean = t_score
            else:
                t_lp, _ = token_rows(ht_span, jax.lax.stop_gradient(x.teacher_lm_head), b.simct_teacher_targets,
                                     chunk_rows=s.chunked_loss_size, implementation=s.implementation)
                t_mean = segment_mean(t_lp, b.simct_teacher_group, b.simct_teacher_token_weight,
                                      b.simct_teacher_count, num)
            t_span_mean = jnp.where(span, t_mean, -jnp.inf)
        total, kept = simct_rows_sum(s, hs, x.lm_head, s_extra, ht, x.teacher_lm_head, t_extra,
                                     x.overlap["s_ids"], x.overlap["t_ids"], b.simct_weight, t_span_mean)
        rows = jnp.sum(b.simct_weight)
        metrics = {
            "align_ratio": (jnp.sum(b.simct_aligned_tokens), jnp.sum(b.simct_sample_tokens)),
            "simct_segments_per_sample": (rows, jnp.sum(b.simct_samples)),
            "simct_span_row_fraction": (jnp.sum(is_span * b.simct_weight), rows),
            "simct_kept_row_fraction": (kept, rows),
        }
        return {"simct": total}, metrics
