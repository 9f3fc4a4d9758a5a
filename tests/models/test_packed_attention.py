"""Packed rows: several samples in one row (segment ids, positions restarting per sample) give
each sample exactly what it gets alone, in every attention path, values and gradients.

Oracles: a numpy softmax attention over each sample on its own, and the model run on each
sample alone in its own right-padded row (the unpacked path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import with_options
from ctopd_jax.models import prefill_positions
from ctopd_jax.models.attention import AttentionMask, attend
from ctopd_jax.models.config import tiny_qwen2
from ctopd_jax.models.decoder import Decoder

LENGTHS = (5, 11, 3, 8)   # one row of 32 slots: 27 tokens in four samples, then 5 pads


def _segments(lengths, width, first=1):
    """One row: sample i of `lengths` is segment first + i, then pads (0)."""
    seg = np.zeros(width, np.int32)
    at = 0
    for i, n in enumerate(lengths):
        seg[at:at + n] = first + i
        at += n
    return seg


def _numpy_attention(q, k, v):
    """Causal GQA softmax attention of one sample alone: q [T, Nq, D], k/v [T, Nkv, D]."""
    t, nq, d = q.shape
    group = nq // k.shape[1]
    out = np.zeros_like(q)
    for h in range(nq):
        scores = q[:, h] @ k[:, h // group].T / np.sqrt(d)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out


@pytest.mark.parametrize("implementation", ["einsum", "blockwise", "cudnn"])
def test_attention_never_crosses_a_segment(implementation):
    """cuDNN takes no segment ids: asked for packed rows it runs the blockwise path (here on
    the CPU, which is how that fallback is reached)."""
    rng = np.random.RandomState(0)
    width, nq, nkv, d = 32, 4, 2, 8
    seg = _segments(LENGTHS, width)
    q, k, v = (rng.randn(1, width, n, d).astype(np.float32) for n in (nq, nkv, nkv))
    mask = AttentionMask(jnp.arange(width, dtype=jnp.int32), jnp.asarray(seg > 0)[None],
                         jnp.asarray(seg)[None])
    out = np.asarray(jax.jit(lambda q, k, v: attend(q, k, v, mask, implementation, 8, 8))(q, k, v))
    at = 0
    for n in LENGTHS:
        part = slice(at, at + n)
        np.testing.assert_allclose(out[0, part], _numpy_attention(q[0, part], k[0, part], v[0, part]),
                                   rtol=1e-5, atol=1e-6)
        at += n


# Three packed rows of 40 slots laid out differently, as first-fit leaves them (samples of one
# micro-batch, ids 1..8), then an empty row (row_count rounding): with blocks of 16 (40 -> 48
# padded) and of 12 the samples cross block edges, and a row's tiles differ from another's.
ROWS = ((17, 9, 6), (3, 30), (38,), ())


@pytest.mark.parametrize("block", [16, 12])
def test_packed_rows_of_several_tiles_match_the_einsum_oracle(block):
    """Each row loops over its own tiles (attention._over_rows), skipping those its segments
    never need: values and gradients equal the einsum reference over the dense mask."""
    rng = np.random.RandomState(2)
    width, nq, nkv, d = 40, 4, 2, 8
    firsts = np.cumsum([1] + [len(lengths) for lengths in ROWS])
    seg = np.stack([_segments(lengths, width, first) for lengths, first in zip(ROWS, firsts)])
    q, k, v = (rng.randn(len(ROWS), width, n, d).astype(np.float32) for n in (nq, nkv, nkv))
    weight = (rng.randn(len(ROWS), width, nq, d) * (seg > 0)[..., None, None]).astype(np.float32)
    mask = AttentionMask(jnp.arange(width, dtype=jnp.int32), jnp.asarray(seg > 0), jnp.asarray(seg))

    def run(implementation):
        fn = lambda q, k, v: attend(q, k, v, mask, implementation, block, block)  # noqa: E731
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weight)  # noqa: E731
        return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (out, grads), (ref, ref_grads) = run("blockwise"), run("einsum")
    real = seg > 0   # pad queries: zeros blockwise, finite garbage in the reference, never read
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_positions_restart_per_segment():
    seg = jnp.asarray(_segments(LENGTHS, 32))[None]
    expected = np.concatenate([np.arange(n) for n in LENGTHS] + [np.zeros(5, int)])
    np.testing.assert_array_equal(np.asarray(prefill_positions(seg))[0], expected)


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_qwen2(attention="einsum"), rngs=nnx.Rngs(5))


def _loss_and_grads(model, ids, mask, weight):
    graphdef, state = nnx.split(model)

    def loss(s):
        hidden = nnx.merge(graphdef, s).hidden_states(ids, prefill_positions(mask), mask)
        return jnp.sum(hidden * weight)
    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("attention", ["einsum", "blockwise"])
def test_packed_row_equals_samples_alone_values_and_gradients(model, attention):
    """Σ over samples of a weighted hidden-state loss, each sample alone in a right-padded
    row of its own (bool mask) vs all of them packed in one row: equal to 1e-6 relative."""
    m = with_options(model, attention=attention, attention_block=8, packed_attention_block=8)
    rng = np.random.RandomState(1)
    width, hidden = 32, m.cfg.hidden_size
    seg = _segments(LENGTHS, width)
    ids = np.where(seg > 0, rng.randint(0, m.cfg.vocab_size, width), 0).astype(np.int32)
    weight = (rng.randn(width, hidden) * (seg > 0)[:, None]).astype(np.float32)
    packed = _loss_and_grads(m, jnp.asarray(ids)[None], jnp.asarray(seg)[None], jnp.asarray(weight)[None])
    alone_ids, alone_mask = np.zeros((len(LENGTHS), 16), np.int32), np.zeros((len(LENGTHS), 16), bool)
    alone_weight = np.zeros((len(LENGTHS), 16, hidden), np.float32)
    at = 0
    for i, n in enumerate(LENGTHS):
        alone_ids[i, :n], alone_mask[i, :n], alone_weight[i, :n] = ids[at:at + n], True, weight[at:at + n]
        at += n
    alone = _loss_and_grads(m, jnp.asarray(alone_ids), jnp.asarray(alone_mask), jnp.asarray(alone_weight))
    np.testing.assert_allclose(float(packed[0]), float(alone[0]), rtol=1e-6)
    leaves = zip(jax.tree.leaves(packed[1]), jax.tree.leaves(alone[1]))
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(alone[1]))
    for got, ref in leaves:
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6 * scale)


def test_packed_attention_lowers_for_cuda():
    """GPU readiness without a GPU: the packed path asked of cuDNN (which falls back to
    blockwise, two rows of four tiles: one row at a time), forward and gradient, exports for
    the CUDA platform in bf16."""
    from jax import export

    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 5), 64), np.repeat(np.arange(5, 7), 128)]).astype(np.int32))

    def loss(q, k, v):
        mask = AttentionMask(jnp.arange(256, dtype=jnp.int32), seg > 0, seg)
        return jnp.sum(attend(q, k, v, mask, "cudnn", 64, 64).astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
        assert export.export(jax.jit(fn), platforms=["cuda"])(q, kv, kv).platforms == ("cuda",)
