"""Teacher scoring: a prefill-only forward that hands back only the rows the objective needs.

Given the teacher-side padded `input_ids` [B, T] (left or right padding, `attention_mask` True
on real tokens) and flat row indices `rows` [R] into the [B*T] positions (the aligned rows
from `ctopd_jax.align`), the scorer returns, on device:

- `logits_at(..., t_ids)`: teacher logits [R, V∩] at the shared-vocabulary columns `t_ids`;
  with `col_idx` [R, k] (indices into V∩ chosen by the student for strict top-k) only [R, k];
  with `t_ids=None` the full teacher vocabulary (same-tokenizer objectives).
- `token_logprobs(..., targets)`: log pi_T(target | prefix) [R], normalised over the full
  teacher vocabulary (OPD's sampled reward).

Decisions:
- The lm_head runs only on the gathered hidden rows, and only on the `t_ids` columns of its
  weight, so no [B, T, V_T] tensor is ever formed, on device or host.
- Micro-batches hold at most `max_tokens` padded tokens (rows x length); their row counts and
  the sequence length are bucketed (length to a multiple of `length_bucket`, gathered rows to
  a power of two) so varying batches reuse compiled programs.
- No gradient flows (stop_gradient) and the decoder has no dropout, so this is eval mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.models.kv_cache import prefill_positions


class TeacherInputError(ValueError):
    """Bad scorer input; the message names the argument and the fix."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(1, n)))))


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def _score_microbatch(state, ids, mask, local_rows, t_ids, extra, *, graphdef, mode):
    model = nnx.merge(graphdef, state)
    hidden = model.hidden_states(ids, prefill_positions(mask), mask)
    h = hidden.reshape(-1, hidden.shape[-1])[local_rows]  # [r, H]
    w = model.lm_head_weight().astype(hidden.dtype)  # [H, V_T]
    if mode == "token_logprobs":
        logits = jnp.einsum("rh,hv->rv", h, w, preferred_element_type=jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        out = jnp.take_along_axis(logp, extra[:, None], axis=-1)[:, 0]
    else:
        if t_ids is not None:
            w = jnp.take(w, t_ids, axis=1)  # project the weight, not the logits
        out = jnp.einsum("rh,hv->rv", h, w, preferred_element_type=jnp.float32)
        if mode == "gather":
            out = jnp.take_along_axis(out, extra, axis=-1)
    return jax.lax.stop_gradient(out)


class TeacherScorer:
    """Prefill scoring with a teacher `Decoder` (see module docstring).

    Args:
      model: teacher Decoder (possibly sharded on its own mesh).
      mesh: if given, micro-batch rows are placed sharded over ("data", "fsdp").
      max_tokens: padded tokens per micro-batch forward.
      length_bucket: the sequence length is right-padded to a multiple of this.
    """

    def __init__(self, model, mesh=None, max_tokens: int = 8192, length_bucket: int = 64):
        if max_tokens < 1 or length_bucket < 1:
            raise TeacherInputError("teacher: max_tokens and length_bucket must be >= 1")
        self.model = model
        self.mesh = mesh
        self.max_tokens = max_tokens
        self.length_bucket = length_bucket

    def logits_at(self, input_ids, attention_mask, rows, t_ids=None, col_idx=None) -> jax.Array:
        """Teacher logits [R, V∩] (or [R, k] with `col_idx`) at flat rows of [B*T]."""
        vocab = self.model.cfg.vocab_size
        if t_ids is not None:
            t_ids = np.asarray(t_ids, np.int32)
            if t_ids.ndim != 1 or t_ids.size == 0 or t_ids.min() < 0 or t_ids.max() >= vocab:
                raise TeacherInputError(
                    f"teacher: t_ids must be a non-empty 1-D array of teacher ids in [0, {vocab})")
        width = vocab if t_ids is None else len(t_ids)
        extra = None
        if col_idx is not None:
            extra = np.asarray(col_idx, np.int32)
            if extra.ndim != 2 or extra.min(initial=0) < 0 or extra.max(initial=0) >= width:
                raise TeacherInputError(
                    f"teacher: col_idx must be [R, k] indices into the {width} projected columns")
        return self._score(input_ids, attention_mask, rows, t_ids, extra,
                           "logits" if col_idx is None else "gather")

    def token_logprobs(self, input_ids, attention_mask, rows, targets) -> jax.Array:
        """log softmax over the full teacher vocabulary at `targets` [R], at flat rows [R]."""
        targets = np.asarray(targets, np.int32)
        vocab = self.model.cfg.vocab_size
        if targets.ndim != 1 or targets.min(initial=0) < 0 or targets.max(initial=0) >= vocab:
            raise TeacherInputError(f"teacher: targets must be [R] teacher ids in [0, {vocab})")
        return self._score(input_ids, attention_mask, rows, None, targets, "token_logprobs")

    # ------------------------------------------------------------------------------------
    def _score(self, input_ids, attention_mask, rows, t_ids, extra, mode) -> jax.Array:
        ids = np.asarray(input_ids, np.int32)
        if ids.ndim != 2:
            raise TeacherInputError(f"teacher: input_ids must be [B, T], got shape {ids.shape}")
        mask = (np.ones(ids.shape, bool) if attention_mask is None
                else np.asarray(attention_mask, bool))
        if mask.shape != ids.shape:
            raise TeacherInputError(
                f"teacher: attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        batch, length = ids.shape
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= batch * length):
            raise TeacherInputError(
                f"teacher: rows must be flat indices into [B*T] = [0, {batch * length})")
        if extra is not None and len(extra) != len(rows):
            raise TeacherInputError(
                f"teacher: {len(extra)} col_idx/targets rows for {len(rows)} rows")
        vocab = self.model.cfg.vocab_size
        if ids.min(initial=0) < 0 or ids.max(initial=0) >= vocab:
            raise TeacherInputError(f"teacher: input_ids outside the teacher vocabulary [0, {vocab})")

        seq = -(-length // self.length_bucket) * self.length_bucket
        per_mb = max(1, self.max_tokens // seq)
        per_mb = min(per_mb, _next_pow2(batch))
        if self.mesh is not None:
            shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            per_mb = -(-per_mb // shards) * shards
        graphdef, state = nnx.split(self.model)
        t_dev = None if t_ids is None else jnp.asarray(t_ids)
        seq_of_row, pos_of_row = rows // length, rows % length
        blocks, where = [], np.zeros(len(rows), np.int64)
        offset = 0
        for start in range(0, batch, per_mb):
            sel = np.nonzero((seq_of_row >= start) & (seq_of_row < start + per_mb))[0]
            if sel.size == 0:
                continue
            mb_ids = np.zeros((per_mb, seq), np.int32)
            mb_mask = np.zeros((per_mb, seq), bool)
            n = min(per_mb, batch - start)
            mb_ids[:n, :length] = ids[start:start + n]
            mb_mask[:n, :length] = mask[start:start + n]
            bucket = _next_pow2(sel.size)
            local = np.zeros(bucket, np.int32)
            local[:sel.size] = (seq_of_row[sel] - start) * seq + pos_of_row[sel]
            mb_extra = None
            if extra is not None:
                mb_extra = np.zeros((bucket,) + extra.shape[1:], np.int32)
                mb_extra[:sel.size] = extra[sel]
            arrays = [mb_ids, mb_mask]
            if self.mesh is not None:
                from ctopd_jax.mesh import batch_sharding

                arrays = [jax.device_put(a, batch_sharding(self.mesh, 2)) for a in arrays]
            blocks.append(_score_microbatch(state, *arrays, local, t_dev, mb_extra,
                                            graphdef=graphdef, mode=mode))
            where[sel] = offset + np.arange(sel.size)
            offset += bucket
        if not blocks:
            width = {"token_logprobs": (), "gather": extra.shape[1:] if extra is not None else ()}
            shape = width.get(mode, (vocab if t_ids is None else len(t_ids),))
            return jnp.zeros((0,) + tuple(shape), jnp.float32)
        return jnp.concatenate(blocks, axis=0)[jnp.asarray(where)]
