"""MP-OPD (SPEC §8): partitioned sampled credits over atoms. `algorithm.name: mp_opd`.

Atoms come from align.atoms (decode-prefix offsets, fail-closed samples counted by reason). Per
atom i: lT_i = Σ teacher log-probs of its teacher tokens, lS_i = stop_grad(Σ current student
log-probs of its student tokens), b_i = lT_i − lS_i, w_i = its student tokens, r_i = b_i / w_i,
h_i = −Σ student log-probs (with gradient). Every mode gives per-atom rates ρ_i and the loss

    L = Σ_i stop_grad(ρ_i) · h_i        (the trainer divides by the student response tokens)

A partition P into consecutive spans gives ρ_i = B_c / W_c for i ∈ c (so Σ_i w_i ρ_i = Σ_i b_i):
`atomic`, `fixed1..5`, `random1-2`, `random2-5` (seeded per sample, see `random_spans`).
`grass_chunk` shrinks each chunk's rates towards its w-weighted mean by α_c from the exact
LM-head Gram matrix H and a running noise estimate; `align` rotates rates against H (SPEC §8).

Design (where each quantity lives):
- host, in `prepare`: atoms, partitions and chunks (they depend on w only), the seeded random
  partitions, the fail-closed counts;
- device, in the gradient pass: the atoms' token log-probs (the trainer's full-vocabulary
  response log-probs for the student, kernels.token_rows for the teacher) and, for grass/align,
  H per chunk in float32 (`lm_head_gram`: chunks of atoms padded to K tokens, [blocks, K, V]
  logits at a time, Precision.HIGHEST so no TF32, symmetrised, no gradient);
- GRASS, on device in the same pass (`grass_rates`, float32): per sample the noise statistic
  s² = (1.4826·MAD(z))² (lower medians by sorting), then the SPEC's SEQUENTIAL EMA over the
  micro-batch's valid samples in sample order, each sample's α using the EMA after its own
  update. The EMA before the micro-batch comes in as an input array (`grass_noise_in`, written
  by `prepare` from the host state); the per-sample (s², updated) of every batch shard are
  gathered (base.shard_gather, shard s = block s of the micro-batch) so every shard runs the
  same scan over the whole micro-batch: the result does not depend on how the micro-batch is
  sharded. The same global (s², updated) sequence comes back as a private metric (contributed
  by shard 0 only, so the sum over shards is the sequence itself), and `after_micro_batch`
  (called on the host by device.micro_grad after each micro-batch, in order) applies it to the
  float64 host EMA, the objective's run state (`state_dict` / `load_state_dict`, so a resume is
  bit-exact). No host callback, no mutable state inside the jitted loss. The α / D / V algebra
  runs in float32 (SPEC says float64; H itself is float32): the conservation check is evaluated
  chunk by chunk (Σ_c (Σ_{i∈c} w_i r̃_i − B_c)), which is the same error in exact arithmetic
  but stays at float32 rounding of the chunk terms, far below the 1e-6 threshold.
- ALIGN, host, INSIDE the same step: `jax.experimental.io_callback` hands (b, w, H, the chunk
  layout) to `credits_on_host` (float32 as SPEC says); it is stateless, so each batch shard may
  call it for its own samples in any order. The rates come back as a constant of the loss.
- fail-closed samples have no atoms: zero loss, tokens in the denominator; a GRASS/ALIGN failure
  (non-finite values; for GRASS a conservation error above 1e-6·max(Σ|w·r|, 1)) falls back to
  atomic credits for that sample, counted.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ctopd_jax.algorithms import pack
from ctopd_jax.algorithms.base import BASE_ROWS, Needs, Objective, register, shard_gather
from ctopd_jax.align.atoms import FAIL_REASONS, mpopd_atoms
from ctopd_jax.config import AlgorithmSection, require
from ctopd_jax.kernels.token_rows import token_rows

MODES = ("atomic", "fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2", "random2-5",
         "grass_chunk", "align")
RHO = 0.99             # noise EMA decay
MIN_NOISE_PAIRS = 8    # adjacent in-chunk pairs a sample needs to update the noise estimate
MAD_SCALE = 1.4826


@dataclass(frozen=True)
class MpOpdSettings(AlgorithmSection):
    # how atoms are grouped into credit spans (SPEC §8)
    mp_opd_mode: Literal["atomic", "fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2",
                         "random2-5", "grass_chunk", "align"] = "atomic"
    mp_opd_random_seed: int = 43    # seed of the random{min}-{max} partitions
    grass_chunk_atoms: int = 2      # atoms per grass_chunk/align chunk (the fork's fallback)
    # ours, off as upstream: the EOS as one more atom (align.mpopd_atoms; docs/recipes.md)
    mp_opd_eos_atom: bool = False

    def validate(self) -> None:
        super().validate()
        require(self.grass_chunk_atoms >= 1, "algorithm.grass_chunk_atoms",
                 f"{self.grass_chunk_atoms} must be >= 1 (atoms per GRASS/ALIGN chunk)")


# -- partitions (host, float64) -------------------------------------------------------------------
def seed_text(seed: int, row: int, w) -> str:
    return f"{seed}:{row}:{[float(x) for x in w]}"


def random_spans(w, row: int, seed: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """SPEC §8's seeded partition: rng = random.Random(first 8 bytes of sha256(seed text),
    big-endian); per span hi' = min(hi, remaining), lo' = min(lo, hi'), length randint(lo', hi')."""
    digest = hashlib.sha256(seed_text(seed, row, w).encode("utf-8")).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    spans, i, n = [], 0, len(w)
    while i < n:
        top = min(hi, n - i)
        length = rng.randint(min(lo, top), top)
        spans.append((i, i + length))
        i += length
    return spans


def fixed_spans(n: int, k: int) -> list[tuple[int, int]]:
    return [(i, min(i + k, n)) for i in range(0, n, k)]


def sample_spans(mode: str, w, row: int, seed: int, chunk_atoms: int) -> list[tuple[int, int]]:
    """Consecutive spans (partition for partition modes, chunks for grass/align) of one sample."""
    n = len(w)
    if mode == "atomic":
        return fixed_spans(n, 1)
    if mode.startswith("fixed"):
        return fixed_spans(n, int(mode[5:]))
    if mode.startswith("random"):
        lo, hi = (int(v) for v in mode[6:].split("-"))
        return random_spans(w, row, seed, lo, hi)
    return fixed_spans(n, chunk_atoms)


def partition_rates(b, w, spans) -> np.ndarray:
    """ρ_i = B_c / W_c for i in span c (float64)."""
    b, w = np.asarray(b, np.float64), np.asarray(w, np.float64)
    out = np.empty_like(b)
    for s, e in spans:
        out[s:e] = b[s:e].sum() / w[s:e].sum()
    return out


def lower_median(x) -> float:
    x = np.sort(np.asarray(x, np.float64))
    return float(x[(len(x) - 1) // 2])


class GrassNoise:
    """σ² estimate: EMA of (1.4826·MAD(z))² over samples, bias-corrected (SPEC §8)."""

    def __init__(self, ema: float = 0.0, updates: int = 0):
        self.ema, self.updates = float(ema), int(updates)

    def observe(self, z) -> None:
        if len(z) < MIN_NOISE_PAIRS:
            return
        med = lower_median(z)
        self.add((MAD_SCALE * lower_median(np.abs(np.asarray(z, np.float64) - med))) ** 2)

    def add(self, s2: float) -> None:
        """One sample's statistic s² (no update unless s² > 0)."""
        if s2 > 0:
            self.ema = RHO * self.ema + (1.0 - RHO) * float(s2)
            self.updates += 1

    @property
    def sigma2(self) -> float:
        return self.ema / (1.0 - RHO ** self.updates) if self.updates else 0.0


def grass_alpha(r, w, h, sigma2: float) -> float:
    """α_c of one chunk (float64)."""
    r, w, h = (np.asarray(a, np.float64) for a in (r, w, h))
    if len(r) == 1:
        return 0.0
    big_w = w.sum()
    mean = (w * r).sum() / big_w
    d = r - mean
    dd = float(d @ h @ d)
    vv = sigma2 * (float((np.diag(h) / w).sum()) - float(h.sum()) / big_w)
    if dd > 0:
        return float(np.clip(vv / dd, 0.0, 1.0))
    return 1.0 if vv > 0 else 0.0


def shrink(r, w, alpha: float) -> np.ndarray:
    r, w = np.asarray(r, np.float64), np.asarray(w, np.float64)
    mean = (w * r).sum() / w.sum()
    return r - alpha * (r - mean)


def grass_sample(b, w, chunks, grams, noise: GrassNoise):
    """(rates float64, alphas of multi-atom chunks, fell back) of one valid sample."""
    b, w = np.asarray(b, np.float64), np.asarray(w, np.float64)
    r = b / w
    z = [(r[i + 1] - r[i]) / math.sqrt(1.0 / w[i] + 1.0 / w[i + 1])
         for s, e in chunks for i in range(s, e - 1)]
    noise.observe(z)
    sigma2 = noise.sigma2
    out, alphas = np.empty_like(r), []
    for (s, e), h in zip(chunks, grams):
        a = grass_alpha(r[s:e], w[s:e], h[:e - s, :e - s], sigma2)
        if e - s > 1:
            alphas.append(a)
        out[s:e] = shrink(r[s:e], w[s:e], a)
    error = abs(float((w * out).sum()) - float(b.sum()))
    if not np.all(np.isfinite(out)) or error > 1e-6 * max(float(np.abs(w * r).sum()), 1.0):
        return r, alphas, True
    return out, alphas, False


def align_chunk(r, h) -> np.ndarray:
    """ALIGN's rates of one chunk (float32): A = diag(r); for each i and each j ≠ i in cyclic
    order after i, skip r_j = 0 or H_jj ≤ 1e-12; if r_j·(AH)_ij < 0, A_ij −= (AH)_ij / H_jj; the
    rates are A's column sums."""
    r, h = np.asarray(r, np.float32), np.asarray(h, np.float32)
    n = len(r)
    a = np.diag(r).astype(np.float32)
    for i in range(n):
        for step in range(1, n):
            j = (i + step) % n
            if r[j] == 0 or h[j, j] <= np.float32(1e-12):
                continue
            ah = np.float32(a[i] @ h[:, j])
            if r[j] * ah < 0:
                a[i, j] = np.float32(a[i, j] - ah / h[j, j])
    return a.sum(axis=0, dtype=np.float32)


def align_sample(b, w, chunks, grams):
    r = (np.asarray(b, np.float32) / np.asarray(w, np.float32)).astype(np.float32)
    out = np.empty_like(r)
    for (s, e), h in zip(chunks, grams):
        out[s:e] = align_chunk(r[s:e], h[:e - s, :e - s])
    if not np.all(np.isfinite(out)):
        return r.astype(np.float64), True
    return out.astype(np.float64), False


# -- host arrays ------------------------------------------------------------------------------------
def host_atoms(host, eos_atom: bool = False):
    """MP-OPD atoms of the whole collected batch (computed once per batch)."""
    return host.once(f"mp_opd_atoms_eos{int(eos_atom)}",
                     lambda h: mpopd_atoms(h.teacher, h.student, eos_atom=eos_atom))


def atom_arrays(settings, host, start: int, stop: int, student_len: int, teacher_len: int,
                response_rows: np.ndarray, response_weight: np.ndarray, min_rows: int = 64) -> dict:
    s = settings
    atoms = host_atoms(host, s.mp_opd_eos_atom)
    sel = (atoms.atoms[:, 0] >= start) & (atoms.atoms[:, 0] < stop)
    a = atoms.atoms[sel].astype(np.int64)
    n = len(a)
    w = (a[:, 4] - a[:, 3]).astype(np.int64)
    # spans per sample (partition or chunks), as a span id per atom and a position in it
    span_id = np.zeros(n, np.int64)
    span_pos = np.zeros(n, np.int64)
    span_sample, span_len = [], []
    first = 0
    samples = a[:, 0]
    for b in np.unique(samples):
        idx = np.flatnonzero(samples == b)
        for lo, hi in sample_spans(s.mp_opd_mode, w[idx].tolist(), int(b - start), s.mp_opd_random_seed,
                                   s.grass_chunk_atoms):
            span_id[idx[lo:hi]] = first
            span_pos[idx[lo:hi]] = np.arange(hi - lo)
            span_sample.append(b - start)
            span_len.append(hi - lo)
            first += 1
    size = pack.rows_bucket(n, min_rows)
    spans = pack.rows_bucket(first, min_rows)
    s_rows, s_atom = pack.expand_ranges(a[:, 3], w)
    s_rows = pack.rebase(s_rows, host.student.seq_len, start, student_len)
    real = response_rows[:int(response_weight.sum())]
    s_index = np.searchsorted(real, s_rows)
    t_count = a[:, 2] - a[:, 1]
    t_rows, t_atom = pack.expand_ranges(a[:, 1], t_count)
    t_targets = host.teacher.labels.reshape(-1)[t_rows]
    s_size, t_size = pack.rows_bucket(len(s_index), min_rows), pack.rows_bucket(len(t_rows), min_rows)
    counts = atoms.fail_counts(start, stop)
    out = {
        "atom_weight": pack.padded(np.ones(n), size)[1],
        "atom_w": pack.padded(w, size, np.float32)[0],
        "atom_span": pack.padded(span_id, size)[0],
        "atom_pos": pack.padded(span_pos, size)[0],
        "atom_sample": pack.padded(a[:, 0] - start, size)[0],
        "span_sample": pack.padded(np.asarray(span_sample, np.int64), spans)[0],
        "span_weight": pack.padded(np.ones(first), spans)[1],
        "atom_student_index": pack.padded(s_index, s_size)[0],
        "atom_student_atom": pack.padded(s_atom, s_size)[0],
        "atom_student_weight": pack.padded(s_index, s_size)[1],
        "atom_teacher_rows": pack.padded(pack.rebase(t_rows, host.teacher.seq_len, start, teacher_len), t_size)[0],
        "atom_teacher_targets": pack.padded(t_targets, t_size)[0],
        "atom_teacher_atom": pack.padded(t_atom, t_size)[0],
        "atom_teacher_weight": pack.padded(t_rows, t_size)[1],
        # counts are [1] arrays, not 0-d: per-shard parts are stacked along a leading axis
        # (the step's stack_shards) and summed on the device
        "mp_opd_samples": np.float32([stop - start]),
        "mp_opd_valid_samples": np.float32([atoms.sample_valid[start:stop].sum()]),
    }
    if host.served_teacher_rows is not None:   # a served teacher: the atoms' log π_T already scored
        out["atom_teacher_token_logprobs"] = pack.served_token_logprobs(host, t_rows, t_size)
    for k, name in enumerate(FAIL_REASONS):
        out[f"mp_opd_fail_{name}"] = np.float32([counts[name]])
    if s.mp_opd_mode in ("grass_chunk", "align"):
        # chunk token layout for the Gram pass: [chunks, K] student rows, target, atom position
        tok_span = span_id[s_atom]
        per_span = np.bincount(tok_span, minlength=first) if n else np.zeros(0, np.int64)
        k = pack.rows_bucket(int(per_span.max(initial=1)), 1)
        order = np.argsort(tok_span, kind="stable")
        slot = np.arange(len(tok_span)) - np.repeat(np.cumsum(per_span) - per_span, per_span)
        rows = np.zeros((spans, k), np.int32)
        targets = np.zeros((spans, k), np.int32)
        pos = np.zeros((spans, k), np.int32)
        valid = np.zeros((spans, k), np.float32)
        sp, sl = tok_span[order], slot
        rows[sp, sl] = real[s_index[order]] if len(order) else 0
        targets[sp, sl] = host.student.labels.reshape(-1)[pack.expand_ranges(a[:, 3], w)[0][order]] if len(order) else 0
        pos[sp, sl] = span_pos[s_atom[order]]
        valid[sp, sl] = 1.0
        out.update({"gram_rows": rows, "gram_targets": targets, "gram_pos": pos, "gram_valid": valid})
    return out


# -- device -----------------------------------------------------------------------------------------
NOISE_KEY = "_mp_opd_grass_noise"   # private metric: the micro-batch's (s², updated) per sample


def segment_lower_median(values, valid, segment, num_segments: int):
    """(lower median of the valid `values` of each segment, their count); sorted by
    (segment, value), so segment k's values sit at [start_k, start_k + count_k)."""
    key = jnp.where(valid, segment, num_segments).astype(jnp.int32)
    _, ordered = jax.lax.sort((key, jnp.where(valid, values, 0.0)), num_keys=2)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), segment, num_segments=num_segments)
    start = jnp.cumsum(count) - count
    at = jnp.clip(start + (count - 1) // 2, 0, values.shape[0] - 1)
    return ordered[at], count


def grass_rates(b, w, live, span, pos, sample, span_sample, span_weight, grams, num_samples: int, noise_in):
    """GRASS on one batch shard (SPEC §8): (rates, per-sample arrays, per-chunk arrays, the
    micro-batch's (s², updated) sequence, this shard's index). `noise_in` = [ema, t] before the
    micro-batch; `num_samples` the shard's sample slots (atom_sample indexes them)."""

    num, spans, g = b.shape[0], span_weight.shape[0], grams.shape[1]
    seg = lambda x, ids, n: jax.ops.segment_sum(x, ids, num_segments=n)  # noqa: E731
    on = live > 0
    r = b / w
    # noise: adjacent in-chunk pairs (atom i and its predecessor), z, s² per sample
    prev = lambda x: jnp.concatenate([x[:1], x[:-1]])  # noqa: E731
    pair = on & prev(on) & (span == prev(span)) & (pos == prev(pos) + 1) & (jnp.arange(num) > 0)
    z = (r - prev(r)) / jnp.sqrt(1.0 / prev(w) + 1.0 / w)
    med, count = segment_lower_median(z, pair, sample, num_samples)
    mad, _ = segment_lower_median(jnp.abs(z - med[sample]), pair, sample, num_samples)
    s2 = (MAD_SCALE * mad) ** 2
    updated = (count >= MIN_NOISE_PAIRS) & (s2 > 0)
    # the sequential EMA over the whole micro-batch in sample order (block s = shard s)
    # one gather for both (fewer collectives in the step)
    both, index = shard_gather(jnp.stack([jnp.where(updated, s2, 0.0), updated.astype(jnp.float32)]))
    all_s2, all_updated = both[:, 0].reshape(-1), both[:, 1].reshape(-1) > 0

    def step(carry, x):
        ema, t = carry
        u, v = x
        ema = jnp.where(u, RHO * ema + (1.0 - RHO) * v, ema)
        t = t + u.astype(jnp.float32)
        return (ema, t), (ema, t)

    _, (ema_seq, t_seq) = jax.lax.scan(step, (noise_in[0], noise_in[1]), (all_updated, all_s2))
    ema = jax.lax.dynamic_slice(ema_seq, (index * num_samples,), (num_samples,))
    t = jax.lax.dynamic_slice(t_seq, (index * num_samples,), (num_samples,))
    sigma2 = jnp.where(t > 0, ema / (1.0 - jnp.power(jnp.float32(RHO), t)), 0.0)
    # α per chunk from D_c = dᵀHd and V_c, with chunk matrices [C, g] indexed by atom position
    n_c = seg(live, span, spans)
    big_w = seg(w * live, span, spans)
    big_b = seg(b * live, span, spans)
    safe_w = jnp.where(big_w > 0, big_w, 1.0)
    mean = big_b / safe_w
    d = (r - mean[span]) * live
    dm = jnp.zeros((spans, g), jnp.float32).at[span, pos].add(d)
    wm = jnp.ones((spans, g), jnp.float32).at[span, pos].add((w - 1.0) * live)
    hi = jax.lax.Precision.HIGHEST
    dd = jnp.einsum("ci,ci->c", jnp.einsum("ci,cij->cj", dm, grams, precision=hi), dm, precision=hi)
    diag = jnp.diagonal(grams, axis1=1, axis2=2)
    vv = sigma2[span_sample] * (jnp.sum(diag / wm, axis=1) - jnp.sum(grams, axis=(1, 2)) / safe_w)
    alpha = jnp.where(dd > 0, jnp.clip(vv / jnp.where(dd > 0, dd, 1.0), 0.0, 1.0), jnp.where(vv > 0, 1.0, 0.0))
    alpha = jnp.where(n_c > 1, alpha, 0.0)
    shrunk = r - alpha[span] * (r - mean[span])
    # conservation, chunk by chunk: Σ_c (Σ_{i∈c} w_i r̃_i − B_c) per sample
    e_c = (seg(w * shrunk * live, span, spans) - big_b) * span_weight
    err = jnp.abs(seg(e_c, span_sample, num_samples))
    scale = seg(jnp.abs(w * r) * live, sample, num_samples)
    bad = seg(jnp.where(on, ~jnp.isfinite(shrunk), False).astype(jnp.float32), sample, num_samples) > 0
    valid = seg(live, sample, num_samples) > 0
    fell = valid & (bad | (err > 1e-6 * jnp.maximum(scale, 1.0)))
    rates = jnp.where(fell[sample], r, shrunk)
    multi = (n_c > 1) & (span_weight > 0)
    return rates, {"valid": valid, "fell": fell, "sigma2": sigma2, "updated": updated}, \
        {"alpha": alpha, "multi": multi}, (all_s2, all_updated), index


def lm_head_gram(hidden, lm_head, rows, targets, pos, valid, atoms_per_chunk: int, chunk_rows: int):
    """H [C, g, g] per chunk: H_ij = Σ_{t∈i,u∈j} (δ_t·δ_u)(x_t·x_u), δ_t = p_t − e_{y_t} (full
    softmax, τ = 1), x_t the LM-head input; δ_t·δ_u = p_t·p_u − p_t[y_u] − p_u[y_t] + [y_t = y_u].
    float32 with Precision.HIGHEST, [blocks, K, V] logits at a time, symmetrised, no gradient."""
    hidden, lm_head = jax.lax.stop_gradient((hidden, lm_head))
    num, k = rows.shape
    per = max(1, min(num, chunk_rows // max(k, 1)))
    pad = (-num) % per
    padf = lambda x: jnp.pad(x, [(0, pad), (0, 0)])  # noqa: E731
    xs = tuple(padf(x).reshape(-1, per, k) for x in (rows, targets, pos, valid))
    hi = jax.lax.Precision.HIGHEST
    w32 = lm_head.astype(jnp.float32)

    def block(args):
        r, y, p_, v = args
        x = jnp.take(hidden, r, axis=0).astype(jnp.float32)              # [c, K, H]
        z = jnp.einsum("ckh,hv->ckv", x, w32, precision=hi)
        p = jax.nn.softmax(z, axis=-1)
        pp = jnp.einsum("ckv,clv->ckl", p, p, precision=hi)
        py = jnp.take_along_axis(p, jnp.broadcast_to(y[:, None, :], pp.shape), axis=2)  # p_k[y_l]
        dd = pp - py - jnp.swapaxes(py, 1, 2) + (y[:, :, None] == y[:, None, :]).astype(jnp.float32)
        xx = jnp.einsum("ckh,clh->ckl", x, x, precision=hi)
        g = dd * xx * v[:, :, None] * v[:, None, :]
        m = jax.nn.one_hot(p_, atoms_per_chunk, dtype=jnp.float32) * v[..., None]  # [c, K, g]
        h = jnp.einsum("cki,ckl,clj->cij", m, g, m, precision=hi)
        return 0.5 * (h + jnp.swapaxes(h, 1, 2))

    out = jax.lax.map(block, xs)
    return out.reshape(-1, atoms_per_chunk, atoms_per_chunk)[:num]


@register("mp_opd")
class MpOpd(Objective):
    settings_class = MpOpdSettings
    response_logprob_grad = True   # h_i differentiates the student's token log-probs
    stale_responses = None   # sampled atom credits, on-policy, no rollout log-probs to correct them
    # l_T of an atom is a sum of the teacher's token log-probs: a served teacher can supply them
    needs = Needs(teacher_scores="token_logprobs")

    def __init__(self, settings):
        super().__init__(settings)
        self.noise = GrassNoise()

    @property
    def uses_host_credits(self) -> bool:
        """ALIGN's rates come from a (stateless) host callback; GRASS runs on device."""
        return self.settings.mp_opd_mode == "align"

    def __hash__(self):
        return id(self) if self.uses_host_credits else super().__hash__()

    def __eq__(self, other):
        return self is other if self.uses_host_credits else super().__eq__(other)

    def state_dict(self) -> dict:
        if self.settings.mp_opd_mode != "grass_chunk":
            return {}
        return {"grass_noise_ema": self.noise.ema, "grass_noise_updates": self.noise.updates}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.noise = GrassNoise(state.get("grass_noise_ema", 0.0), state.get("grass_noise_updates", 0))

    @property
    def packed_rows(self) -> dict[str, str] | None:
        """grass_chunk cannot pack: its noise EMA advances once per micro-batch, so a token
        budget (other micro-batch boundaries) would change the loss, not only its layout."""
        if self.settings.mp_opd_mode == "grass_chunk":
            return None
        return {**BASE_ROWS, "atom_teacher_rows": "teacher"}

    def after_micro_batch(self, metrics: dict) -> dict:
        """Host, after each micro-batch (device.micro_grad): the micro-batch's per-sample noise
        statistics, in sample order and combined over the batch shards, update the EMA (one
        update per valid sample with s² > 0, SPEC §8); returns the metrics without them."""
        if NOISE_KEY not in metrics:
            return metrics
        metrics = dict(metrics)
        s2, updated = (np.asarray(jax.device_get(x if not isinstance(x, jax.Array) or x.is_fully_addressable
                                                 else x.addressable_data(0)))
                       for x in metrics.pop(NOISE_KEY))
        for v, u in zip(s2.tolist(), updated.tolist()):
            if u > 0:
                self.noise.add(v)
        return metrics

    def prepare(self, host, start, stop):
        arrays = pack.student_arrays(host, start, stop)
        arrays.update(pack.teacher_tokens(host, start, stop))
        arrays.update(atom_arrays(self.settings, host, start, stop, arrays["student_ids"].shape[1],
                                  arrays["teacher_ids"].shape[1], arrays["response_rows"],
                                  arrays["response_weight"]))
        arrays["teacher_rows"] = arrays["atom_teacher_rows"]
        if self.settings.mp_opd_mode == "grass_chunk":
            # the EMA before this micro-batch (the same [2] on every shard) and the sample slots
            arrays["grass_noise_in"] = np.float32([self.noise.ema, self.noise.updates])
            arrays["grass_sample_slots"] = np.zeros(stop - start, np.float32)
        return arrays

    def kd_weights(self):
        return {"mp_opd": 1.0}

    # host side of the align step (called through io_callback; stateless)
    def credits_on_host(self, b, w, span, pos, sample, weight, grams):
        b, w = np.asarray(b, np.float64), np.asarray(w, np.float64)
        span, sample = np.asarray(span), np.asarray(sample)
        live = np.flatnonzero(np.asarray(weight) > 0)
        rates = np.zeros(len(b), np.float32)
        fallbacks = 0
        for smp in np.unique(sample[live]):
            idx = live[sample[live] == smp]
            ids = span[idx]
            chunks, grams_s, s0 = [], [], 0
            for c in np.unique(ids):
                e = s0 + int((ids == c).sum())
                chunks.append((s0, e))
                grams_s.append(np.asarray(grams[c], np.float32))
                s0 = e
            out, fell = align_sample(b[idx], w[idx], chunks, grams_s)
            fallbacks += int(fell)
            rates[idx] = out.astype(np.float32)
        return rates, np.array([fallbacks], np.float32)

    def kd_sums(self, x):
        s, bt = self.settings, x.batch
        num = bt["atom_weight"].shape[0]
        lp_s = jnp.take(x.response_logprobs, bt["atom_student_index"], axis=0) * bt["atom_student_weight"]
        h = -jax.ops.segment_sum(lp_s, bt["atom_student_atom"], num_segments=num)
        if x.teacher_hidden is None:   # a served teacher (temperature 1, as token_rows here)
            t_lp = bt["atom_teacher_token_logprobs"]
        else:
            t_lp, _ = token_rows(x.teacher_hidden, jax.lax.stop_gradient(x.teacher_lm_head),
                                 bt["atom_teacher_targets"], chunk_rows=s.chunked_loss_size,
                                 implementation=s.implementation)
        l_t = jax.ops.segment_sum(jax.lax.stop_gradient(t_lp) * bt["atom_teacher_weight"],
                                  bt["atom_teacher_atom"], num_segments=num)
        live = bt["atom_weight"]
        b = jax.lax.stop_gradient(l_t + h) * live      # lT − lS
        w = jnp.where(live > 0, bt["atom_w"], 1.0)
        samples, valid = jnp.sum(bt["mp_opd_samples"]), jnp.sum(bt["mp_opd_valid_samples"])
        metrics = {f"mp_opd_fail_{k[len('mp_opd_fail_'):]}": (jnp.sum(bt[k]), samples)
                   for k in bt if k.startswith("mp_opd_fail_")}
        metrics["mp_opd_atoms_per_sample"] = (jnp.sum(live), valid)
        if s.mp_opd_mode in ("grass_chunk", "align"):
            grams = lm_head_gram(x.hidden, x.lm_head, bt["gram_rows"], bt["gram_targets"], bt["gram_pos"],
                                 bt["gram_valid"], s.grass_chunk_atoms, s.chunked_loss_size)
        if s.mp_opd_mode == "grass_chunk":
            rates, per_sample, per_chunk, (all_s2, all_updated), index = grass_rates(
                b, w, live, bt["atom_span"], bt["atom_pos"], bt["atom_sample"], bt["span_sample"],
                bt["span_weight"], grams, bt["grass_sample_slots"].shape[0], bt["grass_noise_in"])
            ok = per_sample["valid"].astype(jnp.float32)
            metrics["mp_opd_fallback_fraction"] = (jnp.sum(per_sample["fell"].astype(jnp.float32)), valid)
            multi = per_chunk["multi"].astype(jnp.float32)
            metrics["mp_opd_grass_alpha"] = (jnp.sum(per_chunk["alpha"] * multi), jnp.sum(multi))
            # the σ² the batch's valid samples used (mean over them), and the EMA updates made
            metrics["mp_opd_grass_noise_var"] = (jnp.sum(per_sample["sigma2"] * ok), jnp.sum(ok))
            metrics["mp_opd_grass_noise_updates"] = (jnp.sum(per_sample["updated"].astype(jnp.float32)), None)
            first = index == 0   # every shard holds the whole sequence: shard 0 reports it
            metrics[NOISE_KEY] = (jnp.where(first, all_s2, 0.0), jnp.where(first, all_updated, False).astype(jnp.float32))
        elif self.uses_host_credits:
            rates, stats = io_callback(
                self.credits_on_host,
                (jax.ShapeDtypeStruct((num,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
                b, w, bt["atom_span"], bt["atom_pos"], bt["atom_sample"], live, grams, ordered=False)
            metrics["mp_opd_fallback_fraction"] = (stats[0], valid)
        else:
            spans = bt["span_weight"].shape[0]
            big_b = jax.ops.segment_sum(b, bt["atom_span"], num_segments=spans)
            big_w = jax.ops.segment_sum(w * live, bt["atom_span"], num_segments=spans)
            rates = jnp.take(big_b / jnp.maximum(big_w, 1e-30), bt["atom_span"])
        rates = jax.lax.stop_gradient(rates) * live
        return {"mp_opd": jnp.sum(rates * h)}, metrics
