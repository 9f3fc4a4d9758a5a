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

Design (where each quantity lives; the host credit math is mp_opd_credits.py, the device
pieces mp_opd_device.py, this module the settings, the micro-batch arrays and the objective):
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

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ctopd_jax.algorithms import padded_rows
from ctopd_jax.algorithms.base import Needs, Objective, register
from ctopd_jax.algorithms.micro_batch import rows, terms_class
from ctopd_jax.algorithms.mp_opd_credits import GrassNoise, align_sample, sample_spans
from ctopd_jax.algorithms.mp_opd_device import NOISE_KEY, grass_rates, lm_head_gram
from ctopd_jax.align.atoms import FAIL_REASONS, mpopd_atoms
from ctopd_jax.config import AlgorithmSection, require
from ctopd_jax.kernels.token_rows import token_rows

MODES = ("atomic", "fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2", "random2-5",
         "grass_chunk", "align")


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



# -- host arrays ------------------------------------------------------------------------------------
@terms_class
class AtomTerms:
    """The atoms of a micro-batch: A atoms, C spans (partition parts or chunks), N student and Q
    teacher tokens in them (each padded); the Gram layout [C, K] for grass_chunk / align."""
    atom_weight: Any = None          # [A] float32: 1 real atom, 0 padding
    atom_w: Any = None               # [A] float32: w_i, its student tokens
    atom_span: Any = None            # [A] int32: its span
    atom_pos: Any = None             # [A] int32: its position in the span
    atom_sample: Any = None          # [A] int32: its sample in the micro-batch
    span_sample: Any = None          # [C] int32: each span's sample
    span_weight: Any = None          # [C] float32: 1 real span, 0 padding
    atom_student_index: Any = None   # [N] int32: each atom token's index into response_rows
    atom_student_atom: Any = None    # [N] int32: its atom
    atom_student_weight: Any = None  # [N] float32: 1 real, 0 padding
    atom_teacher_rows: Any = rows("teacher")  # [Q] int32: the atoms' teacher rows
    atom_teacher_targets: Any = None  # [Q] int32: the token each predicts
    atom_teacher_atom: Any = None    # [Q] int32: its atom
    atom_teacher_weight: Any = None  # [Q] float32: 1 real, 0 padding
    # counts are [1] arrays, not 0-d: per-shard parts are stacked along a leading axis (the
    # step's stack_shards) and summed on the device
    mp_opd_samples: Any = None       # [1] float32: samples
    mp_opd_valid_samples: Any = None  # [1] float32: samples with atoms
    mp_opd_fail_counts: Any = None   # [1, len(FAIL_REASONS)] float32: fail-closed samples per reason
    atom_teacher_token_logprobs: Any = None  # [Q] float32: a served teacher's log π_T (else None)
    gram_rows: Any = rows("student")  # [C, K] int32: each chunk token's student row (grass/align)
    gram_targets: Any = None         # [C, K] int32: its token
    gram_pos: Any = None             # [C, K] int32: its atom's position in the chunk
    gram_valid: Any = None           # [C, K] float32: 1 real token
    grass_noise_in: Any = None       # [2] float32: (EMA, updates) before the micro-batch (grass_chunk)
    grass_sample_slots: Any = None   # [M] float32 zeros: its shape is the shard's sample count


def host_atoms(host, eos_atom: bool = False):
    """MP-OPD atoms of the whole collected batch (computed once per batch)."""
    return host.once(f"mp_opd_atoms_eos{int(eos_atom)}",
                     lambda h: mpopd_atoms(h.teacher, h.student, eos_atom=eos_atom))


