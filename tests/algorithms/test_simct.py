"""SimCT (SPEC §7) against the independent PyTorch reference (values and gradients, both span
score modes, the G(h) mask), its invariants as property tests, metrics and settings."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
import torch_simct  # noqa: E402

from ctopd_jax.algorithms import get_objective  # noqa: E402
from ctopd_jax.algorithms.base import StepInputs  # noqa: E402
from ctopd_jax.align import strict_align  # noqa: E402
from ctopd_jax.collect.collector import HostBatch  # noqa: E402
from ctopd_jax.config import ConfigError, from_dict  # noqa: E402
from ctopd_jax.tokenization import retokenize_pair  # noqa: E402
from ctopd_jax.tokenization.overlap import overlap_map  # noqa: E402

TEXTS = ["12 + 7 = 19, so the answer is 19.", "Let x be 3; then 2x = 6!",
         "naïve café: 数学 😀 ok", "", "The total is 42 apples and 5 pears"]
H = 8


def make_host(t_side, s_side, texts):
    t, s = retokenize_pair(t_side, s_side, [t_side.render_prompt("q")] * len(texts),
                           [s_side.render_prompt("q")] * len(texts), texts, pad_to_multiple=64)
    return HostBatch(s, t, strict_align(t, s), None, list(texts), ["stop"] * len(texts))


def objective(**kw):
    cfg = {"algorithm": {"name": "simct", "chunked_loss_size": 16, **kw}}
    return get_objective(from_dict(cfg).algorithm)


def decoded(side, batch, b):
    """Per-token decoded strings from the byte views (SPEC §7 decision: dummy prefix removed)."""
    lo, hi = batch.resp_offsets[b], batch.resp_offsets[b + 1]
    return [(side.token_bytes[i][1:] if strip else side.token_bytes[i]).decode("utf-8", "replace")
            for i, strip in zip(batch.resp_ids[lo:hi].tolist(), batch.resp_stripped[lo:hi].tolist())]


def random_model(host, overlap, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    n_s = host.student.batch_size * host.student.seq_len
    n_t = host.teacher.batch_size * host.teacher.seq_len
    vs, vt = len(overlap_vocab(host, "s")), len(overlap_vocab(host, "t"))
    return (rng.normal(size=(n_s, H)).astype(np.float32), (scale * rng.normal(size=(H, vs))).astype(np.float32),
            rng.normal(size=(n_t, H)).astype(np.float32), (scale * rng.normal(size=(H, vt))).astype(np.float32))


def overlap_vocab(host, which):
    return range(host.__dict__["_vocab"][which])


def run_jax(obj, host, overlap, hs, ws, ht, wt):
    """(sum, metrics, d sum/d hidden, d sum/d lm_head) of one micro-batch = the whole host batch."""
    arrays = obj.prepare(host, 0, host.size)
    assert arrays.student_ids.shape[1] == host.student.seq_len
    assert arrays.teacher_ids.shape[1] == host.teacher.seq_len
    batch = jax.tree.map(jnp.asarray, arrays)
    t_hidden = jnp.asarray(ht)[batch.teacher_rows]
    ov = {"s_ids": jnp.asarray(overlap.s_ids, jnp.int32), "t_ids": jnp.asarray(overlap.t_ids, jnp.int32)}

    def f(h, w):
        x = StepInputs(h, w, t_hidden, jnp.asarray(wt), batch, ov, None)
        sums, metrics = obj.kd_sums(x)
        return sums["simct"], metrics

    (value, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(jnp.asarray(hs), jnp.asarray(ws))
    return float(value), metrics, np.asarray(grads[0]), np.asarray(grads[1])


def run_torch(host, t_side, s_side, overlap, hs, ws, ht, wt, **kw):
    s_b, t_b = host.student, host.teacher
    hs_t = torch.tensor(hs, requires_grad=True)
    ws_t = torch.tensor(ws, requires_grad=True)
    samples = []
    for b in range(host.size):
        s_rows = s_b.row_base[b] + np.arange(s_b.response_lens[b])
        t_rows = t_b.row_base[b] + np.arange(t_b.response_lens[b])
        samples.append({"s_labels": s_b.labels.reshape(-1)[s_rows], "t_labels": t_b.labels.reshape(-1)[t_rows],
                        "s_dec": decoded(s_side, s_b, b), "t_dec": decoded(t_side, t_b, b),
                        "s_hidden": hs_t[torch.as_tensor(s_rows)], "t_hidden": torch.tensor(ht)[torch.as_tensor(t_rows)]})
    total, counts = torch_simct.simct_loss(samples, ws_t, torch.tensor(wt), torch.as_tensor(overlap.s_ids, dtype=torch.long),
                                           torch.as_tensor(overlap.t_ids, dtype=torch.long), **kw)
    total.backward()
    return float(total.detach()), counts, hs_t.grad.numpy(), ws_t.grad.numpy()


@pytest.fixture(scope="module")
def demo(tiny_bpe, tiny_unigram):
    host = make_host(tiny_bpe, tiny_unigram, TEXTS)
    host.__dict__["_vocab"] = {"s": tiny_unigram.vocab_size, "t": tiny_bpe.vocab_size}
    return host, tiny_bpe, tiny_unigram, overlap_map(tiny_bpe, tiny_unigram)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("mode,div,tau,gh", [("raw_logit", "rkl", 1.0, False),
                                              ("mean_logprob", "rkl", 1.0, True),
                                              pytest.param("mean_logprob", "rkl", 1.0, False, marks=SLOW),
                                              pytest.param("raw_logit", "kl", 2.0, False, marks=SLOW),
                                              pytest.param("mean_logprob", "jsd", 0.7, False, marks=SLOW),
                                              pytest.param("raw_logit", "rkl", 1.0, True, marks=SLOW),
                                              pytest.param("mean_logprob", "tvd", 1.0, True, marks=SLOW)])
def test_matches_torch_reference(demo, mode, div, tau, gh):
    host, t_side, s_side, overlap = demo
    hs, ws, ht, wt = random_model(host, overlap, seed=1)
    if gh:  # a hidden coordinate that moves teacher mass off V∩ by a row-dependent amount
        off = np.setdiff1d(np.arange(wt.shape[1]), overlap.t_ids)
        wt[0] = 0.0
        wt[0, off] = 4.0
        ht[:, 0] = np.random.default_rng(5).uniform(-1.0, 2.0, len(ht))
    obj = objective(span_score_mode=mode, kd_loss_fn=div, kd_temperature=tau, simct_gh_mask=gh)
    got, metrics, g_h, g_w = run_jax(obj, host, overlap, hs, ws, ht, wt)
    want, counts, r_h, r_w = run_torch(host, t_side, s_side, overlap, hs, ws, ht, wt, mode=mode,
                                       divergence_name=div, temperature=tau, gh_mask=gh)
    assert counts["span_rows"] > 0 and counts["rows"] > counts["span_rows"]  # both row kinds
    if gh:
        assert 0 < counts["kept"] < counts["rows"]  # the mask keeps some rows and drops others
    assert float(metrics["simct_kept_row_fraction"][0]) == counts["kept"]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    assert float(metrics["simct_segments_per_sample"][0]) == counts["rows"]
    assert float(metrics["simct_span_row_fraction"][0]) == counts["span_rows"]


@pytest.mark.slow
def test_align_ratio_and_row_counts(demo):
    """align_ratio = Σ_segments max(len_S, len_T) / Σ_samples max(resp_S, resp_T), by hand."""
    host, t_side, s_side, overlap = demo
    obj = objective()
    hs, ws, ht, wt = random_model(host, overlap, seed=2)
    _, metrics, _, _ = run_jax(obj, host, overlap, hs, ws, ht, wt)
    num = den = 0
    for b in range(host.size):
        segs = torch_simct.walk(decoded(t_side, host.teacher, b), decoded(s_side, host.student, b))
        num += sum(max(te - ts, se - ss) for ts, te, ss, se in segs)
        den += max(host.student.response_lens[b], host.teacher.response_lens[b])
    got_num, got_den = metrics["align_ratio"]   # a ratio of sums: (aligned, sample tokens)
    assert (float(got_num), float(got_den)) == (num, den)
    assert 0 < num / den <= 1


def test_per_shard_arrays_stack_and_sum_to_the_whole(demo):
    """The trainer prepares each batch shard on its own and stacks the parts (step.shards.stack_shards);
    the counts behind align_ratio and segments per sample are [1] arrays (0-d scalars made
    stack_shards raise: a crash of every sharded SimCT step), and their per-shard sums (what
    the device psums) equal the whole micro-batch's."""
    from ctopd_jax.step.shards import stack_shards

    host = demo[0]
    obj = objective()
    whole = obj.prepare(host, 0, host.size)
    parts = [obj.prepare(host, i, i + 1) for i in range(host.size)]
    stacked = stack_shards(parts)
    for key in ("simct_aligned_tokens", "simct_sample_tokens", "simct_samples"):
        one, all_ = getattr(whole.terms, key), getattr(stacked.terms, key)
        assert one.shape == (1,) and all_.shape == (host.size,)
        assert all_.sum() == one.sum()
    assert stacked.terms.simct_weight.sum() == whole.terms.simct_weight.sum()


