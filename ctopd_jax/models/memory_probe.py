"""Compile-only memory of the student gradient: XLA's accounting, nothing allocated.

Used by tests/models/test_attention.py and benchmarks/attention.py to check that attention
and layer execution options keep activation memory linear in the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ctopd_jax.models.attention import prefill_positions
from ctopd_jax.models.config import ModelConfig
from ctopd_jax.models.decoder import Decoder


def student_grad_temp_bytes(cfg: ModelConfig, batch: int, seq: int, packed: bool = False) -> int:
    """XLA's temporary bytes for d(sum of final hidden states)/d(params) at [batch, seq];
    `packed`: rows of several samples (an int32 segment-id mask, attention.prefill_positions).

    The loss stops at the final hidden states so the lm_head / loss chunking (measured
    elsewhere) does not mix in; parameters and ids are abstract shapes only."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))

    def loss(state, ids, mask):
        model = nnx.merge(graphdef, state)
        positions = (prefill_positions(mask) if packed else
                     jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), ids.shape))
        return jnp.sum(model.hidden_states(ids, positions, mask).astype(jnp.float32))

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.int32 if packed else jnp.bool_)
    compiled = jax.jit(jax.grad(loss)).lower(state, ids, mask).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)