def atom_arrays(settings, host, start: int, stop: int, student_len: int, teacher_len: int,
                response_rows: np.ndarray, response_weight: np.ndarray, min_rows: int = 64) -> dict:
    """AtomTerms' fields (without the GRASS noise) of samples [start, stop)."""
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
    size = padded_rows.rows_bucket(n, min_rows)
    spans = padded_rows.rows_bucket(first, min_rows)
    s_rows, s_atom = padded_rows.expand_ranges(a[:, 3], w)
    s_rows = padded_rows.rebase(s_rows, host.student.seq_len, start, student_len)
    real = response_rows[:int(response_weight.sum())]
    s_index = np.searchsorted(real, s_rows)
    t_count = a[:, 2] - a[:, 1]
    t_rows, t_atom = padded_rows.expand_ranges(a[:, 1], t_count)
    t_targets = host.teacher.labels.reshape(-1)[t_rows]
    s_size, t_size = padded_rows.rows_bucket(len(s_index), min_rows), padded_rows.rows_bucket(len(t_rows), min_rows)
    counts = atoms.fail_counts(start, stop)
    out = {
        "atom_weight": padded_rows.padded(np.ones(n), size)[1],
        "atom_w": padded_rows.padded(w, size, np.float32)[0],
        "atom_span": padded_rows.padded(span_id, size)[0],
        "atom_pos": padded_rows.padded(span_pos, size)[0],
        "atom_sample": padded_rows.padded(a[:, 0] - start, size)[0],
        "span_sample": padded_rows.padded(np.asarray(span_sample, np.int64), spans)[0],
        "span_weight": padded_rows.padded(np.ones(first), spans)[1],
        "atom_student_index": padded_rows.padded(s_index, s_size)[0],
        "atom_student_atom": padded_rows.padded(s_atom, s_size)[0],
        "atom_student_weight": padded_rows.padded(s_index, s_size)[1],
        "atom_teacher_rows": padded_rows.padded(padded_rows.rebase(t_rows, host.teacher.seq_len, start, teacher_len), t_size)[0],
        "atom_teacher_targets": padded_rows.padded(t_targets, t_size)[0],
        "atom_teacher_atom": padded_rows.padded(t_atom, t_size)[0],
        "atom_teacher_weight": padded_rows.padded(t_rows, t_size)[1],
        "mp_opd_samples": np.float32([stop - start]),
        "mp_opd_valid_samples": np.float32([atoms.sample_valid[start:stop].sum()]),
        "mp_opd_fail_counts": np.float32([[counts[name] for name in FAIL_REASONS]]),
    }
    if host.served_teacher_rows is not None:   # a served teacher: the atoms' log π_T already scored
        out["atom_teacher_token_logprobs"] = padded_rows.served_token_logprobs(host, t_rows, t_size)
    if s.mp_opd_mode in ("grass_chunk", "align"):
        # chunk token layout for the Gram pass: [chunks, K] student rows, target, atom position
        tok_span = span_id[s_atom]
        per_span = np.bincount(tok_span, minlength=first) if n else np.zeros(0, np.int64)
        k = padded_rows.rows_bucket(int(per_span.max(initial=1)), 1)
        order = np.argsort(tok_span, kind="stable")
        slot = np.arange(len(tok_span)) - np.repeat(np.cumsum(per_span) - per_span, per_span)
        rows = np.zeros((spans, k), np.int32)
        targets = np.zeros((spans, k), np.int32)
        pos = np.zeros((spans, k), np.int32)
        valid = np.zeros((spans, k), np.float32)
        sp, sl = tok_span[order], slot
        rows[sp, sl] = real[s_index[order]] if len(order) else 0
        targets[sp, sl] = host.student.labels.reshape(-1)[padded_rows.expand_ranges(a[:, 3], w)[0][order]] if len(order) else 0
        pos[sp, sl] = span_pos[s_atom[order]]
        valid[sp, sl] = 1.0
        out.update({"gram_rows": rows, "gram_targets": targets, "gram_pos": pos, "gram_valid": valid})
    return out


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
    def packs(self) -> bool:
        """grass_chunk cannot pack: its noise EMA advances once per micro-batch, so a token
        budget (other micro-batch boundaries) would change the loss, not only its layout.
        atomic and align pack (align's chunk Gram rows are declared student rows, so they move
        with their tokens)."""
        return self.settings.mp_opd_mode != "grass_chunk"

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
        batch = padded_rows.micro_batch(host, start, stop)
        fields = atom_arrays(self.settings, host, start, stop, batch.student_ids.shape[1],
                             batch.teacher_ids.shape[1], batch.response_rows, batch.response_weight)
        if self.settings.mp_opd_mode == "grass_chunk":
            # the EMA before this micro-batch (the same [2] on every shard) and the sample slots
            fields.update(grass_noise_in=np.float32([self.noise.ema, self.noise.updates]),
                          grass_sample_slots=np.zeros(stop - start, np.float32))
        return dataclasses.replace(batch, teacher_rows=fields["atom_teacher_rows"], terms=AtomTerms(**fields))

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
        s, bt = self.settings, x.batch.terms
        num = bt.atom_weight.shape[0]
        lp_s = jnp.take(x.response_logprobs, bt.atom_student_index, axis=0) * bt.atom_student_weight
        h = -jax.ops.segment_sum(lp_s, bt.atom_student_atom, num_segments=num)
        if x.teacher_hidden is None:   # a served teacher (temperature 1, as token_rows here)
            t_lp = bt.atom_teacher_token_logprobs
        else:
            t_lp, _ = token_rows(x.teacher_hidden, jax.lax.stop_gradient(x.teacher_lm_head),
                                 bt.atom_teacher_targets, chunk_rows=s.chunked_loss_size,
                                 implementation=s.implementation)
        l_t = jax.ops.segment_sum(jax.lax.stop_gradient(t_lp) * bt.atom_teacher_weight,
                                  bt.atom_teacher_atom, num_segments=num)
        live = bt.atom_weight
        b = jax.lax.stop_gradient(l_t + h) * live      # lT − lS
        w = jnp.where(live > 0, bt.atom_w, 1.0)
        samples, valid = jnp.sum(bt.mp_opd_samples), jnp.sum(bt.mp_opd_valid_samples)
        metrics = {f"mp_opd_fail_{name}": (jnp.sum(bt.mp_opd_fail_counts[:, k]), samples)
                   for k, name in enumerate(FAIL_REASONS)}
        metrics["mp_opd_atoms_per_sample"] = (jnp.sum(live), valid)
        if s.mp_opd_mode in ("grass_chunk", "align"):
            grams = lm_head_gram(x.hidden, x.lm_head, bt.gram_rows, bt.gram_targets, bt.gram_pos,
                                 bt.gram_valid, s.grass_chunk_atoms, s.chunked_loss_size)
        if s.mp_opd_mode == "grass_chunk":
            rates, per_sample, per_chunk, (all_s2, all_updated), index = grass_rates(
                b, w, live, bt.atom_span, bt.atom_pos, bt.atom_sample, bt.span_sample,
                bt.span_weight, grams, bt.grass_sample_slots.shape[0], bt.grass_noise_in)
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
                b, w, bt.atom_span, bt.atom_pos, bt.atom_sample, live, grams, ordered=False)
            metrics["mp_opd_fallback_fraction"] = (stats[0], valid)
        else:
            spans = bt.span_weight.shape[0]
            big_b = jax.ops.segment_sum(b, bt.atom_span, num_segments=spans)
            big_w = jax.ops.segment_sum(w * live, bt.atom_span, num_segments=spans)
            rates = jnp.take(big_b / jnp.maximum(big_w, 1e-30), bt.atom_span)
        rates = jax.lax.stop_gradient(rates) * live
        return {"mp_opd": jnp.sum(rates * h)}, metrics
