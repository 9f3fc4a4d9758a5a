"""Native JAX rollout engine: batched, jit-compiled generation on the student's own params.

How it avoids recompiling: prompts are left-padded to a power-of-two length (>= 16), the batch
to a power of two (and a multiple of the mesh's batch shards), and the decode loop runs for a
power-of-two bucket of `max_new_tokens` with the actual count as a traced bound; temperature,
top-k, top-p and the seed are traced too. So one compiled program serves every call whose
shapes fall in the same buckets (and sampling mode: greedy or not, filters on or off).

How it stays in sync for free: `generate` splits the live student module each call (no copy),
so an optimizer step that updates the module in place is seen by the next rollout;
`update_weights(model)` only swaps the module reference.

Determinism: the randomness of sample i at step t is `fold_in(fold_in(key(seed), i), t)`, with
i the sample's index in the call (prompt-major), so it does not depend on batch bucketing or
chunking (`max_batch_size`). Finished rows keep being computed (static shapes) but their
tokens are replaced by pad and they stop writing to the KV cache.

Not done (yet): the `n` samples of a prompt each prefill the prompt (no shared prefix cache),
and the decode loop attends over the whole cache bucket every step (static shapes).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.models.kv_cache import init_cache, prefill_positions
from ctopd_jax.rollout import sampling
from ctopd_jax.rollout.base import (RolloutConfigError, RolloutResult, SamplingParams,
                                    check_prompts, finish_sample, normalize_eos_ids)

MIN_PROMPT_BUCKET = 16


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def batch_bucket(n: int, multiple: int = 1) -> int:
    """Smallest power of two >= n, rounded up to a multiple of the batch shard count."""
    b = next_pow2(n)
    return -(-b // multiple) * multiple


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "cache_len", "max_new_bucket", "greedy", "use_top_k", "use_top_p",
    "pad_id", "cache_sharding"))
def _generate_compiled(state, input_ids, attention_mask, sample_ids, seed, temperature, top_k,
                       top_p, max_new_tokens, eos, *, graphdef, cache_len, max_new_bucket, greedy,
                       use_top_k, use_top_p, pad_id, cache_sharding):
    model = nnx.merge(graphdef, state)
    batch = input_ids.shape[0]
    cache = init_cache(model.cfg, batch, cache_len)
    if cache_sharding is not None:
        cache = cache._replace(k=jax.lax.with_sharding_constraint(cache.k, cache_sharding),
                               v=jax.lax.with_sharding_constraint(cache.v, cache_sharding))
    logits, cache = model(input_ids, prefill_positions(attention_mask), attention_mask, cache)

    def cond(carry):
        step, _, _, _, _, done = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, last_logits, tokens, logprobs, done = carry
        keys = None if greedy else sampling.sample_keys(seed, sample_ids, step)
        tok, lp = sampling.sample_tokens(keys, last_logits, temperature, top_k, top_p,
                                         greedy=greedy, use_top_k=use_top_k,
                                         use_top_p=use_top_p)
        tok = jnp.where(done, pad_id, tok)
        tokens = tokens.at[:, step].set(tok)
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, lp))
        active = ~done
        logits, cache = model(tok[:, None], cache.lengths[:, None], active[:, None], cache)
        done = done | jnp.any(tok[:, None] == eos[None, :], axis=-1)  # eos is -1 padded
        return step + 1, cache, logits[:, -1], tokens, logprobs, done

    carry = (jnp.zeros((), jnp.int32), cache, logits[:, -1],
             jnp.full((batch, max_new_bucket), pad_id, jnp.int32),
             jnp.zeros((batch, max_new_bucket), jnp.float32),
             sample_ids < 0)  # padding rows of the batch bucket start finished
    steps, _, _, tokens, logprobs, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, logprobs, steps


class JaxSampler:
    """The embedded default rollout engine (see module docstring).

    Args:
      model: the student `Decoder` (read live at every call).
      eos_ids: token id(s) that end a sample (the student's EOS; several allowed).
      pad_id: id used for padding (any in-vocabulary id; padded slots are masked out).
      mesh: the student's mesh; batch rows are sharded over ("data", "fsdp").
      max_batch_size: samples per compiled call; larger requests run in chunks.
      max_prompt_len: prompts longer than this are rejected with a clear error.
    """

    def __init__(self, model, eos_ids, pad_id: int | None = None, mesh=None,
                 max_batch_size: int = 256, max_prompt_len: int | None = None):
        self._model = model
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        vocab = model.cfg.vocab_size
        for name, ids in (("eos_ids", self.eos_ids), ("pad_id", (self.pad_id,))):
            if any(not 0 <= i < vocab for i in ids):
                raise RolloutConfigError(
                    f"rollout.{name}={ids} outside the student vocabulary [0, {vocab})")
        if max_batch_size < 1:
            raise RolloutConfigError(f"rollout.max_batch_size={max_batch_size} must be >= 1")
        self.mesh = mesh
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len

    # -- protocol ---------------------------------------------------------------------------
    def update_weights(self, model: Any) -> None:
        self._model = model

    @property
    def model(self):
        return self._model

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        cfg = self._model.cfg
        prompts = check_prompts(prompts, cfg.vocab_size, self.max_prompt_len)
        expanded = [p for p in prompts for _ in range(params.n)]
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > cfg.max_position_embeddings:
            raise RolloutConfigError(
                f"generate: prompt ({longest}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"model.max_position_embeddings={cfg.max_position_embeddings}; lower "
                "rollout.max_new_tokens or truncate prompts")
        graphdef, state = nnx.split(self._model)
        tokens, logprobs, steps = [], [], 0
        for start in range(0, len(expanded), self.max_batch_size):
            chunk = expanded[start:start + self.max_batch_size]
            t, lp, s = self._run_chunk(graphdef, state, chunk, start, params)
            tokens.append(t)
            logprobs.append(lp)
            steps += s
        tokens = np.concatenate(tokens)
        logprobs = np.concatenate(logprobs)
        out_tokens, out_lps, reasons = [], [], []
        for row_tokens, row_lps in zip(tokens, logprobs):
            t, lp, reason = finish_sample(row_tokens, row_lps, self.eos_ids,
                                          params.max_new_tokens, params.stop_on_eos)
            out_tokens.append(t)
            out_lps.append(lp)
            reasons.append(reason)
        return RolloutResult(prompt_ids=expanded, token_ids=out_tokens, logprobs=out_lps,
                             finish_reasons=reasons, prompt_index=prompt_index,
                             stats={"decode_steps": steps})

    # -- internals --------------------------------------------------------------------------
    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _run_chunk(self, graphdef, state, chunk, first_sample_id, params: SamplingParams):
        n = len(chunk)
        batch = batch_bucket(n, self._batch_multiple())
        prompt_len = max(MIN_PROMPT_BUCKET, next_pow2(max(len(p) for p in chunk)))
        max_new_bucket = next_pow2(params.max_new_tokens)
        ids = np.full((batch, prompt_len), self.pad_id, np.int32)
        mask = np.zeros((batch, prompt_len), bool)
        for row, prompt in enumerate(chunk):  # left padding: the last column is real
            ids[row, prompt_len - len(prompt):] = prompt
            mask[row, prompt_len - len(prompt):] = True
        ids[n:, -1] = self.pad_id  # padding rows hold one masked-in token so softmax is defined
        mask[n:, -1] = True
        sample_ids = np.where(np.arange(batch) < n, first_sample_id + np.arange(batch), -1)
        sample_ids = sample_ids.astype(np.int32)

        arrays = (ids, mask, sample_ids)
        cache_sharding = None
        if self.mesh is not None:
            from ctopd_jax.mesh import batch_sharding, logical_sharding

            arrays = tuple(jax.device_put(a, batch_sharding(self.mesh, a.ndim)) for a in arrays)
            cfg = self._model.cfg
            cache_shape = (cfg.num_layers, batch, prompt_len + max_new_bucket,
                           cfg.num_kv_heads, cfg.head_dim)
            cache_sharding = logical_sharding(
                self.mesh, (None, "batch", None, "kv_heads", None), cache_shape)
        top_k = int(params.top_k) if params.top_k > 0 else 0
        eos_ids = self.eos_ids if params.stop_on_eos else ()
        eos = np.full((next_pow2(max(1, len(eos_ids))),), -1, np.int32)
        eos[:len(eos_ids)] = eos_ids
        tokens, logprobs, steps = _generate_compiled(
            state, *arrays, np.uint32(params.seed % (1 << 32)), np.float32(params.temperature or 1.0),
            np.int32(top_k), np.float32(params.top_p), np.int32(params.max_new_tokens), eos,
            graphdef=graphdef, cache_len=prompt_len + max_new_bucket,
            max_new_bucket=max_new_bucket, greedy=params.greedy,
            use_top_k=top_k > 0, use_top_p=params.top_p < 1.0,
            pad_id=self.pad_id,
            cache_sharding=cache_sharding)
        tokens, logprobs = jax.device_get((tokens, logprobs))
        return np.asarray(tokens)[:n], np.asarray(logprobs)[:n], int(steps)


def compiled_variants() -> int:
    """How many programs the sampler has compiled in this process (tests check reuse)."""
    return _generate_compiled._cache_size()
