"""MP-OPD (SPEC §8): check values, the seed rule, credit conservation, the LM-head Gram matrix,
and every mode against the independent PyTorch reference (values and gradients)."""
import hashlib
import random
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "align"))
import torch_mp_opd  # noqa: E402
from _align_oracle import atoms_oracle  # noqa: E402

from ctopd_jax.algorithms import get_objective, mp_opd_credits, mp_opd_device  # noqa: E402
from ctopd_jax.algorithms.base import StepInputs  # noqa: E402
from ctopd_jax.align import strict_align  # noqa: E402
from ctopd_jax.collect.collector import HostBatch  # noqa: E402
from ctopd_jax.config import ConfigError, from_dict  # noqa: E402
from ctopd_jax.tokenization import retokenize_pair  # noqa: E402

H = 8
TEXTS = ["Tom has 12 apples and buys 7 more, so he has 12 + 7 = 19 apples; then he eats 3 and keeps 16.",
         "Let x be 3; then 2x = 6!", "", "The total is 42 apples and 5 pears", "x <|im_end|> y"]


# -- SPEC check values ---------------------------------------------------------------------------
def test_spec_check_values():
    b, w = [0.6, -0.2, 0.3], [1, 2, 1]
    np.testing.assert_allclose(mp_opd_credits.partition_rates(b, w, mp_opd_credits.sample_spans("atomic", w, 0, 43, 2)),
                               [0.6, -0.1, 0.3])
    np.testing.assert_allclose(mp_opd_credits.partition_rates(b, w, mp_opd_credits.sample_spans("fixed2", w, 0, 43, 2)),
                               [0.1333333, 0.1333333, 0.3], rtol=1e-6)
    r, wr = np.array([1.0, -0.5, 2.0]), np.array([1.0, 2.0, 1.0])
    shrunk = mp_opd_credits.shrink(r, wr, 0.4)
    np.testing.assert_allclose(shrunk, [0.8, -0.1, 1.4])
    assert (wr * r).sum() / wr.sum() == 0.5
    np.testing.assert_allclose((wr * shrunk).sum(), 2.0)  # = Σ b = Σ w·r
    assert mp_opd_credits.seed_text(43, 0, [1, 2, 1]) == "43:0:[1.0, 2.0, 1.0]"


def _spec_seed_rule(w, row, seed, lo, hi):  # written again from SPEC §8, beside the reference's
    digest = hashlib.sha256(f"{seed}:{row}:{[float(v) for v in w]}".encode("utf-8")).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    spans, at = [], 0
    while at < len(w):
        top = min(hi, len(w) - at)
        k = rng.randint(min(lo, top), top)
        spans.append((at, at + k))
        at += k
    return spans


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=30), st.integers(0, 7), st.integers(0, 1000),
       st.sampled_from([(1, 2), (2, 5)]))
def test_random_partition_follows_the_seed_rule(w, row, seed, bounds):
    got = mp_opd_credits.random_spans(w, row, seed, *bounds)
    assert got == _spec_seed_rule(w, row, seed, *bounds)
    assert [list(range(a, b)) for a, b in got] == torch_mp_opd.seeded_partition(w, row, seed, *bounds)
    assert got[0][0] == 0 and got[-1][1] == len(w) and all(a[1] == b[0] for a, b in zip(got, got[1:]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(1, 5)), min_size=1, max_size=24),
       st.sampled_from(["atomic", "fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2",
                        "random2-5", "grass_chunk"]),
       st.integers(0, 3), st.integers(2, 5), st.floats(0, 2), st.integers(0, 2**31))