@pytest.fixture(scope="module")
def same_pair(tiny_bpe):
    return tiny_bpe, overlap_map(tiny_bpe, tiny_bpe)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet="ab 12+=.x", max_size=12), min_size=1, max_size=3),
       seed=st.integers(0, 10_000), mode=st.sampled_from(["raw_logit", "mean_logprob"]))
def test_equals_strict_full_when_every_segment_is_one_to_one(same_pair, texts, seed, mode):
    """One tokenizer on both sides: every segment is 1:1 (segments = strict pairs), so SimCT is
    Strict full on those rows (V∩ = V there, so mean_logprob's full log-softmax columns give
    the same row too)."""
    side, overlap = same_pair
    host = make_host(side, side, texts)
    host.__dict__["_vocab"] = {"s": side.vocab_size, "t": side.vocab_size}
    hs, ws, ht, wt = random_model(host, overlap, seed)
    got, metrics, g_h, g_w = run_jax(objective(span_score_mode=mode), host, overlap, hs, ws, ht, wt)
    assert float(metrics["simct_span_row_fraction"][0]) == 0
    strict = get_objective(from_dict({"algorithm": {"name": "strict", "chunked_loss_size": 16}}).algorithm)
    batch = jax.tree.map(jnp.asarray, strict.prepare(host, 0, host.size))
    ov = {"s_ids": jnp.asarray(overlap.s_ids, jnp.int32), "t_ids": jnp.asarray(overlap.t_ids, jnp.int32)}

    def f(h, w):
        x = StepInputs(h, w, jnp.asarray(ht)[batch.teacher_rows], jnp.asarray(wt), batch, ov, None)
        return strict.kd_sums(x)[0]["strict"]

    want, (w_h, w_w) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(hs), jnp.asarray(ws))
    np.testing.assert_allclose(got, float(want), rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(g_h, np.asarray(w_h), rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(g_w, np.asarray(w_w), rtol=1e-3, atol=1e-5)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), shift=st.floats(-30, 30))
