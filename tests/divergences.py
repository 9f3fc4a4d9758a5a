"""Brute-force float64 references shared by the served-teacher tests: SPEC §5's divergences,
GKD's generalised JSD (SPEC §9) and what a server answers for top-k log-probs. Plain numpy
loops, independent of ctopd_jax."""
import numpy as np


def log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)


def softmax(z):
    return np.exp(log_softmax(z))


def kl(p, q):
    return float(sum(a * (np.log(a) - np.log(b)) for a, b in zip(p, q) if a > 0))


def spec5(name, ps, pt, jsd_beta=0.5):
    """SPEC §5 on probability vectors (kdflow's jsd: β weights the STUDENT)."""
    ps, pt = np.asarray(ps, np.float64), np.asarray(pt, np.float64)
    if name == "kl":
        return kl(pt, ps)
    if name == "rkl":
        return kl(ps, pt)
    if name == "jsd":
        m = jsd_beta * ps + (1 - jsd_beta) * pt
        return jsd_beta * kl(ps, m) + (1 - jsd_beta) * kl(pt, m)
    if name == "tvd":
        return 0.5 * float(np.abs(ps - pt).sum())
    raise AssertionError(name)


def gkd_jsd(ps, pt, beta):
    """SPEC §9 GKD: β weights the TEACHER; β = 0 / 1 are forward / reverse KL."""
    ps, pt = np.asarray(ps, np.float64), np.asarray(pt, np.float64)
    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = beta * pt + (1 - beta) * ps
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def top_k_ids(logprobs_row, k):
    """A server's top-k of one row: by log-prob, ties by id."""
    return sorted(range(len(logprobs_row)), key=lambda i: (-logprobs_row[i], i))[:k]


def served_top_k(teacher_logits, k):
    """What a server returns for each row: its top-k ids and their full-vocabulary log-softmax
    values (float32, as they arrive in JSON)."""
    lp = log_softmax(teacher_logits)
    ids = np.array([top_k_ids(row, k) for row in lp])
    return ids, np.take_along_axis(lp, ids, axis=1).astype(np.float32)