def test_credit_conserving_modes_keep_the_sum(atoms, mode, row, chunk, noise_ema, seed):
    """Σ_i w_i·rate_i = Σ_i b_i for every partition and for GRASS (any PSD H, any noise)."""
    b = np.array([a[0] for a in atoms])
    w = np.array([a[1] for a in atoms], float)
    spans = mp_opd_credits.sample_spans(mode, w.tolist(), row, 43, chunk)
    if mode == "grass_chunk":
        rng = np.random.default_rng(seed % 1000)
        grams = []
        for s, e in spans:
            g = rng.normal(size=(e - s, 3))
            grams.append(g @ g.T)
        noise = mp_opd_credits.GrassNoise(noise_ema, 3)
        rates, _, _ = mp_opd_credits.grass_sample(b, w, spans, grams, noise)
    else:
        rates = mp_opd_credits.partition_rates(b, w, spans)
    np.testing.assert_allclose((w * rates).sum(), b.sum(), atol=1e-9 * max(1, np.abs(b).sum()))


def test_grass_noise_ema_and_alpha_by_hand():
    """≥ 8 in-chunk pairs update the EMA with (1.4826·MAD)², lower medians, bias-corrected."""
    noise = mp_opd_credits.GrassNoise()
    z = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 10.0]
    noise.observe(z[:7])
    assert noise.updates == 0 and noise.sigma2 == 0.0
    noise.observe(z)
    # lower median of z = 3; |z − 3| = 3,2,1,0,1,2,3,7 -> lower median 2
    assert noise.updates == 1
    np.testing.assert_allclose(noise.sigma2, (1.4826 * 2) ** 2)
    h = np.array([[2.0, 0.5], [0.5, 1.0]])
    r, w = np.array([1.0, -1.0]), np.array([1.0, 1.0])
    d = r - 0.0
    want = np.clip(noise.sigma2 * (2.0 + 1.0 - 4.0 / 2) / (d @ h @ d), 0, 1)
    assert mp_opd_credits.grass_alpha(r, w, h, noise.sigma2) == pytest.approx(want)
    assert mp_opd_credits.grass_alpha(r[:1], w[:1], h[:1, :1], noise.sigma2) == 0.0


def test_lm_head_gram_against_brute_force():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(20, H)).astype(np.float32)
    head = rng.normal(size=(H, 30)).astype(np.float32)
    chunks = [[[0], [1, 2]], [[3, 4], [5]], [[6]], [[7, 8, 9], [10]]]   # atoms -> token rows
    k = 4
    rows = np.zeros((len(chunks), k), np.int32)
    pos, valid = np.zeros_like(rows), np.zeros(rows.shape, np.float32)
    targets = rng.integers(0, 30, size=rows.shape).astype(np.int32)
    for c, atoms in enumerate(chunks):
        slot = 0
        for i, toks in enumerate(atoms):
            for t in toks:
                rows[c, slot], pos[c, slot], valid[c, slot] = t, i, 1
                slot += 1
    got = np.asarray(mp_opd_device.lm_head_gram(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(rows), jnp.asarray(targets),
                                         jnp.asarray(pos), jnp.asarray(valid), 2, chunk_rows=8))
    for c, atoms in enumerate(chunks):
        p = torch.softmax(torch.tensor(hidden[rows[c]], dtype=torch.float64) @ torch.tensor(head, dtype=torch.float64), -1)
        delta = (p - torch.nn.functional.one_hot(torch.tensor(targets[c], dtype=torch.long), 30)).numpy()
        slots, at = [], 0
        for toks in atoms:
            slots.append(list(range(at, at + len(toks))))
            at += len(toks)
        want = torch_mp_opd.gram(delta, hidden[rows[c]].astype(np.float64), slots)
        np.testing.assert_allclose(got[c, :len(atoms), :len(atoms)], want, rtol=1e-4, atol=1e-4)


# -- the objective against the PyTorch reference ---------------------------------------------------
def make_host(t_side, s_side, texts):
    t, s = retokenize_pair(t_side, s_side, [t_side.render_prompt("q")] * len(texts),
                           [s_side.render_prompt("q")] * len(texts), texts, pad_to_multiple=64)
    return HostBatch(s, t, strict_align(t, s), None, list(texts), ["stop"] * len(texts))


