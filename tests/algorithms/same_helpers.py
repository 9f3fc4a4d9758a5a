"""Shared by the same-tokenizer objective tests: StepInputs whose student and teacher logits
are given directly (hidden = logits, lm_head = identity), so every value and gradient can be
compared with the PyTorch reference of tests/reference/torch_opd.py."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))

from ctopd_jax.algorithms.base import StepInputs  # noqa: E402
from ctopd_jax.algorithms.micro_batch import MicroBatch  # noqa: E402


def step_inputs(s_logits, t_logits, targets, *, old=None, old_weight=None, base_logits=None,
                weight=None, response_logprobs=None, terms=None):
    """StepInputs for R rows: hidden = student logits [R, V], lm_head = I_V (same for teacher)."""
    s = jnp.asarray(s_logits, jnp.float32)
    rows, vocab = s.shape
    eye = jnp.eye(vocab, dtype=jnp.float32)
    targets = jnp.asarray(targets, jnp.int32)
    overlap = {}
    if base_logits is not None:
        overlap["base_lm_head"] = eye
    batch = MicroBatch(
        response_rows=jnp.arange(rows, dtype=jnp.int32), response_targets=targets,
        response_weight=jnp.ones(rows, jnp.float32) if weight is None else jnp.asarray(weight, jnp.float32),
        rollout_logprobs=jnp.zeros(rows) if old is None else jnp.asarray(old, jnp.float32),
        rollout_logprob_weight=(jnp.zeros(rows) if old is None else jnp.ones(rows))
        if old_weight is None else jnp.asarray(old_weight, jnp.float32),
        base_hidden=None if base_logits is None else jnp.asarray(base_logits, jnp.float32), terms=terms)
    if response_logprobs is None:
        response_logprobs = jax.nn.log_softmax(s, -1)[jnp.arange(rows), targets]
    return StepInputs(s, eye, jnp.asarray(t_logits, jnp.float32), eye, batch, overlap, response_logprobs)


@functools.lru_cache(maxsize=None)
def _compiled(objective, name, with_base):
    def f(z, t, targets, old, old_weight, weight, base):
        lp = jax.nn.log_softmax(z, -1)[jnp.arange(z.shape[0]), targets]
        x = step_inputs(z, t, targets, old=old, old_weight=old_weight, weight=weight,
                        base_logits=base if with_base else None, response_logprobs=lp)
        sums, _ = objective.kd_sums(x)
        return sums[name]

    return jax.jit(jax.value_and_grad(f))


def objective_sum(objective, s_logits, t_logits, targets, name, old=None, old_weight=None,
                  weight=None, base_logits=None):
    """(sum, d sum / d student logits) through the objective's kd_sums; the student log-probs
    at the response rows are recomputed from the logits inside the differentiated function.
    Compiled once per (objective, shapes)."""
    s = jnp.asarray(s_logits, jnp.float32)
    rows = s.shape[0]
    arr = lambda v, default: jnp.asarray(default if v is None else v, jnp.float32)
    value, grad = _compiled(objective, name, base_logits is not None)(
        s, jnp.asarray(t_logits, jnp.float32), jnp.asarray(targets, jnp.int32),
        arr(old, np.zeros(rows)), arr(old_weight, np.zeros(rows) if old is None else np.ones(rows)),
        arr(weight, np.ones(rows)), arr(base_logits, np.zeros(1)))
    return float(value), np.asarray(grad)


def random_logits(seed, rows, vocab, scale=2.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal((rows, vocab))).astype(np.float32)
