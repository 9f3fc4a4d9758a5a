"""Teacher-top-k strict and top-k GKD against brute-force references written here with plain
numpy loops (float64), and against SPEC's check values and Strict full."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ctopd_jax.algorithms.served_topk_loss import (gather_logprobs, overlap_pairs_by_teacher_id,
                                                   take_columns, topk_gkd_rows, topk_gkd_support,
                                                   topk_strict_columns, topk_strict_rows)
from ctopd_jax.kernels import losses

from divergences import gkd_jsd, log_softmax, served_top_k, softmax, spec5


def make_overlap(rng, v_teacher, v_student, shared, duplicate_eos=True):
    t_ids = rng.choice(v_teacher, shared, replace=False)
    s_ids = rng.choice(v_student, shared, replace=False)
    if duplicate_eos:  # the appended EOS pair: a teacher id that already has a pair
        t_ids = np.append(t_ids, t_ids[0])
        s_ids = np.append(s_ids, [i for i in range(v_student) if i not in s_ids][0])
    return s_ids.astype(np.int32), t_ids.astype(np.int32)


def reference_topk_strict(zs, zt, s_ids, t_ids, k, name, tau, beta=0.5):
    values, valid = [], []
    lp_t = log_softmax(zt)
    for r in range(zs.shape[0]):
        top = set(sorted(range(zt.shape[1]), key=lambda i: (-lp_t[r, i], i))[:k])
        cols = [i for i in range(len(t_ids)) if t_ids[i] in top]
        if not cols:
            values.append(0.0)
            valid.append(False)
            continue
        pt = softmax([zt[r, t_ids[i]] / tau for i in cols])
        ps = softmax([zs[r, s_ids[i]] / tau for i in cols])
        values.append(spec5(name, ps, pt, beta))
        valid.append(True)
    return np.array(values), np.array(valid)


def run_topk_strict(zs, zt, s_ids, t_ids, k, name, tau, **args):
    top_ids, top_lps = served_top_k(zt, k)
    cols = topk_strict_columns(top_ids, top_lps, s_ids,
                               overlap_pairs_by_teacher_id(s_ids, t_ids, zt.shape[1]))
    rows = topk_strict_rows(take_columns(jnp.asarray(zs, jnp.float32), cols.student_ids),
                            cols.teacher_logprobs, cols.valid, kd_loss_fn=name, temperature=tau,
                            **args)
    return np.asarray(rows), cols


@pytest.mark.parametrize("name", ["rkl", "kl", "jsd", "tvd"])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("k", [1, 4, 12])
def test_topk_strict_equals_brute_force(name, tau, k):
    rng = np.random.default_rng(k * 10 + int(tau * 10))
    v_t, v_s, rows = 30, 25, 9
    s_ids, t_ids = make_overlap(rng, v_t, v_s, 14)
    zs = rng.normal(size=(rows, v_s)) * 2
    zt = rng.normal(size=(rows, v_t)) * 2
    got, cols = run_topk_strict(zs, zt, s_ids, t_ids, k, name, tau)
    want, want_valid = reference_topk_strict(zs, zt, s_ids, t_ids, k, name, tau)
    np.testing.assert_array_equal(cols.row_valid, want_valid)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if k == 1:  # some rows have no shared token among the teacher's top-1
        assert not want_valid.all() and (got[~want_valid] == 0).all()


def test_topk_strict_with_the_whole_vocabulary_is_strict_full():
    """k >= |V_T|: every V∩ column is kept, and the loss is Strict full (SPEC §4) on V∩."""
    rng = np.random.default_rng(7)
    s_ids, t_ids = make_overlap(rng, 20, 18, 11)
    zs, zt = rng.normal(size=(6, 18)) * 3, rng.normal(size=(6, 20)) * 3
    got, cols = run_topk_strict(zs, zt, s_ids, t_ids, 20, "rkl", 0.8)
    full = losses.divergence("rkl", jnp.asarray(zs[:, s_ids], jnp.float32),
                             jnp.asarray(zt[:, t_ids], jnp.float32), temperature=0.8)
    np.testing.assert_allclose(got, np.asarray(full), rtol=1e-5, atol=1e-6)
    # each shared teacher token once (the EOS id heads two pairs but is one token)
    np.testing.assert_allclose(cols.teacher_mass, np.exp(log_softmax(zt))[:, np.unique(t_ids)]
                               .sum(axis=1), rtol=1e-5)


def test_topk_strict_gradient_matches_finite_differences_and_stays_finite():
    rng = np.random.default_rng(3)
    s_ids, t_ids = make_overlap(rng, 16, 12, 8)
    zs, zt = rng.normal(size=(5, 12)), rng.normal(size=(5, 16)) * 2
    top_ids, top_lps = served_top_k(zt, 3)
    cols = topk_strict_columns(top_ids, top_lps, s_ids,
                               overlap_pairs_by_teacher_id(s_ids, t_ids, 16))

    def total(z):
        return jnp.sum(topk_strict_rows(take_columns(z, cols.student_ids), cols.teacher_logprobs,
                                        cols.valid, kd_loss_fn="rkl"))

    grad = np.asarray(jax.grad(total)(jnp.asarray(zs, jnp.float32)))
    assert np.isfinite(grad).all()

    def reference_total(z):
        return reference_topk_strict(z, zt, s_ids, t_ids, 3, "rkl", 1.0)[0].sum()

    eps = 1e-4
    for r, c in [(0, int(s_ids[0])), (1, int(s_ids[3])), (2, 0), (4, int(s_ids[-1]))]:
        up, down = zs.copy(), zs.copy()
        up[r, c] += eps
        down[r, c] -= eps
        numeric = (reference_total(up) - reference_total(down)) / (2 * eps)
        assert abs(grad[r, c] - numeric) < 2e-3, (r, c, grad[r, c], numeric)
    # Only student columns of V∩ receive gradient.
    outside = np.setdiff1d(np.arange(12), s_ids)
    assert (grad[:, outside] == 0).all()


def test_topk_strict_ignores_ids_past_the_tokenizer_and_neg_inf_entries():
    # The model has 40 rows, the tokenizer (and so the overlap map) only 30.
    s_ids = np.array([0, 1, 2], np.int32)
    t_ids = np.array([5, 6, 7], np.int32)
    table = overlap_pairs_by_teacher_id(s_ids, t_ids, 30)
    top_ids = np.array([[35, 5, 6], [39, 38, 37]])
    top_lps = np.array([[-0.1, -2.0, -np.inf], [-0.5, -1.0, -2.0]], np.float32)
    cols = topk_strict_columns(top_ids, top_lps, s_ids, table)
    np.testing.assert_array_equal(cols.valid, [[False, True, False], [False, False, False]])
    np.testing.assert_array_equal(cols.row_valid, [True, False])
    np.testing.assert_allclose(cols.teacher_mass, [np.exp(-2.0), 0.0], rtol=1e-6)
    rows = topk_strict_rows(jnp.zeros((2, 3)), cols.teacher_logprobs, cols.valid)
    np.testing.assert_array_equal(np.asarray(rows), [0.0, 0.0])  # one column: D = 0


# ------------------------------------------------------------------------------ top-k GKD

def reference_topk_gkd(zs, zt, sampled, k, beta, include_sampled, tail, tau=1.0):
    lp_t = log_softmax(zt)
    lp_s = log_softmax(np.asarray(zs) / tau)
    out = []
    for r in range(zs.shape[0]):
        support = sorted(range(zt.shape[1]), key=lambda i: (-lp_t[r, i], i))[:k]
        if include_sampled and sampled[r] not in support:
            support.append(int(sampled[r]))
        pt = [np.exp(lp_t[r, i]) for i in support]
        ps = [np.exp(lp_s[r, i]) for i in support]
        if tail:
            pt.append(1 - sum(pt))
            ps.append(1 - sum(ps))
        else:
            pt = softmax([lp_t[r, i] / tau for i in support])
            ps = [p / sum(ps) for p in ps]
        out.append(gkd_jsd(ps, pt, beta))
    return np.array(out)


def run_topk_gkd(zs, zt, sampled, k, beta, include_sampled, tail, tau=1.0):
    top_ids, top_lps = served_top_k(zt, k)
    sampled_lps = np.take_along_axis(log_softmax(zt), sampled[:, None], 1)[:, 0]
    support = topk_gkd_support(top_ids, top_lps, sampled, sampled_lps, include_sampled)
    rows = topk_gkd_rows(gather_logprobs(jnp.asarray(zs, jnp.float32), support.ids, tau),
                         support.teacher_logprobs, support.valid, beta=beta, tail=tail,
                         temperature=tau)
    return np.asarray(rows)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("include_sampled", [False, True])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("k", [1, 5])
def test_topk_gkd_equals_brute_force(beta, include_sampled, tail, k):
    rng = np.random.default_rng(int(beta * 10) + 7 * k)
    rows, vocab = 10, 40
    zs, zt = rng.normal(size=(rows, vocab)) * 2, rng.normal(size=(rows, vocab)) * 2
    sampled = rng.integers(0, vocab, rows)
    sampled[0] = np.argmax(zt[0])  # one sampled token already in the top-k
    got = run_topk_gkd(zs, zt, sampled, k, beta, include_sampled, tail)
    want = reference_topk_gkd(zs, zt, sampled, k, beta, include_sampled, tail)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_topk_gkd_without_tail_is_exact_at_a_temperature():
    rng = np.random.default_rng(11)
    zs, zt = rng.normal(size=(6, 30)), rng.normal(size=(6, 30)) * 2
    sampled = rng.integers(0, 30, 6)
    got = run_topk_gkd(zs, zt, sampled, 4, 0.5, True, tail=False, tau=0.6)
    want = reference_topk_gkd(zs, zt, sampled, 4, 0.5, True, tail=False, tau=0.6)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="tail bucket needs"):
        run_topk_gkd(zs, zt, sampled, 4, 0.5, True, tail=True, tau=0.6)


@pytest.mark.parametrize("beta, value", [(0.0, 0.192745), (1.0, 0.223144), (0.5, 0.050672),
                                         (0.1, 0.017473), (0.9, 0.019599)])
@pytest.mark.parametrize("tail", [False, True])
def test_topk_gkd_spec_check_values_when_the_top_k_is_the_whole_vocabulary(beta, value, tail):
    """SPEC §9: p_S = (.5, .5), p_T = (.8, .2). With k = |V| the support holds all the mass
    (the tail is empty up to its 1e-6 floor)."""
    zs = np.log([[0.5, 0.5]])
    zt = np.log([[0.8, 0.2]])
    got = run_topk_gkd(zs, zt, np.array([1]), 2, beta, False, tail)
    np.testing.assert_allclose(got, [value], atol=2e-5 if tail else 2e-6)


def test_topk_gkd_gradient_is_finite_with_a_saturated_top_k():
    """A top-k holding (after rounding) all the teacher's mass must not give NaN or inf."""
    zt = np.array([[30.0, 0.0, -5.0, -5.0]])
    zs = jnp.asarray([[1.0, 0.5, 0.0, -1.0]])
    top_ids, top_lps = served_top_k(zt, 2)
    support = topk_gkd_support(top_ids, top_lps, np.array([0]), top_lps[:, 0], False)
    for beta in (0.0, 0.5, 1.0):
        def total(z):
            return jnp.sum(topk_gkd_rows(gather_logprobs(z, support.ids), support.teacher_logprobs,
                                         support.valid, beta=beta))
        value, grad = jax.value_and_grad(total)(zs)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
