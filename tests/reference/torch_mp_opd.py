"""Independent PyTorch reference for MP-OPD credits (SPEC §8), written from docs/spec.md only; it
shares no code with ctopd_jax.

Inputs per sample: its atoms as (teacher token indices, student token indices), the response
labels and the hidden rows that predict them on both sides. Full-vocabulary softmax at τ = 1,
plain autograd. Credits:
* partitions: `atomic`, `fixedK`, `randomA-B` (the seed rule re-implemented here: sha256 of
  "{seed}:{row}:{w as a list of floats}", first 8 bytes big-endian, random.Random, cursor walk);
* `grass_chunk`: chunks of `chunk_atoms` atoms; H by brute force from explicit δ_t = p_t − e_y
  vectors (float64 here); α from D and V with the noise EMA (ρ = 0.99, ≥ 8 in-chunk adjacent
  pairs, 1.4826·MAD with lower medians, bias-corrected); conservation fallback;
* `align`: A = diag(r), cyclic sweep, column sums, float32.
Loss: Σ_i stop_grad(rate_i) · h_i, h_i = −Σ student log-probs of the atom's tokens.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def seeded_partition(w, row, seed, lo, hi):
    text = "%d:%d:%s" % (seed, row, "[" + ", ".join(repr(float(x)) for x in w) + "]")
    rng = random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], byteorder="big"))
    out, cursor = [], 0
    while cursor < len(w):
        h = min(hi, len(w) - cursor)
        n = rng.randint(min(lo, h), h)
        out.append(list(range(cursor, cursor + n)))
        cursor += n
    return out


def runs(n, k):
    return [list(range(i, min(i + k, n))) for i in range(0, n, k)]


def _lower_median(values):
    v = sorted(values)
    return v[(len(v) - 1) // 2]


class Noise:
    def __init__(self):
        self.ema, self.t = 0.0, 0

    def update(self, z):
        if len(z) >= 8:
            m = _lower_median(z)
            s2 = (1.4826 * _lower_median([abs(x - m) for x in z])) ** 2
            if s2 > 0:
                self.ema = 0.99 * self.ema + 0.01 * s2
                self.t += 1

    def var(self):
        return self.ema / (1 - 0.99 ** self.t) if self.t else 0.0


def gram(delta, x, atoms_tok):
    """H_ij = Σ_{t∈i,u∈j} (δ_t·δ_u)(x_t·x_u), float64, symmetrised."""
    n = len(atoms_tok)
    h = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            h[i, j] = sum(float(delta[t] @ delta[u]) * float(x[t] @ x[u])
                          for t in atoms_tok[i] for u in atoms_tok[j])
    return 0.5 * (h + h.T)


def grass_rates(b, w, chunks, grams, noise):
    r = [bi / wi for bi, wi in zip(b, w)]
    z = [(r[c[k + 1]] - r[c[k]]) / np.sqrt(1 / w[c[k]] + 1 / w[c[k + 1]]) for c in chunks for k in range(len(c) - 1)]
    noise.update(z)
    s2 = noise.var()
    out = list(r)
    for c, h in zip(chunks, grams):
        rc, wc = np.array([r[i] for i in c]), np.array([w[i] for i in c], float)
        mean = float((wc * rc).sum() / wc.sum())
        if len(c) == 1:
            alpha = 0.0
        else:
            d = rc - mean
            dd = float(d @ h @ d)
            vv = s2 * (float(sum(h[k, k] / wc[k] for k in range(len(c)))) - float(h.sum()) / wc.sum())
            alpha = min(max(vv / dd, 0.0), 1.0) if dd > 0 else (1.0 if vv > 0 else 0.0)
        for k, i in enumerate(c):
            out[i] = r[i] - alpha * (r[i] - mean)
    err = abs(sum(wi * o for wi, o in zip(w, out)) - sum(b))
    if err > 1e-6 * max(sum(abs(wi * ri) for wi, ri in zip(w, r)), 1.0):
        return r, True
    return out, False


def align_rates(b, w, chunks, grams):
    r = (np.array(b, np.float32) / np.array(w, np.float32)).astype(np.float32)
    out = r.copy()
    for c, h in zip(chunks, grams):
        h = h.astype(np.float32)
        n = len(c)
        rc = r[c]
        a = np.diag(rc).astype(np.float32)
        for i in range(n):
            for s in range(1, n):
                j = (i + s) % n
                if rc[j] == 0 or h[j, j] <= 1e-12:
                    continue
                ah = np.float32(np.dot(a[i], h[:, j]))
                if rc[j] * ah < 0:
                    a[i, j] -= ah / h[j, j]
        out[c] = a.sum(0)
    return [float(v) for v in out]


def mp_opd_loss(samples, s_head, t_head, mode, *, seed=43, chunk_atoms=2, noise=None):
    """(Σ over samples of Σ_i rate_i · h_i, per-sample rates). samples: dicts with atoms
    [(t_idx, s_idx)], s_labels, t_labels, s_hidden [n_s, H] (requires grad upstream),
    t_hidden [n_t, H], row (the sample's row in its micro-batch)."""
    noise = noise if noise is not None else Noise()
    total = torch.zeros((), dtype=torch.float32)
    all_rates = []
    for smp in samples:
        if not smp["atoms"]:
            all_rates.append([])
            continue
        zs = smp["s_hidden"].float() @ s_head.float()
        zt = smp["t_hidden"].float() @ t_head.float()
        lps = torch.log_softmax(zs, -1)
        lpt = torch.log_softmax(zt, -1)
        s_lab = torch.as_tensor(smp["s_labels"], dtype=torch.long)
        t_lab = torch.as_tensor(smp["t_labels"], dtype=torch.long)
        tok_s = lps[torch.arange(len(s_lab)), s_lab]
        tok_t = lpt[torch.arange(len(t_lab)), t_lab]
        h = torch.stack([-tok_s[list(si)].sum() for _, si in smp["atoms"]])
        b = [float(tok_t[list(ti)].sum()) - float(-hi) for (ti, _), hi in zip(smp["atoms"], h.detach())]
        w = [len(si) for _, si in smp["atoms"]]
        n = len(w)
        if mode == "atomic" or mode.startswith("fixed") or mode.startswith("random"):
            if mode == "atomic":
                parts = runs(n, 1)
            elif mode.startswith("fixed"):
                parts = runs(n, int(mode[5:]))
            else:
                lo, hi = map(int, mode[6:].split("-"))
                parts = seeded_partition(w, smp["row"], seed, lo, hi)
            rates = [0.0] * n
            for c in parts:
                rate = sum(b[i] for i in c) / sum(w[i] for i in c)
                for i in c:
                    rates[i] = rate
        else:
            chunks = runs(n, chunk_atoms)
            p = torch.softmax(zs.detach().double(), -1)
            onehot = torch.nn.functional.one_hot(s_lab, p.shape[1]).double()
            delta = (p - onehot).numpy()
            x = smp["s_hidden"].detach().double().numpy()
            grams = [gram(delta, x, [smp["atoms"][i][1] for i in c]) for c in chunks]
            if mode == "grass_chunk":
                rates, _ = grass_rates(b, w, chunks, grams, noise)
            else:
                rates = align_rates(b, w, chunks, grams)
        all_rates.append(rates)
        total = total + (torch.tensor(rates, dtype=torch.float32) * h).sum()
    return total, all_rates
