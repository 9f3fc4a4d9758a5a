"""The two objectives a served teacher's top-k can feed (a server returns top-k, never full rows).

Each is split where the data lives: the host part (numpy) turns the server's per-position top-k
into fixed-width index / log-prob / validity arrays; the device part (jax.numpy, differentiable
in the student's values) renormalises and takes the divergence per row. Rows are aligned pairs
(cross-tokenizer) or response positions (same tokenizer), in the caller's order.

1. Teacher-top-k strict (cross-tokenizer; `topk_strict_columns` + `topk_strict_rows`).
   At an aligned pair (t, s) the columns are the pairs i of the overlap map (SPEC §3) whose
   teacher id t_ids[i] is among the teacher's top-k at t: the V∩ projection restricted to the
   teacher's top-k. Both sides are renormalised over those columns:
       p̄_T = softmax(log p_T[t_ids[i]] / τ),   p̄_S = softmax(z_S[s, s_ids[i]] / τ),
       loss D(p̄_S, p̄_T).
   Exact at any τ: log p_T differs from the teacher logit by one constant per row, which the
   renormalisation removes, so the served τ = 1 log-probs suffice. With k >= |V_T| it is Strict
   full (SPEC §4) on V∩. A row whose top-k holds no shared token has no column: it adds 0 and
   stays in the denominator (like an unaligned position), counted by `row_valid`.
   Unlike Strict top-k (SPEC §4, the STUDENT picks the k columns), the teacher picks them here,
   because only the teacher's top-k crosses the wire.

2. Top-k GKD (same tokenizer, a served teacher; `topk_gkd_support` +
   `topk_gkd_rows`). The support at a response position is the teacher's top-k, plus the
   sampled token when `include_sampled` (its teacher log-prob is served too). Student and
   teacher full-vocabulary log-probs are taken on the support and either
   - `tail=True` (the default): one more bucket holds each side's remaining mass,
     log(1 − Σ_support p), so both are proper distributions over |support| + 1 outcomes; the
     support's mass is capped at 1 − 1e-6 first, so float rounding in served values (a top-k
     summing to 1.0000001) cannot make a bucket log(≤ 0); or
   - `tail=False`: both renormalised over the support.
   The divergence is GKD's generalised JSD with β weighting the teacher (SPEC §9):
   β = 0 forward KL(p_T‖p_S), β = 1 reverse KL(p_S‖p_T), else
   β KL(p_T‖M) + (1 − β) KL(p_S‖M) with M = β p_T + (1 − β) p_S.
   The objective's default is include_sampled = (β > 0): forward KL (β = 0) reads the
   teacher's top-k alone; with β > 0 the student's own sampled token joins the support.
   The tail needs full-vocabulary probabilities at the loss temperature, which a τ = 1 server
   gives only at τ = 1: `tail=True` with τ != 1 is refused; without the tail τ is exact as in 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.kernels import losses

# The most probability the support may hold before the tail bucket is formed (see docstring).
TAIL_MASS_CAP = 1.0 - 1e-6


# ---------------------------------------------------------------- teacher-top-k strict (host)

@dataclasses.dataclass(frozen=True, eq=False)
class TopkStrictColumns:
    student_ids: np.ndarray       # int32 [R, C]: student column of each kept pair (0 if invalid)
    teacher_logprobs: np.ndarray  # float32 [R, C]: served full-vocab log p_T there (-inf invalid)
    valid: np.ndarray             # bool [R, C]
    teacher_mass: np.ndarray      # float32 [R]: Σ p_T over the kept teacher tokens (coverage)

    @property
    def row_valid(self) -> np.ndarray:
        return self.valid.any(axis=1)


def overlap_pairs_by_teacher_id(s_ids, t_ids, teacher_vocab_size: int) -> np.ndarray:
    """int32 [V_T, m]: the overlap pair indices i of each teacher id (t_ids[i] == id), -1 padded.

    m is the most pairs one teacher id has (1, or 2 where the appended EOS pair shares a teacher
    id with a string pair). Built once per tokenizer pair."""
    s_ids, t_ids = np.asarray(s_ids), np.asarray(t_ids)
    if s_ids.shape != t_ids.shape or s_ids.ndim != 1:
        raise ValueError("s_ids and t_ids must be equally long 1-D arrays (the overlap map)")
    if t_ids.size and (t_ids.min() < 0 or t_ids.max() >= teacher_vocab_size):
        raise ValueError(f"t_ids must lie in [0, {teacher_vocab_size})")
    counts = np.bincount(t_ids, minlength=teacher_vocab_size)
    width = max(int(counts.max()) if counts.size else 0, 1)
    table = np.full((teacher_vocab_size, width), -1, np.int32)
    fill = np.zeros(teacher_vocab_size, np.int64)
    for i, t in enumerate(t_ids):
        table[t, fill[t]] = i
        fill[t] += 1
    return table


def topk_strict_columns(topk_ids, topk_logprobs, s_ids, pairs_by_teacher_id) -> TopkStrictColumns:
    """The kept columns of each row from the teacher's top-k (ids [R, k], log-probs [R, k])."""
    topk_ids = np.asarray(topk_ids, np.int64)
    topk_logprobs = np.asarray(topk_logprobs, np.float32)
    if topk_ids.shape != topk_logprobs.shape or topk_ids.ndim != 2:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_logprobs {topk_logprobs.shape} must "
                         f"both be [rows, k]")
    vocab = pairs_by_teacher_id.shape[0]
    if topk_ids.size and (topk_ids.min() < 0):
        raise ValueError("negative teacher id in the top-k")
    # Ids at or beyond the table (a model's padding rows past the tokenizer) are in no pair.
    inside = topk_ids < vocab
    pairs = np.where(inside[..., None], pairs_by_teacher_id[np.where(inside, topk_ids, 0)], -1)
    rows = topk_ids.shape[0]
    pairs = pairs.reshape(rows, -1)                                    # [R, k*m]
    valid = pairs >= 0
    student_ids = np.where(valid, np.asarray(s_ids)[np.maximum(pairs, 0)], 0).astype(np.int32)
    m = pairs_by_teacher_id.shape[1]
    logprobs = np.repeat(topk_logprobs, m, axis=1)
    valid &= np.isfinite(logprobs)  # a -inf teacher entry has no mass to keep
    teacher_logprobs = np.where(valid, logprobs, -np.inf).astype(np.float32)
    # each kept teacher token once, though the EOS id may head two pairs (two columns)
    kept = valid.reshape(rows, -1, m).any(axis=2)                        # [R, k]
    mass = np.where(kept, np.exp(topk_logprobs), 0.0).sum(axis=1).astype(np.float32)
    return TopkStrictColumns(student_ids, teacher_logprobs, valid, mass)


