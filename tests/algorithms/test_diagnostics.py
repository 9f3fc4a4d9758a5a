"""Gradient diagnostics of SPEC §6 (`diagnostics.unit_statistics`) against torch autograd.

A tiny random HF Llama (the reference) is loaded into the project's Decoder; on a real
re-tokenized, aligned batch of the committed tiny tokenizer pair the whole-parameter-vector
gradients of the strict loss, the span loss and the strict loss on two halves of the strict
pairs are computed by torch autograd on the HF model, flattened, and compared (cosines, norm
ratio) with the project's jax.grad trees. The teacher is a constant: random hidden rows and
lm_head, the same arrays on both sides. Also: two halves holding the same pairs (every strict
pair duplicated) give a control cosine of exactly 1 up to rounding.
"""
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from ctopd_jax.algorithms import get_objective, padded_rows
from ctopd_jax.algorithms.span import SpanLoss, SpanSettings
from ctopd_jax.align import strict_align
from ctopd_jax.collect.collector import HostBatch
from ctopd_jax.config import ConfigError, load_config
from ctopd_jax.step.diagnostics import Diagnostics, unit_statistics
from ctopd_jax.tokenization.retokenize import retokenize_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
import torch_span  # noqa: E402  (independent PyTorch reference)
import torch_strict  # noqa: E402
from _hf_tiny import load_pair  # noqa: E402

RESPONSES = ["Zebra quizzically jumps; xylophone!", "(3+4)=7. The answer is 7.",
             "12345 + 67890 = 80235", "hello world, HELLO WORLD"]
V_T, H_T = 800, 24


@pytest.fixture(scope="module")
def setup(tiny_bpe, tiny_unigram, tmp_path_factory):
    messages = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in
                ((1, 2), (3, 4), (12, 7), (5, 5))]
    t_rt, s_rt = retokenize_pair(tiny_bpe, tiny_unigram, [tiny_bpe.render_chat(m) for m in messages],
                                 [tiny_unigram.render_chat(m) for m in messages], RESPONSES,
                                 pad_to_multiple=16)
    alignment = strict_align(t_rt, s_rt)
    host = HostBatch(s_rt, t_rt, alignment, None, RESPONSES, [])
    v_s = max(901, int(s_rt.input_ids.max()) + 1)   # tiny_unigram has 901 entries
    hf, model, _ = load_pair("llama", tmp_path_factory.mktemp("diag_llama"), seed=3, vocab_size=v_s,
                             hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16)
    return host, hf.float(), model, v_s


def _half_a(weight, seed=7):
    split = np.random.default_rng(seed).permutation(int(weight.sum()))
    half = np.zeros_like(weight)
    half[split[: len(split) // 2]] = 1.0
    return half


def _teacher(arrays, seed=0):
    rng = np.random.default_rng(seed)
    t_hidden = rng.normal(size=(len(arrays.teacher_rows), H_T)).astype(np.float32)
    t_head = (rng.normal(size=(H_T, V_T)) * 0.5).astype(np.float32)
    return t_hidden, t_head


def _torch_grads(hf, arrays, t_hidden, t_head, s_ids, t_ids, half_a):
    """(g_strict, g_span, g_half_a, g_half_b) over every HF parameter, by torch autograd."""
    params = [p for p in hf.parameters()]
    ids = torch.as_tensor(arrays.student_ids, dtype=torch.long)
    mask = torch.as_tensor(arrays.student_mask, dtype=torch.long)
    strict_n = len(arrays.terms.strict_weight)
    zt_all = torch.tensor(t_hidden) @ torch.tensor(t_head)

    def losses():
        logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        flat = logits.reshape(-1, logits.shape[-1])
        w = torch.tensor(arrays.terms.strict_weight)
        rows = torch.as_tensor(arrays.terms.strict_student_rows, dtype=torch.long)
        per_pair = torch_strict.strict_rows("rkl", flat[rows], zt_all[:strict_n], s_ids, t_ids)
        per_pair = torch.where(w > 0, per_pair, torch.zeros(()))
        # span: group sums of full-vocabulary log-probs of the realised tokens on both sides
        resp_rows = torch.as_tensor(arrays.response_rows, dtype=torch.long)
        resp_targets = torch.as_tensor(arrays.response_targets, dtype=torch.long)
        lp_s = torch.log_softmax(flat[resp_rows], -1).gather(-1, resp_targets[:, None])[:, 0]
        t_lp = torch.log_softmax(zt_all[strict_n:], -1).gather(
            -1, torch.as_tensor(arrays.terms.span_teacher_targets, dtype=torch.long)[:, None])[:, 0]
        n_groups = int(arrays.terms.span_group_weight.sum())
        n_s, n_t = int(arrays.terms.span_student_weight.sum()), int(arrays.terms.span_teacher_weight.sum())
        q_s = torch.zeros(n_groups).index_add(0, torch.as_tensor(arrays.terms.span_student_group[:n_s], dtype=torch.long),
                                              lp_s[torch.as_tensor(arrays.terms.span_student_index[:n_s], dtype=torch.long)])
        q_t = torch.zeros(n_groups).index_add(0, torch.as_tensor(arrays.terms.span_teacher_group[:n_t], dtype=torch.long),
                                              t_lp[:n_t].detach())
        return per_pair, ((q_s - q_t) ** 2).sum()

    def grad(loss):
        return [g if g is not None else torch.zeros_like(p)
                for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True), params)]

    half = torch.tensor(half_a)
    per_pair, span = losses()
    return (grad(per_pair.sum()), grad(span), grad((per_pair * half).sum()),
            grad((per_pair * (1 - half)).sum()))


