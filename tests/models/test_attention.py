"""Blockwise attention, layers under scan and remat policies against the einsum reference.

HF parity of the whole model with each attention path is in test_parity.py; here the oracle is
the einsum attention (a dense [B, T, S] mask and one softmax) and the unrolled, non-remat model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import paged_cache, with_options
from ctopd_jax.models import prefill_positions, weights
from ctopd_jax.models.attention import (AttentionMask, attend, attend_blockwise, attend_einsum,
                                        resolve_implementation)
from ctopd_jax.models.config import ModelConfigError, llama3_2_3b, tiny_llama, tiny_qwen2
from ctopd_jax.models.decoder import Decoder
from ctopd_jax.models.memory_probe import student_grad_temp_bytes


def _qkv(rng, b, t, s, nq, nkv, d, dtype=jnp.float32):
    q = jnp.asarray(rng.randn(b, t, nq, d), dtype)
    k = jnp.asarray(rng.randn(b, s, nkv, d), dtype)
    v = jnp.asarray(rng.randn(b, s, nkv, d), dtype)
    return q, k, v


def _visible_rows(mask: AttentionMask) -> np.ndarray:
    """[B, T] True where a query sees at least one key (other rows are unused garbage)."""
    return np.asarray(mask.dense().any(axis=-1))


@pytest.mark.parametrize("block_q,block_k,nq,nkv", [
    (8, 8, 4, 2), (16, 5, 4, 4), (7, 12, 6, 1), (64, 64, 4, 2)])
def test_blockwise_matches_einsum_values_and_gradients(block_q, block_k, nq, nkv):
    """Right and left padding, GQA / MHA / MQA, T not a multiple of the blocks."""
    rng = np.random.RandomState(block_q * 31 + block_k + nq * 7 + nkv)
    b, t, d = 3, 37, 16
    q, k, v = _qkv(rng, b, t, t, nq, nkv, d)
    valid = np.ones((b, t), bool)
    valid[1, -9:] = False   # right padded
    valid[2, :6] = False    # left padded: queries 0..5 see nothing
    mask = AttentionMask(jnp.arange(t, dtype=jnp.int32), jnp.asarray(valid))
    rows = _visible_rows(mask) & valid
    weight = jnp.asarray(rng.randn(b, t, nq, d) * rows[:, :, None, None], jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weight)

    blockwise = jax.jit(lambda q, k, v: attend_blockwise(q, k, v, mask, block_q, block_k))
    einsum = jax.jit(lambda q, k, v: attend_einsum(q, k, v, mask))
    got, ref = np.asarray(blockwise(q, k, v)), np.asarray(einsum(q, k, v))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[rows], ref[rows], atol=2e-6, rtol=1e-5)
    assert not got[~_visible_rows(mask)].any(), "rows that see no key output zeros"

    g_got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(einsum), argnums=(0, 1, 2)))(q, k, v)
    assert float(jnp.abs(g_ref[2]).max()) > 0.1
    for name, a, r in zip("qkv", g_got, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5, rtol=1e-4,
                                   err_msg=f"d{name}")


def test_blockwise_kv_cache_shapes_match_einsum():
    """Cache-style masks: a few new queries at slots index.., keys over the whole cache with
    left-padded prompts, a paused row and unfilled slots after the write position."""
    rng = np.random.RandomState(5)
    b, s, nq, nkv, d = 3, 45, 4, 2, 16
    valid = np.zeros((b, s), bool)
    valid[0, :20] = True
    valid[1, 7:20] = True          # left padded prompt
    valid[2, 3:17] = True          # paused: its new tokens are not valid
    for t, index in ((1, 19), (20, 0)):
        q, k, v = _qkv(rng, b, t, s, nq, nkv, d)
        mask = AttentionMask(index + jnp.arange(t, dtype=jnp.int32), jnp.asarray(valid))
        rows = _visible_rows(mask)
        ref = np.asarray(jax.jit(attend_einsum)(q, k, v, mask))
        for block in (4, 16):
            got = np.asarray(jax.jit(attend_blockwise, static_argnums=(4, 5))(
                q, k, v, mask, block, block))
            np.testing.assert_allclose(got[rows], ref[rows], atol=2e-6, rtol=1e-5,
                                       err_msg=f"t={t} index={index} block={block}")


def test_blockwise_bfloat16_close_to_einsum():
    rng = np.random.RandomState(7)
    q, k, v = _qkv(rng, 2, 50, 50, 4, 2, 32, jnp.bfloat16)
    mask = AttentionMask(jnp.arange(50, dtype=jnp.int32), jnp.ones((2, 50), bool))
    got = jax.jit(attend_blockwise, static_argnums=(4, 5))(q, k, v, mask, 16, 16)
    assert got.dtype == jnp.bfloat16
    ref = attend_einsum(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                        mask)
    assert float(jnp.abs(got.astype(jnp.float32) - ref).max()) < 0.03


def test_dense_mask_still_accepted_by_the_reference():
    rng = np.random.RandomState(8)
    q, k, v = _qkv(rng, 2, 9, 9, 4, 2, 8)
    mask = AttentionMask(jnp.arange(9, dtype=jnp.int32), jnp.ones((2, 9), bool))
    np.testing.assert_array_equal(np.asarray(attend(q, k, v, mask.dense(), "blockwise")),
                                  np.asarray(attend_einsum(q, k, v, mask)))


def test_resolve_implementation_and_config_validation():
    assert resolve_implementation("auto", jnp.float32, False) == "blockwise"   # no GPU here
    # the caller's bound on the keys an einsum may attend over (the decoder's: Attention)
    assert resolve_implementation("auto", jnp.float32, False, 48, 170) == "einsum"
    assert resolve_implementation("auto", jnp.float32, False, 171, 170) == "blockwise"
    assert resolve_implementation("blockwise", jnp.float32, False, 48, 170) == "blockwise"
    assert resolve_implementation("auto", jnp.bfloat16, True) == "blockwise"
    assert resolve_implementation("einsum", jnp.float32, True) == "einsum"
    with pytest.raises(ValueError, match="KV cache"):
        resolve_implementation("cudnn", jnp.bfloat16, True)
    with pytest.raises(ModelConfigError, match="model.attention"):
        tiny_llama(attention="flash")
    with pytest.raises(ModelConfigError, match="model.remat_policy"):
        tiny_llama(remat_policy="some")
    with pytest.raises(ModelConfigError, match="model.attention_block"):
        tiny_llama(attention_block=0)
    with pytest.raises(ModelConfigError, match="model.packed_attention_block"):
        tiny_llama(packed_attention_block=True)
    assert tiny_llama(remat=True).layer_remat_policy == "full"
    assert tiny_llama(remat=True, remat_policy="blocks").layer_remat_policy == "blocks"
    assert tiny_llama().layer_remat_policy == "none"


# ---------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def reference_model():
    return Decoder(tiny_qwen2(attention="einsum"), rngs=nnx.Rngs(3))


def _batch(cfg, b=2, t=40):
    rng = np.random.RandomState(11)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (b, t)), jnp.int32)
    mask = np.ones((b, t), bool)
    mask[1, -11:] = False
    mask = jnp.asarray(mask)
    return ids, prefill_positions(mask), mask


def _value_and_grads(model):
    ids, pos, mask = _batch(model.cfg)
    weight = jnp.asarray(np.random.RandomState(2).randn(*ids.shape, model.cfg.hidden_size),
                         jnp.float32) * mask[..., None]
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s).hidden_states(ids, pos, mask) * weight)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.fixture(scope="module")
def reference_grads(reference_model):
    return _value_and_grads(reference_model)


@pytest.mark.parametrize("options", [
    dict(attention="blockwise", attention_block=16),
    pytest.param(dict(attention="blockwise", attention_block=16, scan_layers=True,
                      remat_policy="full", mlp_chunk=16), marks=pytest.mark.slow),
    pytest.param(dict(attention="blockwise", scan_layers=True, remat_policy="blocks",
                      mlp_chunk=13), marks=pytest.mark.slow),
    pytest.param(dict(attention="einsum", remat_policy="dots_saveable"),
                 marks=pytest.mark.slow),
], ids=["blockwise", "scan_full_chunked", "scan_blocks", "unrolled_dots"])
def test_model_options_keep_values_and_gradients(reference_model, reference_grads, options):
    model = with_options(reference_model, **options)
    ref_loss, ref_grads = reference_grads
    got_loss, got_grads = _value_and_grads(model)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    ref_leaves, got_leaves = jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads)
    assert len(ref_leaves) == len(got_leaves)
    scale = max(float(jnp.abs(g).max()) for g in ref_leaves)
    for a, r in zip(got_leaves, ref_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5 * scale)


def test_scan_layers_keeps_the_parameter_tree(reference_model):
    """The stored form stays one module per layer, so weights.py and checkpoints see the same
    paths and shapes whatever the execution options."""
    scanned = with_options(reference_model, scan_layers=True, remat_policy="full")
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m))  # noqa: E731
    assert shapes(scanned) == shapes(reference_model)
    ids, pos, _ = _batch(scanned.cfg)
    graphdef = nnx.graphdef(scanned)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s).hidden_states(ids, pos))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(nnx.state(scanned)))
    assert "scan" in jaxpr and ("checkpoint" in jaxpr or "remat" in jaxpr)


def test_scanned_model_exports_and_loads_back(reference_model, tmp_path):
    """HF export / load round trip of a model run with scanned layers: same tensors, and the
    loaded model (same options) gives the same logits."""
    options = dict(scan_layers=True, remat_policy="full", attention="blockwise")
    scanned = with_options(reference_model, **options)
    weights.export_hf_checkpoint(scanned, scanned.cfg, tmp_path)
    loaded, cfg = weights.load_hf_checkpoint(tmp_path, **options)
    assert cfg.scan_layers and cfg.attention == "blockwise"
    before = dict(weights.hf_named_tensors(scanned))
    after = dict(weights.hf_named_tensors(loaded))
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    ids, pos, mask = _batch(scanned.cfg)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m: m(ids, pos, mask))(loaded)),
                                  np.asarray(jax.jit(lambda m: m(ids, pos, mask))(scanned)))


@pytest.mark.slow
def test_blockwise_cache_decode_equals_full_forward(reference_model):
    """Prefill a left-padded batch blockwise into the paged cache, then decode one token at a
    time; logits equal the einsum reference's no-cache forward at every real position
    (test_kv_cache.py checks the default path against HF)."""
    attention = "blockwise"
    model = with_options(reference_model, attention=attention, attention_block=4)
    cfg = model.cfg
    rng = np.random.RandomState(4)
    prompt_lens, new, width = (6, 3), 4, 6
    rows = [rng.randint(0, cfg.vocab_size, n + new) for n in prompt_lens]
    ids = np.zeros((2, width), np.int32)
    mask = np.zeros((2, width), bool)
    for r, n in enumerate(prompt_lens):
        ids[r, width - n:], mask[r, width - n:] = rows[r][:n], True
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a[:3], cache=a[3]))
    cache = paged_cache(cfg, 2, width + new + 3)
    logits, cache = step(state, jnp.asarray(ids), prefill_positions(jnp.asarray(mask)),
                         jnp.asarray(mask), cache)
    got = [np.asarray(logits[:, -1])]
    for j in range(new - 1):
        tok = jnp.asarray([[rows[r][n + j]] for r, n in enumerate(prompt_lens)], jnp.int32)
        logits, cache = step(state, tok, cache.lengths[:, None], jnp.ones((2, 1), bool), cache)
        got.append(np.asarray(logits[:, 0]))
    for r, n in enumerate(prompt_lens):
        full_ids = jnp.asarray(rows[r][None, :n + new - 1], jnp.int32)
        full_pos = jnp.arange(n + new - 1, dtype=jnp.int32)[None]
        ref = np.asarray(reference_model(full_ids, full_pos))[0]
        for j in range(new):
            np.testing.assert_allclose(got[j][r], ref[n - 1 + j], atol=1e-4,
                                       err_msg=f"{attention} row {r} step {j}")


# ---------------------------------------------------------------------- memory (compile only)
# The student as trained: float32 master weights, bfloat16 compute.
MEMORY_PRESET = dict(num_layers=2, param_dtype="float32", attention="blockwise",
                     scan_layers=True, remat_policy="full", mlp_chunk=1024)


@pytest.mark.slow
def test_llama3_2_3b_student_gradient_memory_is_linear_and_under_6gb():
    cfg = llama3_2_3b(**MEMORY_PRESET)
    temps = {t: student_grad_temp_bytes(cfg, 2, t) for t in (2560, 5120, 10240)}
    assert temps[10240] <= 6e9, temps
    # Linear in T: each doubling adds twice the previous increment (a [T, T] term would add
    # four times as much).
    first, second = temps[5120] - temps[2560], temps[10240] - temps[5120]
    assert 1.6 <= second / first <= 2.4, temps