def test_mean_logprob_rows_invariant_to_a_constant_per_position(demo, seed, shift):
    """Adding c_p to every logit of position p (any p, either side) leaves mean_logprob's loss
    unchanged: the hidden states get one more coordinate c_p and the lm_heads a row of ones."""
    host, _, _, overlap = demo
    hs, ws, ht, wt = random_model(host, overlap, seed)
    rng = np.random.default_rng(seed)
    obj = objective(span_score_mode="mean_logprob")

    def extend(h, w, c):
        return np.concatenate([h, c[:, None]], 1).astype(np.float32), np.concatenate([w, np.ones((1, w.shape[1]))]).astype(np.float32)

    base = run_jax(obj, host, overlap, *extend(hs, ws, np.zeros(len(hs))), *extend(ht, wt, np.zeros(len(ht))))[0]
    c_s = shift * rng.random(len(hs))
    c_t = shift * rng.random(len(ht))
    moved = run_jax(obj, host, overlap, *extend(hs, ws, c_s), *extend(ht, wt, c_t))[0]
    np.testing.assert_allclose(moved, base, rtol=1e-4, atol=1e-4)
    # The released mode is not invariant: its span rows score the summed raw logits, so a large
    # per-position shift (fixed, so a tiny drawn shift cannot hide it) moves the loss.
    raw = objective(span_score_mode="raw_logit")
    r0 = run_jax(raw, host, overlap, *extend(hs, ws, np.zeros(len(hs))), *extend(ht, wt, np.zeros(len(ht))))[0]
    big_s, big_t = 30 * rng.random(len(hs)), 30 * rng.random(len(ht))
    r1 = run_jax(raw, host, overlap, *extend(hs, ws, big_s), *extend(ht, wt, big_t))[0]
    assert abs(r1 - r0) > 10 * abs(moved - base) + 1e-3


@pytest.mark.slow
def test_chunked_equals_unchunked(demo):
    """chunked_loss_size splits the rows; the sum and gradients do not change (SPEC §1)."""
    host, _, _, overlap = demo
    hs, ws, ht, wt = random_model(host, overlap, seed=3)
    a = run_jax(objective(chunked_loss_size=4), host, overlap, hs, ws, ht, wt)
    b = run_jax(objective(chunked_loss_size=4096), host, overlap, hs, ws, ht, wt)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    np.testing.assert_allclose(a[3], b[3], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("field,value", [("span_score_mode", "mean_logit"), ("simct_gh_mask", "maybe")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        from_dict({"algorithm": {"name": "simct", field: value}})


REAL_TEXTS = ["数学很有趣 😀😀 — naïve café ½ × 3 = 1.5", "so the answer is 7 <|im_end|> then more",
              "truncated mid-character: 答\ufffd", "We build models. 12 + 30 = 42", ""]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raw_logit", "mean_logprob"])
def test_real_pair_edge_cases_match_torch_reference(qwen, llama, mode):
    """Qwen2.5 teacher -> Llama-3 student at the real vocabularies: CJK, emoji, an added token
    in a response, a split UTF-8 tail, an empty response (values and gradients)."""
    host = make_host(qwen, llama, REAL_TEXTS)
    host.__dict__["_vocab"] = {"s": llama.vocab_size, "t": qwen.vocab_size}
    overlap = overlap_map(qwen, llama)
    hs, ws, ht, wt = random_model(host, overlap, seed=4, scale=0.3)
    got, metrics, g_h, g_w = run_jax(objective(span_score_mode=mode), host, overlap, hs, ws, ht, wt)
    want, counts, r_h, r_w = run_torch(host, qwen, llama, overlap, hs, ws, ht, wt, mode=mode)
    assert counts["span_rows"] > 0
    np.testing.assert_allclose(got, want, rtol=5e-5, atol=1e-4)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    aligned, total = metrics["align_ratio"]
    assert float(aligned) < float(total)  # the split tail leaves tokens unsegmented
