"""The span objective (SPEC §6) through the project's own path — re-tokenized batch, strict
alignment, `SpanLoss.prepare` (group_arrays) and `SpanLoss.loss_sums` — against:

* SPEC §6's check value 0.049793 (student [We][ build][ models][.] vs teacher
  [We][ bu][ild][ models][.]) on a hand-built batch, with the metrics against a hand count;
* an independent PyTorch reference (tests/reference/torch_span.py: byte groups written from
  SPEC §2, full-vocabulary path log-probs, squared group differences; the strict part from
  tests/reference/torch_strict.py) on real re-tokenized batches of the committed tiny
  tokenizers: values and gradients w.r.t. the student hidden states and lm_head (torch
  autograd), whole batch and a rebased micro-batch;
* λ = 0: the loss and gradient are bitwise those of `strict` / `topk_strict`.
"""
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ctopd_jax.algorithms.span import SpanLoss, SpanSettings
from ctopd_jax.algorithms.strict import StrictFull, StrictSettings, StrictTopK
from ctopd_jax.align import strict_align
from ctopd_jax.collect.collector import HostBatch
from ctopd_jax.tokenization.retokenize import RetokenizedBatch, retokenize_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
import torch_span  # noqa: E402  (independent PyTorch reference)
import torch_strict  # noqa: E402


# ---------------------------------------------------------------------------------------------
# SPEC §6 check value on a hand-built batch
# ---------------------------------------------------------------------------------------------

IGNORE = -100


def _side(prompt, pieces, ids, eos, seq_len):
    """One-sample RetokenizedBatch by hand: `prompt` ids, response pieces (bytes) with `ids`,
    then EOS; logits row p predicts token p + 1."""
    full = list(prompt) + list(ids) + [eos]
    input_ids = np.zeros((1, seq_len), np.int32)
    input_ids[0, :len(full)] = full
    attention = np.zeros((1, seq_len), bool)
    attention[0, :len(full)] = True
    loss_mask = np.zeros((1, seq_len), bool)
    loss_mask[0, len(prompt) - 1:len(full) - 1] = True
    labels = np.full((1, seq_len), IGNORE, np.int32)
    labels[0, :-1] = np.where(loss_mask[0, :-1], input_ids[0, 1:], IGNORE)
    n = len(ids)
    return RetokenizedBatch(
        input_ids=input_ids, loss_mask=loss_mask, labels=labels, attention_mask=attention,
        prompt_lens=np.array([len(prompt)], np.int32), response_lens=np.array([n + 1], np.int32),
        resp_offsets=np.array([0, n], np.int64), resp_ids=np.asarray(ids, np.int32),
        resp_byte_len=np.array([len(p) for p in pieces], np.int64),
        resp_pairable=np.ones(n, bool), resp_stripped=np.zeros(n, bool),
        resp_bytes=[b"".join(pieces)], responses=[b"".join(pieces).decode()], eos_id=eos)


def _log_probs_rows(rows, vocab, picks):
    """[rows, vocab] normalised log-probability rows: picks {row: (column, probability)}, the
    remaining mass spread evenly over the other columns; used as logits (logsumexp = 0)."""
    out = np.full((rows, vocab), -math.log(vocab), np.float64)
    for r, (col, p) in picks.items():
        out[r] = math.log((1 - p) / (vocab - 1))
        out[r, col] = math.log(p)
    return out.astype(np.float32)


def _check_case():
    # student ids: 1 prompt, 2 We, 3 " build", 4 " models", 5 ".", 6 EOS (vocab 11)
    # teacher ids: 1 prompt, 2 We, 3 " bu", 4 "ild", 5 " models", 6 ".", 7 EOS (vocab 13)
    student = _side([1], [b"We", b" build", b" models", b"."], [2, 3, 4, 5], 6, 8)
    teacher = _side([1], [b"We", b" bu", b"ild", b" models", b"."], [2, 3, 4, 5, 6], 7, 8)
    return student, teacher