def _jax_stats(model, arrays, t_hidden, t_head, s_ids, t_ids, half_a, objective):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jax.tree.map(jnp.asarray, arrays)
    overlap = {"s_ids": jnp.asarray(s_ids), "t_ids": jnp.asarray(t_ids)}
    stats = unit_statistics(params, rest, batch, jnp.asarray(t_hidden), jnp.asarray(t_head), overlap,
                            jnp.asarray(half_a), graphdef=graphdef,
                            comparison=objective.gradient_comparison())
    return [float(s) for s in stats], params


@pytest.mark.slow
def test_unit_statistics_match_torch_autograd(setup):
    host, hf, model, v_s = setup
    objective = SpanLoss(SpanSettings(name="span", span_base="strict", kd_loss_fn="rkl"))
    arrays = objective.prepare(host, 0, host.size)
    assert arrays.terms.span_group_weight.sum() >= 3 and arrays.terms.strict_weight.sum() >= 20
    t_hidden, t_head = _teacher(arrays)
    rng = np.random.default_rng(1)
    s_ids = rng.permutation(v_s)[:500].astype(np.int32)
    t_ids = rng.permutation(V_T)[:500].astype(np.int32)
    half_a = _half_a(arrays.terms.strict_weight)
    (cos_mis, ratio, cos_ctl), params = _jax_stats(model, arrays, t_hidden, t_head, s_ids, t_ids,
                                                   half_a, objective)

    g_strict, g_span, g_a, g_b = _torch_grads(hf, arrays, t_hidden, t_head, s_ids, t_ids, half_a)
    # same parameter vector on both sides (as a multiset of entries: cosines and norms are
    # invariant to the layout)
    assert sum(g.numel() for g in g_strict) == sum(x.size for x in jax.tree.leaves(params))
    ref_cos_mis, ref_ratio = torch_span.flat_cosine_and_ratio(g_strict, g_span)
    ref_cos_ctl, _ = torch_span.flat_cosine_and_ratio(g_a, g_b)
    assert cos_mis == pytest.approx(ref_cos_mis, abs=2e-4)
    assert ratio == pytest.approx(ref_ratio, rel=2e-4)
    assert cos_ctl == pytest.approx(ref_cos_ctl, abs=2e-4)
    # the numbers are informative: not at the clip values
    assert abs(ref_cos_mis) < 0.999 and abs(ref_cos_ctl) < 0.999 and ref_ratio > 0


@pytest.mark.slow
def test_identical_halves_give_control_cosine_one(setup):
    """Every strict pair duplicated, half A = the first copies, half B = the second: both
    halves hold the same pairs, so their strict gradients are equal and the cosine is 1."""
    host, _, model, v_s = setup
    objective = SpanLoss(SpanSettings(name="span", span_base="topk_strict", ctkd_topk=16))
    arrays = objective.prepare(host, 0, host.size)
    n = int(arrays.terms.strict_weight.sum())
    size = padded_rows.rows_bucket(2 * n)
    pairs = arrays.terms
    twice = lambda rows: padded_rows.padded(np.concatenate([rows[:n], rows[:n]]), size)[0]  # noqa: E731
    dup = dataclasses.replace(arrays, terms=dataclasses.replace(
        pairs, strict_student_rows=twice(pairs.strict_student_rows),
        strict_teacher_rows=twice(pairs.strict_teacher_rows), strict_weight=padded_rows.padded(np.zeros(2 * n), size)[1]))
    t_hidden, t_head = _teacher(arrays)
    strict_rows = len(arrays.terms.strict_weight)
    strict_hidden = np.zeros((size, H_T), np.float32)
    strict_hidden[:2 * n] = np.concatenate([t_hidden[:n], t_hidden[:n]])
    t_dup = np.concatenate([strict_hidden, t_hidden[strict_rows:]])
    half_a = np.zeros(size, np.float32)
    half_a[:n] = 1.0
    rng = np.random.default_rng(2)
    s_ids = rng.permutation(v_s)[:500].astype(np.int32)
    t_ids = rng.permutation(V_T)[:500].astype(np.int32)
    (cos_mis, ratio, cos_ctl), _ = _jax_stats(model, dup, t_dup, t_head, s_ids, t_ids, half_a, objective)
    assert cos_ctl == pytest.approx(1.0, abs=1e-5)
    # and the duplicated unit is still a real one: span and strict gradients exist and differ
    assert ratio > 0 and abs(cos_mis) < 0.999


def test_an_objective_with_nothing_to_compare_is_refused_naming_those_that_have():
    """The diagnostics take their two terms from the objective (gradient_comparison); one
    without is one line, listing the objectives that have them (read from the registry)."""
    config = load_config(None, ["algorithm.name=simct", "algorithm.diagnostics_every=1"])
    with pytest.raises(ConfigError, match=r"^algorithm\.diagnostics_every: objective 'simct' has no "
                                          r"terms to compare; use span, strict, topk_strict, or set it to 0$"):
        Diagnostics(config, get_objective(config.algorithm), prompts=[])
    for name in ("strict", "topk_strict", "span"):
        c = get_objective(load_config(None, [f"algorithm.name={name}"]).algorithm).gradient_comparison()
        assert (c.objective.name, c.trained, c.compared, c.weight) == ("span", "strict", "span", "strict_weight")
        assert c.objective.settings.span_base == ("topk_strict" if name == "topk_strict" else "strict")

