"""The teacher path (hidden rows, then columns / log-probs chunk by chunk) equals slicing a full
HF forward at the requested rows and columns."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "rollout"))
from _hf_tiny import load_pair  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ctopd_jax.kernels.strict.row_chunks import teacher_columns  # noqa: E402
from ctopd_jax.kernels.token_rows import token_rows  # noqa: E402
from ctopd_jax.step.teacher import lm_head_of, teacher_hidden_rows  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    hf, model, cfg = load_pair(request.param, tmp_path_factory.mktemp("teacher_" + request.param))
    return hf, model


def padded_batch(rng, lengths, width, left):
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros_like(ids, bool)
    for b, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[b, cols] = rng.integers(1, 256, n)
        mask[b, cols] = True
    return ids, mask


def hf_full_logits(hf, ids, mask):
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = hf(torch.tensor(ids, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long)).logits
    return out.double().numpy()


def hidden_rows(model, ids, mask, rows):
    graphdef, state = nnx.split(model)
    return teacher_hidden_rows(graphdef, state, jnp.asarray(ids), jnp.asarray(mask),
                               jnp.asarray(rows, jnp.int32)), lm_head_of(graphdef, state)


@pytest.mark.parametrize("left", [False, True])
def test_columns_and_logprobs_from_hidden_rows_equal_full_forward(pair, left):
    hf, model = pair
    rng = np.random.default_rng(0)
    ids, mask = padded_batch(rng, [5, 19, 12, 7, 19], 19, left)
    full = hf_full_logits(hf, ids, mask).reshape(-1, 256)  # [B*T, V]
    real = np.nonzero(mask.reshape(-1))[0]
    rows = rng.choice(real, 23)  # random order, duplicates allowed, across all sequences
    t_ids = rng.permutation(256)[:40]
    hidden, lm_head = hidden_rows(model, ids, mask, rows)
    assert hidden.shape == (23, model.cfg.hidden_size)  # [R, H] crosses, never [R, V]
    (h, w_cols), _ = teacher_columns((hidden, lm_head), jnp.asarray(t_ids))
    np.testing.assert_allclose(np.asarray(h @ w_cols), full[rows][:, t_ids], atol=2e-4, rtol=1e-4)

    targets = rng.integers(0, 256, 23)
    logp = full - np.log(np.exp(full - full.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - full.max(1, keepdims=True)
    lp, lse = token_rows(hidden, lm_head, jnp.asarray(targets), chunk_rows=8)
    np.testing.assert_allclose(np.asarray(lp), logp[rows, targets], atol=2e-4)
    np.testing.assert_allclose(np.asarray(lse), (full - logp)[rows, 0], atol=2e-4)


def test_sharded_mesh_rows_equal_full_forward(pair, tmp_path):
    from ctopd_jax.mesh.device_mesh import make_mesh, shard_module

    hf, model = pair
    rng = np.random.default_rng(1)
    ids, mask = padded_batch(rng, [9, 4, 13, 2], 13, False)
    full = hf_full_logits(hf, ids, mask).reshape(-1, 256)
    rows = np.nonzero(mask.reshape(-1))[0][::2]
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = shard_module(nnx.clone(model), mesh)
    hidden, lm_head = hidden_rows(sharded, ids, mask, rows)
    np.testing.assert_allclose(np.asarray(hidden @ lm_head), full[rows], atol=2e-4, rtol=1e-4)