def test_spec_check_value_and_hand_counted_metrics():
    student, teacher = _check_case()
    alignment = strict_align(teacher, student)
    # SPEC: strict pairs (0,0), (3,2), (4,3) (+ the EOS pair), one 2:1 group
    t_tok = alignment.teacher_rows - teacher.row_base[0]
    s_tok = alignment.student_rows - student.row_base[0]
    assert list(zip(t_tok.tolist(), s_tok.tolist())) == [(0, 0), (3, 2), (4, 3), (5, 4)]
    assert alignment.mismatch_size_histogram() == {(2, 1): 1}

    host = HostBatch(student, teacher, alignment, None, student.responses, ["stop"])
    obj = SpanLoss(SpanSettings(name="span", span_lambda=1.0, span_base="strict"))
    arrays = obj.prepare(host, 0, 1)
    batch = jax.tree.map(jnp.asarray, arrays)
    t_s, t_t = arrays.student_ids.shape[1], arrays.teacher_ids.shape[1]
    # one-hot hidden rows: the logits of row r are lm_head row r, chosen as log-probabilities
    hidden = jnp.eye(t_s, dtype=jnp.float32)
    lm_head = jnp.asarray(_log_probs_rows(t_s, 11, {1: (3, 0.25)}))      # q_S(" build") = 0.25
    t_head = jnp.asarray(_log_probs_rows(t_t, 13, {1: (3, 0.5), 2: (4, 0.4)}))  # q_T = 0.5·0.4
    t_hidden = jnp.eye(t_t, dtype=jnp.float32)[batch.teacher_rows]
    overlap = {"s_ids": jnp.array([1, 2, 4, 5, 6], jnp.int32), "t_ids": jnp.array([1, 2, 5, 6, 7], jnp.int32)}
    sums, metrics = obj.loss_sums(hidden, lm_head, t_hidden, t_head, batch, overlap)
    assert float(sums["span"]) == pytest.approx(0.049793, abs=5e-7)
    # hand count: 1 mismatch group holding 1 of the 5 student response tokens (EOS included)
    assert float(metrics["mismatch_groups"][0]) == 1.0
    num, den = metrics["mismatch_token_fraction"]
    assert (float(num), float(den)) == (1.0, 5.0)


# ---------------------------------------------------------------------------------------------
# Real re-tokenized batches of the tiny pair vs the PyTorch reference
# ---------------------------------------------------------------------------------------------

RESPONSES = ["The answer is 7.", "Zebra quizzically jumps; xylophone!", "(3+4)=7. The answer is 7.",
             "12345 + 67890 = 80235", "hello world, HELLO WORLD", "aaaa bbbb cccc ;;; ??? ..."]


@pytest.fixture(scope="module")
def real_host(tiny_bpe, tiny_unigram):
    messages = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in
                ((3, 4), (1, 2), (3, 4), (12, 7), (5, 5), (8, 1))]
    t_rt, s_rt = retokenize_pair(tiny_bpe, tiny_unigram, [tiny_bpe.render_chat(m) for m in messages],
                                 [tiny_unigram.render_chat(m) for m in messages], RESPONSES,
                                 pad_to_multiple=16)
    alignment = strict_align(t_rt, s_rt)
    assert not alignment.byte_mismatch.any() and len(alignment.mismatch_groups) >= 5
    return HostBatch(s_rt, t_rt, alignment, None, RESPONSES, [])


def _token_bytes(side, b):
    lo, hi = side.resp_offsets[b], side.resp_offsets[b + 1]
    ends = np.cumsum(side.resp_byte_len[lo:hi])
    starts = ends - side.resp_byte_len[lo:hi]
    return [side.resp_bytes[b][s:e] for s, e in zip(starts, ends)]


