"""MP-OPD's credits on the host (SPEC §8, float64): the seeded partitions of atoms into spans,
the span rates, GRASS's noise estimate and shrinkage, and ALIGN's rotation against the LM-head
Gram matrix. algorithms/mp_opd.py uses them (ALIGN inside the step, through io_callback); the
device GRASS (mp_opd_device.py) follows the same definitions in float32.
"""
from __future__ import annotations

import hashlib
import math
import random

import numpy as np

RHO = 0.99             # noise EMA decay
MIN_NOISE_PAIRS = 8    # adjacent in-chunk pairs a sample needs to update the noise estimate
MAD_SCALE = 1.4826


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