# -------------------------------------------------------------- teacher-top-k strict (device)

def topk_strict_rows(student_logits, teacher_logprobs, valid, *, kd_loss_fn: str = "rkl",
                     temperature: float = 1.0, **divergence_args):
    """Per-row D(p̄_S, p̄_T) over the kept columns (float32 [R]); 0 on rows with no column.

    `student_logits` [R, C] are the student's logits at `student_ids` (take_columns); the
    teacher side is a constant."""
    losses.check_divergence_args(kd_loss_fn, temperature=temperature, **divergence_args)
    log_ps = _renormalised(student_logits.astype(jnp.float32) / temperature, valid)
    log_pt = jax.lax.stop_gradient(
        _renormalised(jnp.asarray(teacher_logprobs, jnp.float32) / temperature, valid))
    per_row = losses.divergence_from_logprobs(kd_loss_fn, log_ps, log_pt, **divergence_args)
    return losses.masked_rows(per_row, jnp.any(valid, axis=-1))


def take_columns(logits, ids):
    """logits [R, V] at ids [R, C] → [R, C] (a gather; differentiable in the logits)."""
    return jnp.take_along_axis(logits, jnp.asarray(ids, jnp.int32), axis=-1)


def head_columns(hidden, lm_head, ids):
    """The logits hidden [R, H] @ lm_head [H, V] at ids [R, C] → float32 [R, C], without the
    [R, V] logits: each row meets only its C lm_head columns (R·C·H multiply-adds instead of
    R·V·H; the gathered columns are [R, C, H]). Differentiable in hidden and lm_head."""
    columns = jnp.take(lm_head.T, jnp.asarray(ids, jnp.int32), axis=0)          # [R, C, H]
    return jnp.einsum("rh,rch->rc", hidden, columns.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def vocabulary_logsumexps(hidden, lm_head, ids, valid, temperature: float = 1.0, chunk_rows: int = 2048):
    """(logsumexp over the whole vocabulary, over the vocabulary outside each row's support)
    of hidden [R, H] @ lm_head [H, V] / τ, float32 [R] each, in one pass over chunks of
    `chunk_rows` rows (each chunk's [c, V] logits rematerialised in the backward). The second
    is the student's tail bucket, exact where log(1 − Σ_support p) cancels (rounding over
    1 − mass when the support holds most of the mass)."""
    rows = hidden.shape[0]
    c = max(1, min(int(chunk_rows), rows))
    pad = -rows % c
    chunks = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((-1, c) + x.shape[1:])

    @jax.checkpoint
    def chunk(args):
        h, i, v = args
        z = jnp.dot(h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32) / temperature
        hit = jnp.zeros(z.shape, jnp.int8).at[jnp.arange(c)[:, None], i].max(v.astype(jnp.int8)) > 0
        return jax.nn.logsumexp(z, axis=-1), jax.nn.logsumexp(jnp.where(hit, -jnp.inf, z), axis=-1)

    whole, outside = jax.lax.map(chunk, (chunks(hidden), chunks(jnp.asarray(ids, jnp.int32)),
                                         chunks(jnp.asarray(valid))))
    return whole.reshape(-1)[:rows], outside.reshape(-1)[:rows]


def _renormalised(scores, valid):
    """log-softmax over the valid entries of each row, -inf elsewhere; all -inf on an empty row
    (its value is masked by the caller, and no NaN reaches the gradient)."""
    valid = jnp.asarray(valid)
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    safe = jnp.where(valid, scores, -jnp.inf)
    safe = jnp.where(any_valid, safe, 0.0)  # an empty row normalises zeros instead of -infs
    out = jax.nn.log_softmax(safe, axis=-1)
    return jnp.where(valid, out, -jnp.inf)


# ------------------------------------------------------------------------- top-k GKD (host)

@dataclasses.dataclass(frozen=True, eq=False)
class TopkGkdSupport:
    ids: np.ndarray               # int32 [R, k+1]: top-k ids, then the sampled id (0 if unused)
    teacher_logprobs: np.ndarray  # float32 [R, k+1]: served full-vocab log p_T (-inf invalid)
    valid: np.ndarray             # bool [R, k+1]


def topk_gkd_support(topk_ids, topk_logprobs, sampled_ids, sampled_logprobs,
                     include_sampled: bool) -> TopkGkdSupport:
    """The support per response position: the teacher's top-k, plus the sampled token when
    `include_sampled` and it is not already in the top-k."""
    topk_ids = np.asarray(topk_ids, np.int64)
    topk_logprobs = np.asarray(topk_logprobs, np.float32)
    sampled_ids = np.asarray(sampled_ids, np.int64)
    sampled_logprobs = np.asarray(sampled_logprobs, np.float32)
    if topk_ids.shape != topk_logprobs.shape or topk_ids.ndim != 2:
        raise ValueError("topk_ids and topk_logprobs must both be [rows, k]")
    if sampled_ids.shape != (topk_ids.shape[0],) or sampled_logprobs.shape != sampled_ids.shape:
        raise ValueError("sampled_ids and sampled_logprobs must be [rows]")
    extra = include_sampled & ~(topk_ids == sampled_ids[:, None]).any(axis=1)
    ids = np.concatenate([topk_ids, np.where(extra, sampled_ids, 0)[:, None]], axis=1)
    logprobs = np.concatenate([topk_logprobs, sampled_logprobs[:, None]], axis=1)
    valid = np.concatenate([np.ones_like(topk_ids, bool), extra[:, None]], axis=1)
    valid &= np.isfinite(logprobs)
    return TopkGkdSupport(ids.astype(np.int32), np.where(valid, logprobs, -np.inf)
                          .astype(np.float32), valid)


# ----------------------------------------------------------------------- top-k GKD (device)

def topk_gkd_rows(student_logprobs, teacher_logprobs, valid, *, beta: float, tail: bool = True,
                  temperature: float = 1.0, student_tail=None):
    """Per-row generalised JSD_β on the support (+ tail bucket), float32 [R].

    `student_logprobs` [R, C]: the student's FULL-vocabulary log-softmax(z / τ) at the support
    ids (`gather_logprobs`); `teacher_logprobs` the served τ = 1 values; `student_tail` [R]: the
    student's log-mass outside the support (vocabulary_logsumexps), else log(1 − Σ p)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    if tail and temperature != 1.0:
        raise ValueError(f"temperature={temperature}: the tail bucket needs the teacher's full-"
                         f"vocabulary probabilities at that temperature, which a server gives "
                         f"only at 1; use tail=False or temperature 1")
    valid = jnp.asarray(valid)
    log_ps = jnp.where(valid, student_logprobs.astype(jnp.float32), -jnp.inf)
    log_pt = jnp.where(valid, jnp.asarray(teacher_logprobs, jnp.float32) / temperature, -jnp.inf)
    if tail:
        log_ps, log_pt = _with_tail(log_ps, student_tail), _with_tail(log_pt)
    else:
        log_ps, log_pt = _renormalised(log_ps, valid), _renormalised(log_pt, valid)
    log_pt = jax.lax.stop_gradient(log_pt)
    if beta == 0.0:
        per_row = losses.divergence_from_logprobs("kl", log_ps, log_pt)
    elif beta == 1.0:
        per_row = losses.divergence_from_logprobs("rkl", log_ps, log_pt)
    else:  # losses' jsd weights the student: kdflow_jsd(b) = gkd_jsd(β = 1 − b), SPEC §9
        per_row = losses.divergence_from_logprobs("jsd", log_ps, log_pt, jsd_beta=1.0 - beta)
    return losses.masked_rows(per_row, jnp.any(valid, axis=-1))


def gather_logprobs(logits, ids, temperature: float = 1.0):
    """Full-vocabulary log-softmax(logits / τ) [R, V] taken at ids [R, C]."""
    return take_columns(losses.log_softmax_f32(logits, temperature), ids)


def _with_tail(log_p, tail=None):
    """Append the log-mass outside the support as one more column: `tail` [R] where given (the
    student's, vocabulary_logsumexps), else log(1 − Σ p) (the served teacher's, which has only
    its top-k); never above 1 − TAIL_MASS_CAP of the mass in the support's favour."""
    if tail is None:
        mass = jnp.sum(jnp.exp(log_p), axis=-1, keepdims=True)
        tail = jnp.log1p(-jnp.minimum(mass, TAIL_MASS_CAP))
    else:
        tail = jnp.maximum(tail[:, None], np.log1p(-TAIL_MASS_CAP))
    return jnp.concatenate([log_p, tail], axis=-1)