def _reference(host, start, stop, t_s, t_t, hidden, lm_head, t_full, t_head, s_ids, t_ids, lam):
    """Strict-full rkl + λ·span over samples [start, stop) in torch, from the batch's tokens
    and byte views only; gradients w.r.t. the student hidden rows and lm_head."""
    h = torch.tensor(hidden, requires_grad=True)
    w = torch.tensor(lm_head, requires_grad=True)
    tf, th = torch.tensor(t_full), torch.tensor(t_head)
    strict = torch.zeros(())
    span = torch.zeros(())
    groups_total = tokens_in_groups = 0
    s, t = host.student, host.teacher
    for b in range(start, stop):
        i = b - start
        n_s, n_t = int(s.response_lens[b]), int(t.response_lens[b])
        s_rows = i * t_s + int(s.prompt_lens[b]) - 1 + np.arange(n_s)
        t_rows = i * t_t + int(t.prompt_lens[b]) - 1 + np.arange(n_t)
        zs = h[torch.as_tensor(s_rows)] @ w
        zt = tf[torch.as_tensor(t_rows)] @ th
        s_targets = torch.as_tensor(s.input_ids[b, s.prompt_lens[b]:s.prompt_lens[b] + n_s], dtype=torch.long)
        t_targets = torch.as_tensor(t.input_ids[b, t.prompt_lens[b]:t.prompt_lens[b] + n_t], dtype=torch.long)
        lp_s = torch.log_softmax(zs, -1).gather(-1, s_targets[:, None])[:, 0]
        lp_t = torch.log_softmax(zt, -1).gather(-1, t_targets[:, None])[:, 0]
        groups = torch_span.byte_groups(_token_bytes(t, b), _token_bytes(s, b))
        pairs = [(g[0][0], g[1][0]) for g in groups if g[2]] + [(n_t - 1, n_s - 1)]  # + EOS pair
        p_t = torch.as_tensor([p[0] for p in pairs])
        p_s = torch.as_tensor([p[1] for p in pairs])
        strict = strict + torch_strict.strict_rows("rkl", zs[p_s], zt[p_t], s_ids, t_ids).sum()
        span = span + torch_span.span_loss(lp_s, lp_t, groups)
        g, n = torch_span.mismatch_counts(groups)
        groups_total, tokens_in_groups = groups_total + g, tokens_in_groups + n
    total = strict + lam * span
    total.backward()
    return (float(strict.detach()), float(span.detach()), h.grad.numpy(), w.grad.numpy(),
            groups_total, tokens_in_groups)


def _random_model_arrays(arrays, v_s, v_t, seed=0, h_s=16, h_t=24, shared=300):
    rng = np.random.default_rng(seed)
    m, t_s = arrays.student_ids.shape
    t_t = arrays.teacher_ids.shape[1]
    hidden = rng.normal(size=(m * t_s, h_s)).astype(np.float32)
    lm_head = (rng.normal(size=(h_s, v_s)) * 0.5).astype(np.float32)
    t_full = rng.normal(size=(m * t_t, h_t)).astype(np.float32)
    t_head = (rng.normal(size=(h_t, v_t)) * 0.5).astype(np.float32)
    s_ids = rng.permutation(v_s)[:shared].astype(np.int32)
    t_ids = rng.permutation(v_t)[:shared].astype(np.int32)
    return hidden, lm_head, t_full, t_head, s_ids, t_ids


def _jax_value_and_grad(obj, arrays, hidden, lm_head, t_full, t_head, s_ids, t_ids):
    batch = jax.tree.map(jnp.asarray, arrays)
    t_hidden = jnp.asarray(t_full)[batch.teacher_rows]
    overlap = {"s_ids": jnp.asarray(s_ids), "t_ids": jnp.asarray(t_ids)}
    weights = obj.kd_weights()

    def f(h, w):
        sums, metrics = obj.loss_sums(h, w, t_hidden, jnp.asarray(t_head), batch, overlap)
        total = sum(weights[k] * sums[k] for k in weights if weights[k] != 0.0)
        return total, (sums, metrics)

    (_, (sums, metrics)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(hidden), jnp.asarray(lm_head))
    return sums, metrics, [np.asarray(g) for g in grads]


