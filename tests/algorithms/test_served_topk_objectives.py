"""The objectives on a served teacher's top-k (algorithms/served_topk.py) through their own
host arrays (`served_columns`, `served_support`) and `kd_sums`, on a real student matmul
(hidden @ lm_head), against brute-force float64 numpy written here from the issue's words:

- teacher-top-k strict: at each aligned pair, the teacher's top-k restricted to V∩ and mapped
  to student ids, both sides renormalised over that set, D of SPEC §5;
- top-k GKD: GKD's generalised JSD (SPEC §9, β weighting the teacher) on the teacher's top-k
  (+ the sampled token when β > 0), with a tail bucket of the remaining mass or renormalised.

Gradients against central finite differences of the same references."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ctopd_jax.algorithms.base import StepInputs
from ctopd_jax.algorithms.micro_batch import MicroBatch
from ctopd_jax.algorithms.served_topk import TeacherTopkStrict, TopkGkd, TopkGkdSettings, overlap_table
from ctopd_jax.algorithms.strict import StrictPairs
from ctopd_jax.config import AlgorithmSection
from ctopd_jax.tokenization.overlap import OverlapMap

from divergences import gkd_jsd, log_softmax, served_top_k, softmax, spec5, top_k_ids


# ------------------------------------------------------------------- references (float64)

def served_answer(teacher_logits, k):
    ids, lps = served_top_k(teacher_logits, k)
    return ids, lps, log_softmax(teacher_logits)


def reference_teacher_topk_strict(hidden, lm_head, pairs, weight, zt, s_ids, t_ids, k, name, tau):
    """Σ_r w_r D(p̄_S, p̄_T) over the pairs (student row, teacher row r)."""
    zs = np.asarray(hidden, np.float64) @ np.asarray(lm_head, np.float64)
    lp_t = log_softmax(zt)
    total = 0.0
    for r, (s_row, w) in enumerate(zip(pairs, weight)):
        top = set(top_k_ids(lp_t[r], k))
        cols = [i for i in range(len(t_ids)) if t_ids[i] in top]   # V∩ ∩ the teacher's top-k
        if not cols or w == 0:
            continue
        pt = softmax(np.array([zt[r, t_ids[i]] for i in cols]) / tau)
        ps = softmax(np.array([zs[s_row, s_ids[i]] for i in cols]) / tau)
        total += float(w) * spec5(name, ps, pt)
    return total


def reference_topk_gkd(hidden, lm_head, rows, weight, zt, sampled, k, beta, tail, tau):
    zs = np.asarray(hidden, np.float64) @ np.asarray(lm_head, np.float64)
    lp_t = log_softmax(zt)
    total = 0.0
    for r, (row, w) in enumerate(zip(rows, weight)):
        if w == 0:
            continue
        support = top_k_ids(lp_t[r], k)
        if beta > 0 and sampled[r] not in support:
            support.append(int(sampled[r]))
        lp_s = log_softmax(zs[row] / tau)
        if tail:
            pt = np.exp(lp_t[r, support])
            ps = np.exp(lp_s[support])
            pt, ps = np.append(pt, 1 - pt.sum()), np.append(ps, 1 - ps.sum())
        else:
            pt = softmax(lp_t[r, support] / tau)
            ps = softmax(lp_s[support])
        total += float(w) * gkd_jsd(ps, pt, beta)
    return total


def finite_difference(f, x, index, eps=1e-5):
    up, down = x.copy(), x.copy()
    up[index] += eps
    down[index] -= eps
    return (f(up) - f(down)) / (2 * eps)


def check_gradient(grad, reference_of, x, indices):
    for index in indices:
        want = finite_difference(reference_of, x.astype(np.float64), index)
        assert abs(grad[index] - want) <= 2e-3 * max(1.0, abs(want)), (index, grad[index], want)


# ------------------------------------------------------------------------- teacher-top-k strict

def make_overlap(rng, v_t, v_s, shared):
    """V∩ map with the appended EOS pair sharing a teacher id with a string pair (SPEC §3)."""
    t_ids = rng.choice(v_t, shared, replace=False)
    s_ids = rng.choice(v_s, shared, replace=False)
    t_ids = np.append(t_ids, t_ids[0])
    s_ids = np.append(s_ids, np.setdiff1d(np.arange(v_s), s_ids)[0])
    return OverlapMap(s_ids=s_ids.astype(np.int32), t_ids=t_ids.astype(np.int32),
                      teacher_vocab_size=v_t, student_vocab_size=v_s, rule="test",
                      eos_appended=True)


def strict_case(seed, k, name, tau):
    rng = np.random.default_rng(seed)
    v_t, v_s, h, n_hidden, pairs, size = 26, 21, 6, 12, 7, 8
    overlap = make_overlap(rng, v_t, v_s, 12)
    hidden = rng.normal(size=(n_hidden, h)).astype(np.float32)
    lm_head = (rng.normal(size=(h, v_s)) * 0.8).astype(np.float32)
    zt = rng.normal(size=(pairs, v_t)) * 2.5
    student_rows = rng.choice(n_hidden, pairs, replace=False)
    weight = np.ones(pairs, np.float32)
    weight[3] = 0.0   # a pair outside the optimizer batch's loss (weight 0) adds nothing
    objective = TeacherTopkStrict(AlgorithmSection(name="teacher_topk_strict", kd_loss_fn=name,
                                                   kd_temperature=tau))
    top_ids, top_lps, _ = served_answer(zt, k)
    pairs = StrictPairs(strict_student_rows=np.append(student_rows, 0).astype(np.int32),   # + a padded row
                        strict_weight=np.append(weight, 0.0).astype(np.float32))
    batch = MicroBatch(terms=objective.served_columns(pairs, top_ids, top_lps, overlap_table(overlap), size))
    return objective, batch, hidden, lm_head, (student_rows, weight, zt, overlap)


def kd_total(objective, batch, key):
    def total(hidden, lm_head):
        x = StepInputs(hidden, lm_head, None, None, jax.tree.map(jnp.asarray, batch), {}, None)
        sums, metrics = objective.kd_sums(x)
        return sums[key], metrics
    return jax.value_and_grad(total, argnums=(0, 1), has_aux=True)


@pytest.mark.parametrize("name,tau,k", [
    ("rkl", 1.0, 4), ("jsd", 0.7, 9),
    pytest.param("kl", 1.3, 26, marks=pytest.mark.slow),   # k = |V_T|: every V∩ column
    pytest.param("tvd", 1.0, 5, marks=pytest.mark.slow)])
def test_teacher_topk_strict_loss_and_gradient_equal_brute_force(name, tau, k):
    objective, batch, hidden, lm_head, (rows, weight, zt, ov) = strict_case(k, k, name, tau)
    (value, metrics), (g_hidden, g_head) = kd_total(objective, batch, "teacher_topk_strict")(
        jnp.asarray(hidden), jnp.asarray(lm_head))

    def ref(hid, head):
        return reference_teacher_topk_strict(hid, head, rows, weight, zt, ov.s_ids, ov.t_ids, k,
                                             name, tau)

    want = ref(hidden, lm_head)
    assert want > 1e-3
    assert float(value) == pytest.approx(want, rel=1e-5, abs=1e-6)
    if name != "tvd":   # |p_S − p_T| has kinks; its value is enough
        check_gradient(np.asarray(g_hidden), lambda hid: ref(hid, lm_head), hidden,
                       [(int(rows[0]), 0), (int(rows[2]), 3), (int(rows[6]), 5)])
        check_gradient(np.asarray(g_head), lambda head: ref(hidden, head), lm_head,
                       [(1, int(ov.s_ids[0])), (4, int(ov.s_ids[5])), (2, int(ov.s_ids[-1]))])
    # only V∩ student columns and the pairs' hidden rows receive gradient
    outside = np.setdiff1d(np.arange(lm_head.shape[1]), ov.s_ids)
    assert (np.asarray(g_head)[:, outside] == 0).all()
    assert (np.asarray(g_hidden)[np.setdiff1d(np.arange(hidden.shape[0]), rows)] == 0).all()
    # the coverage metric: the teacher's probability on the kept columns, weighted over pairs
    lp = log_softmax(zt)
    mass = [sum(np.exp(lp[r, t]) for t in set(top_k_ids(lp[r], k)) if t in set(ov.t_ids))
            for r in range(len(rows))]
    num, den = metrics["teacher_topk_mass"]
    assert float(num) / float(den) == pytest.approx(np.dot(weight, mass) / weight.sum(), rel=1e-5)


# ------------------------------------------------------------------------------------ top-k GKD

@pytest.mark.parametrize("beta,tail,tau", [
    (0.5, True, 1.0), (0.3, False, 0.8),
    pytest.param(0.0, True, 1.0, marks=pytest.mark.slow),
    pytest.param(1.0, True, 1.0, marks=pytest.mark.slow),
    pytest.param(1.0, False, 1.0, marks=pytest.mark.slow)])
def test_topk_gkd_loss_and_gradient_equal_brute_force(beta, tail, tau):
    rng = np.random.default_rng(int(beta * 10) + tail)
    v, h, n_hidden, n, size, k = 15, 5, 11, 7, 8, 3
    hidden = rng.normal(size=(n_hidden, h)).astype(np.float32)
    lm_head = (rng.normal(size=(h, v)) * 0.8).astype(np.float32)
    zt = rng.normal(size=(n, v)) * 2.0
    rows = rng.choice(n_hidden, n, replace=False)
    sampled = rng.integers(0, v, n)
    sampled[0] = int(np.argmax(zt[0]))   # a sampled token already in the top-k
    weight = np.ones(n, np.float32)
    weight[2] = 0.0
    settings = TopkGkdSettings(name="topk_gkd", gkd_beta=beta, topk_gkd_tail=tail,
                               kd_temperature=tau, gap_logprobs="recomputed", chunked_loss_size=3)
    objective = TopkGkd(settings)
    top_ids, top_lps, lp_t = served_answer(zt, k)
    sampled_lps = lp_t[np.arange(n), sampled].astype(np.float32)
    batch = MicroBatch(terms=objective.served_support(top_ids, top_lps, sampled, sampled_lps, size),
                       response_rows=np.append(rows, 0).astype(np.int32),
                       response_targets=np.append(sampled, 0).astype(np.int32),
                       response_weight=np.append(weight, 0.0).astype(np.float32))
    (value, _), (g_hidden, g_head) = kd_total(objective, batch, "topk_gkd")(
        jnp.asarray(hidden), jnp.asarray(lm_head))

    def ref(hid, head):
        return reference_topk_gkd(hid, head, rows, weight, zt, sampled, k, beta, tail, tau)

    want = ref(hidden, lm_head)
    assert want > 1e-3
    assert float(value) == pytest.approx(want, rel=2e-5, abs=1e-6)
    check_gradient(np.asarray(g_hidden), lambda hid: ref(hid, lm_head), hidden,
                   [(int(rows[0]), 0), (int(rows[1]), 2), (int(rows[6]), 4)])
    # with the tail every student column has gradient (the tail holds them); the top-k column
    # of a row and one outside every support
    outside = np.setdiff1d(np.arange(v), np.concatenate([top_ids.ravel(), sampled]))
    cols = [(1, int(top_ids[0, 0])), (3, int(sampled[4]))] + \
        ([(0, int(outside[0]))] if len(outside) else [])
    check_gradient(np.asarray(g_head), lambda head: ref(hidden, head), lm_head, cols)
    if not tail and len(outside):   # renormalised over the support: columns outside get none
        assert (np.asarray(g_head)[:, outside] == 0).all()