@pytest.fixture(scope="module")
def demo(tiny_bpe, tiny_unigram):
    return make_host(tiny_bpe, tiny_unigram, TEXTS), tiny_bpe, tiny_unigram


def objective(**kw):
    return get_objective(from_dict({"algorithm": {"name": "mp_opd", "chunked_loss_size": 16, **kw}}).algorithm)


def run_jax(obj, host, hs, ws, ht, wt):
    from ctopd_jax.kernels.token_rows import token_rows

    batch = jax.tree.map(jnp.asarray, obj.prepare(host, 0, host.size))
    t_hidden = jnp.asarray(ht)[batch.teacher_rows]

    def f(h, w):
        rows = jnp.take(h, batch.response_rows, axis=0)
        logp, _ = token_rows(rows, w, batch.response_targets, chunk_rows=16)
        x = StepInputs(h, w, t_hidden, jnp.asarray(wt), batch, {}, logp)
        sums, metrics = obj.kd_sums(x)
        return sums["mp_opd"], metrics

    (value, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(jnp.asarray(hs), jnp.asarray(ws))
    metrics = obj.after_micro_batch(metrics)  # what device.micro_grad does after each micro-batch
    return float(value), jax.device_get(metrics), np.asarray(grads[0]), np.asarray(grads[1])


def side_tokens(side, batch, b):
    lo, hi = batch.resp_offsets[b], batch.resp_offsets[b + 1]
    ids = batch.resp_ids[lo:hi].tolist()
    pieces = [(side.token_bytes[i][1:] if st_ else side.token_bytes[i])
              for i, st_ in zip(ids, batch.resp_stripped[lo:hi].tolist())]
    return ids, pieces


def run_torch(host, t_side, s_side, hs, ws, ht, wt, mode, noise=None, eos_atom=False):
    s_b, t_b = host.student, host.teacher
    hs_t, ws_t = torch.tensor(hs, requires_grad=True), torch.tensor(ws, requires_grad=True)
    samples = []
    for b in range(host.size):
        t_ids, t_p = side_tokens(t_side, t_b, b)
        s_ids, s_p = side_tokens(s_side, s_b, b)
        dec = lambda pieces: lambda k: b"".join(pieces[i] for i in range(len(k))).decode("utf-8", "replace")  # noqa: E731
        _, atoms = atoms_oracle(t_ids, s_ids, dec(t_p), dec(s_p), lambda i: bool(t_side.is_added[i]),
                                lambda i: bool(s_side.is_added[i]), t_side.eos_id, s_side.eos_id)
        if eos_atom and atoms:   # the row after the last atom on each side (the EOS), one atom
            atoms = atoms + [([atoms[-1][0][-1] + 1], [atoms[-1][1][-1] + 1])]
        s_rows = s_b.row_base[b] + np.arange(s_b.response_lens[b])
        t_rows = t_b.row_base[b] + np.arange(t_b.response_lens[b])
        samples.append({"atoms": atoms, "row": b, "s_labels": s_b.labels.reshape(-1)[s_rows],
                        "t_labels": t_b.labels.reshape(-1)[t_rows], "s_hidden": hs_t[torch.as_tensor(s_rows)],
                        "t_hidden": torch.tensor(ht)[torch.as_tensor(t_rows)]})
    total, rates = torch_mp_opd.mp_opd_loss(samples, ws_t, torch.tensor(wt), mode, noise=noise)
    total.backward()
    return float(total.detach()), rates, hs_t.grad.numpy(), ws_t.grad.numpy(), samples


def random_model(host, t_side, s_side, seed):  # noqa: D103
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(host.student.input_ids.size, H)).astype(np.float32),
            rng.normal(size=(H, s_side.vocab_size)).astype(np.float32),
            rng.normal(size=(host.teacher.input_ids.size, H)).astype(np.float32),
            rng.normal(size=(H, t_side.vocab_size)).astype(np.float32))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("mode", ["atomic", "grass_chunk", pytest.param("align", marks=SLOW)]
                         + [pytest.param(m, marks=SLOW) for m in
                            ("fixed1", "fixed2", "fixed3", "fixed4", "fixed5", "random1-2", "random2-5")])