@pytest.mark.parametrize("start,stop,lam", [(0, 6, 0.7), pytest.param(3, 6, 1.5, marks=pytest.mark.slow)])
def test_span_objective_matches_torch_reference(real_host, start, stop, lam):
    obj = SpanLoss(SpanSettings(name="span", span_lambda=lam, span_base="strict", kd_loss_fn="rkl",
                                chunked_loss_size=64))
    arrays = obj.prepare(real_host, start, stop)
    v_s = int(max(real_host.student.input_ids.max(), 900)) + 1
    v_t = int(max(real_host.teacher.input_ids.max(), 799)) + 1
    model = _random_model_arrays(arrays, v_s, v_t, seed=start)
    sums, metrics, (g_h, g_w) = _jax_value_and_grad(obj, arrays, *model)
    t_s, t_t = arrays.student_ids.shape[1], arrays.teacher_ids.shape[1]
    strict, span, r_h, r_w, groups, tokens = _reference(real_host, start, stop, t_s, t_t, *model, lam)

    assert groups > 0 and span > 0
    assert float(sums["strict"]) == pytest.approx(strict, rel=1e-5)
    assert float(sums["span"]) == pytest.approx(span, rel=1e-5)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-4, atol=1e-5 * np.abs(r_h).max())
    np.testing.assert_allclose(g_w, r_w, rtol=1e-4, atol=1e-5 * np.abs(r_w).max())
    assert float(metrics["mismatch_groups"][0]) == groups
    num, den = metrics["mismatch_token_fraction"]
    assert float(num) == tokens
    assert float(den) == real_host.student.response_lens[start:stop].sum()


def test_span_gradient_reaches_every_student_token_of_a_group_and_nothing_else(real_host):
    """Span-only gradient (λ weight on the span sum alone): non-zero exactly on the student
    hidden rows of the mismatch groups."""
    obj = SpanLoss(SpanSettings(name="span", span_lambda=1.0, span_base="strict"))
    arrays = obj.prepare(real_host, 0, real_host.size)
    hidden, lm_head, t_full, t_head, s_ids, t_ids = _random_model_arrays(arrays, 901, 800, seed=5)
    batch = jax.tree.map(jnp.asarray, arrays)
    t_hidden = jnp.asarray(t_full)[batch.teacher_rows]
    overlap = {"s_ids": jnp.asarray(s_ids), "t_ids": jnp.asarray(t_ids)}
    g = jax.jit(jax.grad(lambda h: obj.loss_sums(h, jnp.asarray(lm_head), t_hidden, jnp.asarray(t_head),
                                                 batch, overlap)[0]["span"]))(jnp.asarray(hidden))
    touched = set(np.flatnonzero(np.abs(np.asarray(g)).sum(axis=1)).tolist())
    t_s = arrays.student_ids.shape[1]
    expected = set()
    for b, _t0, _t1, s0, s1 in real_host.alignment.mismatch_groups:
        base = b * t_s - b * real_host.student.seq_len   # rebase host rows to micro-batch rows
        expected.update(range(int(s0) + base, int(s1) + base))
    assert touched == expected


@pytest.mark.parametrize("base,strict_cls", [("strict", StrictFull), ("topk_strict", StrictTopK)])
def test_lambda_zero_is_bitwise_the_strict_objective(real_host, base, strict_cls):
    span_obj = SpanLoss(SpanSettings(name="span", span_lambda=0.0, span_base=base, ctkd_topk=16))
    strict_obj = strict_cls(StrictSettings(name=base, ctkd_topk=16))
    results = []
    for obj in (span_obj, strict_obj):
        arrays = obj.prepare(real_host, 0, real_host.size)
        model = _random_model_arrays(arrays, 901, 800, seed=11)
        batch = jax.tree.map(jnp.asarray, arrays)
        t_hidden = jnp.asarray(model[2])[batch.teacher_rows]
        overlap = {"s_ids": jnp.asarray(model[4]), "t_ids": jnp.asarray(model[5])}
        weights = obj.loss_weights()

        def loss(h, w, obj=obj, batch=batch, t_hidden=t_hidden, overlap=overlap, weights=weights):
            sums = obj.loss_sums(h, w, t_hidden, jnp.asarray(model[3]), batch, overlap)[0]
            return sum(weights[k] * sums[k] for k in weights if weights[k] != 0.0)

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(model[0]),
                                                                          jnp.asarray(model[1]))
        results.append((np.asarray(value), *(np.asarray(g) for g in grads)))
    (v0, gh0, gw0), (v1, gh1, gw1) = results
    assert v0 > 0 and np.abs(gh0).sum() > 0
    np.testing.assert_array_equal(v0, v1)
    np.testing.assert_array_equal(gh0, gh1)
    np.testing.assert_array_equal(gw0, gw1)
