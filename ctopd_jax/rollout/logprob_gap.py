"""Gap between the rollout engine's sampling log-probs and the trainer's recomputed ones.

Both are log pi_student(y_t | prefix) of the same sampled tokens (raw distribution, see
rollout/base.py), so with correctly synced weights the gap is numerics only (~1e-6 in float32,
~1e-2 in bfloat16). A weight-sync bug shows up as a gap of order 1.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def logprob_gap(rollout_logprobs, recomputed_logprobs, mask=None) -> dict[str, float]:
    """Mean and max |rollout - recomputed| over response tokens.

    Takes either padded arrays [B, T] with a bool `mask` (True on response tokens), or ragged
    lists of per-sample sequences (then `mask` must be None). Returns
    {"logprob_gap_mean", "logprob_gap_max", "logprob_gap_tokens"}.
    """
    if mask is None:
        if len(rollout_logprobs) != len(recomputed_logprobs):
            raise ValueError(
                f"logprob_gap: {len(rollout_logprobs)} rollout rows vs "
                f"{len(recomputed_logprobs)} recomputed rows; pass the same samples")
        diffs = []
        for i, (a, b) in enumerate(zip(rollout_logprobs, recomputed_logprobs)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if a.shape != b.shape:
                raise ValueError(f"logprob_gap: sample {i} has {a.shape} rollout log-probs but "
                                 f"{b.shape} recomputed ones; align them on response tokens")
            diffs.append(np.abs(a - b))
        flat = np.concatenate(diffs) if diffs else np.zeros(0)
        count = flat.size
        return {"logprob_gap_mean": float(flat.mean()) if count else 0.0,
                "logprob_gap_max": float(flat.max()) if count else 0.0,
                "logprob_gap_tokens": int(count)}
    a = jnp.asarray(rollout_logprobs, jnp.float32)
    b = jnp.asarray(recomputed_logprobs, jnp.float32)
    mask = jnp.asarray(mask, bool)
    diff = jnp.where(mask, jnp.abs(a - b), 0.0)
    count = jnp.sum(mask)
    return {"logprob_gap_mean": float(jnp.sum(diff) / jnp.maximum(count, 1)),
            "logprob_gap_max": float(jnp.max(diff)),
            "logprob_gap_tokens": int(count)}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_logprobs(state, ids, mask, targets, *, graphdef):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    logits = model(ids, positions, mask)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def response_logprobs(model, prompt_ids: Sequence[Sequence[int]],
                      response_ids: Sequence[Sequence[int]], pad_id: int = 0,
                      bucket: int = 16) -> list[np.ndarray]:
    """Recompute log pi(response_t | prompt, response_<t) with a `Decoder` (teacher forcing).

    Right-padded to a multiple of `bucket` so repeated calls reuse the compiled forward.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = -(-max(lengths) // bucket) * bucket
    ids = np.full((len(lengths), width), pad_id, np.int32)
    mask = np.zeros_like(ids, bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, :lengths[i]] = list(p) + list(r)
        mask[i, :lengths[i]] = True
    targets = np.concatenate([ids[:, 1:], np.full((len(ids), 1), pad_id, np.int32)], axis=1)
    graphdef, state = nnx.split(model)
    out = np.asarray(_token_logprobs(state, ids, mask, targets, graphdef=graphdef))
    return [out[i, len(p) - 1: len(p) - 1 + len(r)]
            for i, (p, r) in enumerate(zip(prompt_ids, response_ids))]