def test_matches_torch_reference(demo, mode):
    host, t_side, s_side = demo
    hs, ws, ht, wt = random_model(host, t_side, s_side, seed=7)
    obj = objective(mp_opd_mode=mode)
    ref_noise = torch_mp_opd.Noise()
    want, rates, r_h, r_w, samples = run_torch(host, t_side, s_side, hs, ws, ht, wt, mode, noise=ref_noise)
    got, metrics, g_h, g_w = run_jax(obj, host, hs, ws, ht, wt)
    assert sum(len(s["atoms"]) for s in samples) == float(metrics["mp_opd_atoms_per_sample"][0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    # fail-closed samples counted by reason: the empty response and the added token
    assert float(metrics["mp_opd_fail_empty_response"][0]) == 1
    assert float(metrics["mp_opd_fail_unsupported_added_token"][0]) == 1
    assert float(metrics["mp_opd_fail_normalization_mismatch"][0]) == 0
    if mode == "grass_chunk":
        assert ref_noise.t == 1  # the long first sample updated the noise estimate
        state = obj.state_dict()
        assert state["grass_noise_updates"] == ref_noise.t
        np.testing.assert_allclose(state["grass_noise_ema"], ref_noise.ema, rtol=1e-4)
        fresh = objective(mp_opd_mode=mode)
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state


@pytest.mark.parametrize("mode", ["atomic", "fixed2"])
def test_eos_atom_matches_torch_reference_with_the_eos_as_last_atom(demo, mode):
    """`mp_opd_eos_atom` (ours, off by default): the reference's loss over the SPEC §8 atoms plus
    one EOS atom per valid sample; the EOS row's student logits now get gradient."""
    host, t_side, s_side = demo
    hs, ws, ht, wt = random_model(host, t_side, s_side, seed=7)
    want, _, r_h, r_w, samples = run_torch(host, t_side, s_side, hs, ws, ht, wt, mode, eos_atom=True)
    got, metrics, g_h, g_w = run_jax(objective(mp_opd_mode=mode, mp_opd_eos_atom=True), host, hs, ws, ht, wt)
    assert sum(len(s["atoms"]) for s in samples) == float(metrics["mp_opd_atoms_per_sample"][0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    eos_rows = [host.student.row_base[b] + s["atoms"][-1][1][0] for b, s in enumerate(samples) if s["atoms"]]
    assert eos_rows and all(np.abs(g_h[r]).sum() > 0 for r in eos_rows)
    _, _, plain_h, _ = run_jax(objective(mp_opd_mode=mode), host, hs, ws, ht, wt)
    assert all(np.abs(plain_h[r]).sum() == 0 for r in eos_rows)   # upstream: the EOS is not trained


def test_per_shard_arrays_stack_and_sum_to_the_whole(demo):
    """The trainer prepares each batch shard on its own and stacks the parts (step.shards.stack_shards):
    the sample and fail-closed counts are [1] arrays (0-d scalars made stack_shards raise: a
    crash of every sharded MP-OPD step) whose per-shard sums equal the whole micro-batch's."""
    from ctopd_jax.step.shards import stack_shards

    host = demo[0]
    for mode in ("atomic", "grass_chunk"):
        obj = objective(mp_opd_mode=mode)
        whole = obj.prepare(host, 0, host.size)
        stacked = stack_shards([obj.prepare(host, i, i + 1) for i in range(host.size)])
        for key in ("mp_opd_samples", "mp_opd_valid_samples", "mp_opd_fail_counts"):
            one, all_ = getattr(whole.terms, key), getattr(stacked.terms, key)
            assert one.shape[0] == 1 and all_.shape == (host.size,) + one.shape[1:]
            np.testing.assert_array_equal(all_.sum(axis=0), one.sum(axis=0))
        assert whole.terms.mp_opd_samples[0] == host.size


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="algorithm.mp_opd_mode"):
        from_dict({"algorithm": {"name": "mp_opd", "mp_opd_mode": "fixed6"}})
    with pytest.raises(ConfigError, match="algorithm.grass_chunk_atoms"):
        from_dict({"algorithm": {"name": "mp_opd", "grass_chunk_atoms": 0}})


REAL_TEXTS = ["数学很有趣 😀😀 — naïve café ½ × 3 = 1.5 and then 12 + 30 = 42 apples in total.",
              "so the answer is 7 <|im_end|> then more", "truncated mid-character: 答\ufffd", ""]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["atomic", "grass_chunk", "align", "random2-5"])
def test_real_pair_edge_cases_match_torch_reference(qwen, llama, mode):
    """Qwen2.5 -> Llama-3 at the real vocabularies: CJK and emoji atoms; the added token, the
    split UTF-8 tail and the empty response fail closed, counted by reason, never a crash."""
    host = make_host(qwen, llama, REAL_TEXTS)
    hs, ws, ht, wt = random_model(host, qwen, llama, seed=11)
    want, _, r_h, r_w, samples = run_torch(host, qwen, llama, hs, ws, ht, wt, mode)
    got, metrics, g_h, g_w = run_jax(objective(mp_opd_mode=mode), host, hs, ws, ht, wt)
    assert [bool(s["atoms"]) for s in samples] == [True, False, False, False]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    for reason in ("unsupported_added_token", "replacement_character", "empty_response"):
        assert float(metrics[f"mp_opd_fail_{reason}"][0]) == 1


# -- GRASS noise EMA: sequential per sample, independent of the sharding -----------------------------
def test_grass_with_a_running_noise_estimate_matches_torch_reference(demo):
    """The EMA known before the micro-batch comes in as an input array: a loaded state gives
    the reference's loss, gradient and next state."""
    host, t_side, s_side = demo
    hs, ws, ht, wt = random_model(host, t_side, s_side, seed=3)
    obj = objective(mp_opd_mode="grass_chunk")
    obj.load_state_dict({"grass_noise_ema": 0.05, "grass_noise_updates": 3})
    ref_noise = torch_mp_opd.Noise()
    ref_noise.ema, ref_noise.t = 0.05, 3
    want, _, r_h, r_w, _ = run_torch(host, t_side, s_side, hs, ws, ht, wt, "grass_chunk", noise=ref_noise)
    got, metrics, g_h, g_w = run_jax(obj, host, hs, ws, ht, wt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_h, r_h, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(g_w, r_w, rtol=1e-3, atol=1e-4)
    state = obj.state_dict()
    assert state["grass_noise_updates"] == ref_noise.t == 4
    np.testing.assert_allclose(state["grass_noise_ema"], ref_noise.ema, rtol=1e-4)
    assert "_mp_opd_grass_noise" not in metrics and float(metrics["mp_opd_grass_noise_updates"][0]) == 1


LONG_TEXTS = [f"Tom has {a} apples and buys {b} more, so he has {a} + {b} = {a + b} apples; then he eats {c}."
              for a, b, c in [(12, 7, 3), (40, 2, 9), (5, 18, 1), (77, 11, 6), (3, 3, 3), (21, 30, 4),
                              (9, 64, 2), (15, 15, 8)]]


def run_grass_loss(obj, host, hs3, ws, ht3, wt, mesh):
    """(loss, metrics after the host update, d loss / d (hs3, ws)) of the whole host batch as one
    micro-batch: one unit (mesh None) or one sample per batch shard under device.per_shard."""
    from ctopd_jax.step.shards import per_shard
    from ctopd_jax.step.shards import stack_shards

    n = host.size
    if mesh is None:
        parts, starts = [obj.prepare(host, 0, n)], [0]
    else:
        parts, starts = [obj.prepare(host, i, i + 1) for i in range(n)], list(range(n))
    k = n // len(parts)
    batch = stack_shards(parts)
    length = batch.student_ids.shape[1]
    t_rows = np.split(batch.teacher_rows, len(parts))
    t_hidden = np.concatenate([ht3[a:a + k, :p.teacher_ids.shape[1]].reshape(-1, H)[rows]
                               for a, p, rows in zip(starts, parts, t_rows)])
    batch = jax.tree.map(jnp.asarray, batch)

    def local(hidden, teacher_hidden, b, lm_head, teacher_lm_head):
        return obj.loss_sums(hidden, lm_head, teacher_hidden, teacher_lm_head, b, {})

    fn = per_shard(local, mesh, 3, 2)

    @jax.jit
    def f(h3, w):
        hidden = jnp.concatenate([h3[a:a + k, :length].reshape(-1, H) for a in starts])
        sums, metrics = fn(hidden, jnp.asarray(t_hidden), batch, w, jnp.asarray(wt))
        return sums["mp_opd"], metrics

    (value, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(jnp.asarray(hs3), jnp.asarray(ws))
    metrics = obj.after_micro_batch(metrics)
    return float(value), jax.device_get(metrics), [np.asarray(g) for g in grads]


@pytest.mark.slow  # compiles the loss for 8 devices
def test_grass_sharded_equals_one_unit_and_updates_the_ema_once_per_sample(tiny_bpe, tiny_unigram):
    """8 samples, one per batch shard (data 4 x fsdp 2) vs one unit: the same loss, gradient,
    EMA state (one update per valid sample with >= 8 pairs, in sample order, not one per
    device) and the batch's noise metric (a mean over the samples, not a sum over devices);
    the second micro-batch starts from the state the first left."""
    from ctopd_jax.mesh.device_mesh import make_mesh

    host = make_host(tiny_bpe, tiny_unigram, LONG_TEXTS)
    hs, ws, ht, wt = random_model(host, tiny_bpe, tiny_unigram, seed=5)
    hs3, ht3 = hs.reshape(host.size, -1, H), ht.reshape(host.size, -1, H)
    mesh = make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    one, sharded = (objective(mp_opd_mode="grass_chunk", grass_chunk_atoms=3) for _ in range(2))
    for micro in range(2):
        v1, m1, g1 = run_grass_loss(one, host, hs3, ws, ht3, wt, None)
        vs, ms, gs = run_grass_loss(sharded, host, hs3, ws, ht3, wt, mesh)
        np.testing.assert_allclose(vs, v1, rtol=1e-5, atol=1e-6)
        for a, b in zip(gs, g1):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
        s1, ss = one.state_dict(), sharded.state_dict()
        updates = float(m1["mp_opd_grass_noise_updates"][0])
        assert updates >= 3, "several samples must update the EMA (the order matters)"
        assert float(ms["mp_opd_grass_noise_updates"][0]) == updates
        assert ss["grass_noise_updates"] == s1["grass_noise_updates"] == updates * (micro + 1)
        np.testing.assert_allclose(ss["grass_noise_ema"], s1["grass_noise_ema"], rtol=1e-5)
        for key in ("mp_opd_grass_noise_var", "mp_opd_grass_alpha", "mp_opd_fallback_fraction"):
            assert float(m1[key][1]) == float(ms[key][1]) > 0
            np.testing.assert_allclose(float(ms[key][0]), float(m1[key][0]), rtol=1e-5, atol=1e-7)
        noise_var = float(ms["mp_opd_grass_noise_var"][0]) / float(ms["mp_opd_grass_noise_var"][1])
        # a mean of the σ² the samples used: between the smallest and largest bias-corrected EMA
        assert 0 < noise_var <= one.noise.sigma2 * 10
