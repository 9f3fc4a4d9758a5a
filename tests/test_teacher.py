"""Teacher scoring equals slicing a full HF forward at the requested rows and columns."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "rollout"))
from _hf_tiny import load_pair  # noqa: E402

from ctopd_jax.teacher import TeacherInputError, TeacherScorer  # noqa: E402


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


@pytest.mark.parametrize("left", [False, True])
def test_projected_rows_equal_sliced_full_forward(pair, left):
    hf, model = pair
    rng = np.random.default_rng(0)
    ids, mask = padded_batch(rng, [5, 19, 12, 7, 19], 19, left)
    full = hf_full_logits(hf, ids, mask).reshape(-1, 256)  # [B*T, V]
    real = np.nonzero(mask.reshape(-1))[0]
    rows = rng.choice(real, 23)  # random order, duplicates allowed, across all sequences
    t_ids = rng.permutation(256)[:40]
    # max_tokens=64 with length bucket 32: 2 sequences per micro-batch, 3 micro-batches.
    scorer = TeacherScorer(model, max_tokens=64, length_bucket=32)
    got = np.asarray(scorer.logits_at(ids, mask, rows, t_ids))
    np.testing.assert_allclose(got, full[rows][:, t_ids], atol=2e-4, rtol=1e-4)

    col_idx = rng.integers(0, 40, (23, 6))
    gathered = np.asarray(scorer.logits_at(ids, mask, rows, t_ids, col_idx=col_idx))
    np.testing.assert_allclose(gathered, np.take_along_axis(full[rows][:, t_ids], col_idx, 1),
                               atol=2e-4, rtol=1e-4)

    targets = rng.integers(0, 256, 23)
    logp = full - np.log(np.exp(full - full.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - full.max(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(scorer.token_logprobs(ids, mask, rows, targets)),
                               logp[rows, targets], atol=2e-4)


def test_full_vocab_and_sharded_mesh(pair, tmp_path):
    from ctopd_jax.mesh import make_mesh, shard_module

    hf, model = pair
    rng = np.random.default_rng(1)
    ids, mask = padded_batch(rng, [9, 4, 13], 13, False)
    full = hf_full_logits(hf, ids, mask).reshape(-1, 256)
    rows = np.nonzero(mask.reshape(-1))[0][::2]
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    from flax import nnx
    sharded = shard_module(nnx.clone(model), mesh)
    got = TeacherScorer(sharded, mesh=mesh, max_tokens=128, length_bucket=16).logits_at(
        ids, mask, rows)
    np.testing.assert_allclose(np.asarray(got), full[rows], atol=2e-4, rtol=1e-4)


def test_bad_inputs(pair):
    hf, model = pair
    scorer = TeacherScorer(model)
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(TeacherInputError, match="rows"):
        scorer.logits_at(ids, None, [8], [1, 2])
    with pytest.raises(TeacherInputError, match="t_ids"):
        scorer.logits_at(ids, None, [1], [300])
    with pytest.raises(TeacherInputError, match="attention_mask"):
        scorer.logits_at(ids, np.ones((2, 3), bool), [1], [1])
