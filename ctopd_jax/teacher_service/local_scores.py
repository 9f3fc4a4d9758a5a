"""The local teacher's answer to the served teacher's question, for checks and measurements.

`LocalTeacherScorer(model, top_k).score(sequences, starts)` returns the same `ScoredSequence`s a
server returns, from this repository's own Decoder forward: row j of sequence i is prefill row
starts[i] + j - 1 (the one predicting ids[starts[i] + j]), full-vocabulary log-softmax at
temperature 1, top-k by log-prob. The real-server test compares the two, and the benchmark
times both on the same workload.

It materialises [B, T, V] logits, so it is for small teachers (the demo's): the trainer's own
teacher path (step/teacher.py) keeps to hidden rows instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.teacher_service.scores import ScoredSequence


@functools.partial(jax.jit, static_argnames=("graphdef", "k"))
def _forward(graphdef, state, ids, mask, k):
    model = nnx.merge(graphdef, state)
    hidden = model.hidden_states(ids, prefill_positions(mask), mask)
    logits = hidden.astype(jnp.float32) @ model.lm_head_weight().astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)                       # [B, T, V]
    # Row t predicts ids[t + 1]: the realised token's log-prob, shifted one to the left.
    nxt = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    token = jnp.take_along_axis(logprobs, nxt[..., None], axis=-1)[..., 0]
    top_lps, top_ids = jax.lax.top_k(logprobs, k)
    return token, top_ids, top_lps


class LocalTeacherScorer:
    def __init__(self, model, top_k: int, length_bucket: int = 64, batch_bucket: int = 64):
        self.graphdef, self.state = nnx.split(model)
        self.top_k = top_k
        self.length_bucket, self.batch_bucket = length_bucket, batch_bucket

    def score(self, sequences, starts) -> list[ScoredSequence]:
        out = []
        for first in range(0, len(sequences), self.batch_bucket):
            chunk = [list(map(int, s)) for s in sequences[first:first + self.batch_bucket]]
            out += self._score_chunk(chunk, starts[first:first + self.batch_bucket])
        return out

    def _score_chunk(self, chunk, starts):
        width = -(-max(map(len, chunk)) // self.length_bucket) * self.length_bucket
        ids = np.zeros((self.batch_bucket, width), np.int32)
        mask = np.zeros_like(ids, bool)
        for b, seq in enumerate(chunk):
            ids[b, :len(seq)] = seq
            mask[b, :len(seq)] = True
        token, top_ids, top_lps = jax.device_get(
            _forward(self.graphdef, self.state, jnp.asarray(ids), jnp.asarray(mask), self.top_k))
        scored = []
        for b, (seq, start) in enumerate(zip(chunk, starts)):
            rows = slice(start - 1, len(seq) - 1)
            scored.append(ScoredSequence(token[b, rows].astype(np.float32),
                                         top_ids[b, rows].astype(np.int32),
                                         top_lps[b, rows].astype(np.float32)))
        return scored
