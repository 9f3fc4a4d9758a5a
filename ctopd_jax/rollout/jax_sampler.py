"""Native JAX rollout engine: continuous batching over a fixed number of decode slots.

What it is for: the CPU / small-model engine (tests, the tiny demo, debugging, a small student
on one accelerator). It is plain XLA: no paged attention, no CUDA graphs, every decode step
attends over the whole per-slot cache. For the reference workload (a 3B student, 256 rows of
up to 10,240 tokens) use rollout.engine='vllm' on GPU: a dense cache for that is, at
Llama-3.2-3B, 256 x 10,240 x 28 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes ~ 300 GB
(a paged cache holds only the tokens that exist). This
engine sizes its cache to its slots and refuses, with one line naming the setting, a request
whose cache does not fit `kv_cache_budget_gb` (see `kv_cache_bytes`).

How it decodes: `max_batch_size` slots (rounded to a power of two, never more than the samples
of the call) each hold one sample. All slots are prefilled at the start; then a jitted
`while_loop` decodes one token per active slot per step, each slot at its own step and RoPE
position. A slot whose sample stops (EOS or `max_new_tokens`) sits idle until at least
`ceil(refill_fraction * slots)` slots are idle (or no prompt is pending); the loop then returns
to the host, which collects the finished samples and prefills the next pending prompts into the
freed slots (one batched prefill, written into those slots' rows of the cache), and decoding
resumes. The cache holds slots x (prompt bucket + new-token bucket) positions, not
samples x ...: the memory is set by the slots, whatever the number of samples.

Cache layout per slot row (models/kv_cache.py contract, unchanged): positions [0, P) hold the
left-padded prompt (pads invalid), [P, P + max_new) the generated tokens fed back, and the last
position is a scratch slot: each decode step writes all rows' new K/V there through the
Decoder's shared `index`, then the step moves each row's entry to that row's own position
(a [layers, slots, kv_heads, head_dim] scatter) and marks it valid. So rows advance
independently without changing the Decoder's call signature.

Determinism: the randomness of sample i at its step t is `fold_in(fold_in(key(seed), i), t)`,
with i the sample's index in the call (prompt-major). It depends on neither the slot nor the
step at which the sample entered, so the sampled tokens are the same as the static-batch
sampler's (the previous version of this file: checked equal on greedy and seeded sampling, with
and without EOS, 4 and 32 slots) and the same for any `max_batch_size`. Log-probs may move in
the last float32 bits (<= 1.5e-6 seen) when the slot count or cache length changes, as batched
matmuls reassociate; a token could flip only on such an exact tie. The slot schedule is a pure
function of the prompts and settings, so a rerun (a resumed run) is bit-exact.

Recompilation: prompt and new-token lengths are bucketed (powers of two up to 128, then
multiples of 128), slots to a power of two; temperature, top-k, top-p, the seed and the actual
`max_new_tokens` are traced. One decode program serves every call in the same buckets, plus
one prefill program per power-of-two count of newcomers.

Weights: `generate` splits the live student module each call (no copy), so an optimizer step
that updates the module in place is seen by the next rollout; `update_weights(model)` only
swaps the module reference.

Not done: the `n` samples of a prompt each prefill the prompt (no shared prefix cache).
"""
from __future__ import annotations

import collections
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
DEFAULT_KV_CACHE_BUDGET_GB = 8.0


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def batch_bucket(n: int, multiple: int = 1) -> int:
    """Smallest power of two >= n, rounded up to a multiple of the batch shard count."""
    b = next_pow2(n)
    return -(-b // multiple) * multiple


def length_bucket(n: int, minimum: int = 1) -> int:
    """Powers of two up to 128, then multiples of 128 (bounded waste for long sequences)."""
    n = max(n, minimum)
    return next_pow2(n) if n <= 128 else -(-n // 128) * 128


def kv_cache_bytes(cfg, slots: int, cache_len: int) -> int:
    """Device bytes the sampler holds per call: K and V for every slot and position, the
    per-slot last logits (float32) and the per-slot token / log-prob buffers."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    kv = 2 * cfg.num_layers * slots * cache_len * cfg.num_kv_heads * cfg.head_dim * itemsize
    return kv + slots * cache_len + slots * cfg.vocab_size * 4 + slots * cache_len * 8


def check_kv_cache_fits(cfg, slots: int, cache_len: int, budget_gb: float) -> None:
    """One-line RolloutConfigError when `slots` x `cache_len` does not fit the budget."""
    need = kv_cache_bytes(cfg, slots, cache_len)
    budget = budget_gb * 1e9
    if need <= budget:
        return
    per_slot = kv_cache_bytes(cfg, 1, cache_len)
    fit = int(budget // per_slot)
    hint = (f"lower rollout.jax_decode_slots to <= {fit}" if fit >= 1 else
            "lower rollout.generate_max_len / rollout.max_prompt_len (not even one slot fits)")
    raise RolloutConfigError(
        f"JaxSampler: {slots} slots x {cache_len} cache positions need "
        f"{need / 1e9:.2f} GB of KV cache, over rollout.jax_kv_cache_budget_gb={budget_gb:g}; "
        f"{hint}, raise rollout.jax_kv_cache_budget_gb, or use rollout.engine='vllm'")


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "cache_len", "cache_sharding"))
def _new_slots(*, cfg, slots, cache_len, cache_sharding):
    cache = init_cache(cfg, slots, cache_len)
    if cache_sharding is not None:
        cache = cache._replace(k=jax.lax.with_sharding_constraint(cache.k, cache_sharding),
                               v=jax.lax.with_sharding_constraint(cache.v, cache_sharding))
    return cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache", "logits"))
def _prefill_slots(state, cache, logits, rows, input_ids, attention_mask, *, graphdef):
    """Prefill newcomers [R, P] (left padded) and write them into slot rows `rows` [R] of the
    cache (rows >= slots are padding newcomers and are dropped)."""
    model = nnx.merge(graphdef, state)
    r, p = input_ids.shape
    small = init_cache(model.cfg, r, p, dtype=cache.k.dtype)
    hidden, small = model.hidden_states(input_ids, prefill_positions(attention_mask),
                                        attention_mask, small)
    last_logits = model.logits(hidden[:, -1:])[:, 0]   # only the next token's row is sampled
    k = cache.k.at[:, rows, :p].set(small.k, mode="drop")
    v = cache.v.at[:, rows, :p].set(small.v, mode="drop")
    valid_rows = jnp.zeros((r, cache.max_len), bool).at[:, :p].set(attention_mask)
    valid = cache.valid.at[rows].set(valid_rows, mode="drop")
    logits = logits.at[rows].set(last_logits, mode="drop")
    return cache._replace(k=k, v=v, valid=valid), logits


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "prompt_len", "greedy", "use_top_k", "use_top_p", "pad_id"),
    donate_argnames=("cache", "logits", "tokens", "logprobs"))
def _decode_until_refill(state, cache, logits, tokens, logprobs, sample_ids, steps, positions,
                         done, seed, temperature, top_k, top_p, max_new_tokens, eos, refill_min,
                         *, graphdef, prompt_len, greedy, use_top_k, use_top_p, pad_id):
    """Decode until `refill_min` occupied slots have finished (or every slot is done)."""
    model = nnx.merge(graphdef, state)
    slots, max_new_bucket = tokens.shape
    scratch = cache.max_len - 1
    rows = jnp.arange(slots)
    occupied = sample_ids >= 0

    def cond(carry):
        done = carry[-1]
        return ~jnp.all(done) & (jnp.sum(done & occupied) < refill_min)

    def body(carry):
        cache, logits, tokens, logprobs, steps, positions, done = carry
        keys = None if greedy else sampling.sample_keys(seed, sample_ids, steps)
        tok, lp = sampling.sample_tokens(keys, logits, temperature, top_k, top_p, greedy=greedy,
                                         use_top_k=use_top_k, use_top_p=use_top_p)
        active = ~done
        tok = jnp.where(active, tok, pad_id)
        at = jnp.where(active, steps, max_new_bucket)  # out of bounds: dropped
        tokens = tokens.at[rows, at].set(tok, mode="drop")
        logprobs = logprobs.at[rows, at].set(lp, mode="drop")
        steps = steps + active
        finished = active & (jnp.any(tok[:, None] == eos[None, :], axis=-1)  # eos is -1 padded
                             | (steps >= max_new_tokens))
        feed = active & ~finished  # only rows that go on need the new token's K/V
        logits, new = model(tok[:, None], positions[:, None], feed[:, None],
                            cache._replace(index=jnp.asarray(scratch, jnp.int32)))
        # Move each row's new K/V from the scratch slot to the row's own next position.
        dest = jnp.where(feed, prompt_len + steps - 1, cache.max_len)  # out of bounds: dropped
        k = new.k.at[:, rows, dest].set(new.k[:, :, scratch], mode="drop")
        v = new.v.at[:, rows, dest].set(new.v[:, :, scratch], mode="drop")
        valid = new.valid.at[rows, dest].set(True, mode="drop").at[:, scratch].set(False)
        cache = cache._replace(k=k, v=v, valid=valid)
        return (cache, logits[:, -1], tokens, logprobs, steps, positions + feed,
                done | finished)

    carry = (cache, logits, tokens, logprobs, steps, positions, done)
    return jax.lax.while_loop(cond, body, carry)


@functools.partial(jax.jit, donate_argnames=())
def _take_rows(tokens, logprobs, rows):
    return tokens[rows], logprobs[rows]


class JaxSampler:
    """The embedded default rollout engine; CPU / small-model only (see module docstring).

    Args:
      model: the student `Decoder` (read live at every call).
      eos_ids: token id(s) that end a sample (the student's EOS; several allowed).
      pad_id: id used for padding (any in-vocabulary id; padded positions are masked out).
      mesh: the student's mesh; slots are sharded over ("data", "fsdp").
      max_batch_size: decode slots (samples decoded together); more samples than slots are
        served by refilling slots as samples finish.
      max_prompt_len: prompts longer than this are rejected with a clear error.
      kv_cache_budget_gb: the most device memory (GB, 1e9 bytes) the sampler's cache may take
        (`kv_cache_bytes`); a call whose slots x lengths exceed it fails before any device work.
      refill_fraction: return to the host to refill once this fraction of the slots is idle
        (smaller: fewer idle slots, more host round trips and prefill calls).
    """

    def __init__(self, model, eos_ids, pad_id: int | None = None, mesh=None,
                 max_batch_size: int = 256, max_prompt_len: int | None = None,
                 kv_cache_budget_gb: float = DEFAULT_KV_CACHE_BUDGET_GB,
                 refill_fraction: float = 0.25):
        self._model = model
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        vocab = model.cfg.vocab_size
        for name, ids in (("eos_ids", self.eos_ids), ("pad_id", (self.pad_id,))):
            if any(not 0 <= i < vocab for i in ids):
                raise RolloutConfigError(
                    f"rollout.{name}={ids} outside the student vocabulary [0, {vocab})")
        if max_batch_size < 1:
            raise RolloutConfigError(f"rollout.jax_decode_slots (max_batch_size)={max_batch_size} must be >= 1")
        if not kv_cache_budget_gb > 0:
            raise RolloutConfigError(
                f"rollout.jax_kv_cache_budget_gb={kv_cache_budget_gb} must be > 0 (GB)")
        if not 0 < refill_fraction <= 1:
            raise RolloutConfigError(
                f"JaxSampler refill_fraction={refill_fraction} must be in (0, 1]")
        self.mesh = mesh
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len
        self.kv_cache_budget_gb = float(kv_cache_budget_gb)
        self.refill_fraction = float(refill_fraction)

    @classmethod
    def from_config(cls, model, tokenizer, rollout, mesh=None) -> "JaxSampler":
        """From the run config's `rollout` section and the student tokenizer (eos_id, pad_id)."""
        return cls(model, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id, mesh=mesh,
                   max_batch_size=rollout.jax_decode_slots,
                   max_prompt_len=rollout.max_prompt_len,
                   kv_cache_budget_gb=rollout.jax_kv_cache_budget_gb)

    # -- protocol ---------------------------------------------------------------------------
    def update_weights(self, model: Any) -> None:
        self._model = model

    @property
    def model(self):
        return self._model

    def plan(self, num_samples: int, longest_prompt: int, max_new_tokens: int) -> dict:
        """Slots and cache length a call would use, and its cache bytes (no device work)."""
        slots = batch_bucket(min(num_samples, self.max_batch_size), self._batch_multiple())
        prompt_len = length_bucket(longest_prompt, MIN_PROMPT_BUCKET)
        max_new_bucket = length_bucket(max_new_tokens)
        cache_len = prompt_len + max_new_bucket  # the last position is the scratch slot
        return dict(slots=slots, prompt_len=prompt_len, max_new_bucket=max_new_bucket,
                    cache_len=cache_len,
                    bytes=kv_cache_bytes(self._model.cfg, slots, cache_len))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        cfg = self._model.cfg
        prompts = check_prompts(prompts, cfg.vocab_size, self.max_prompt_len,
                                max_new_tokens=params.max_new_tokens,
                                positions=(cfg.max_position_embeddings,
                                           "the model's max_position_embeddings"))
        expanded = [p for p in prompts for _ in range(params.n)]
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        longest = max(len(p) for p in prompts)
        plan = self.plan(len(expanded), longest, params.max_new_tokens)
        check_kv_cache_fits(cfg, plan["slots"], plan["cache_len"], self.kv_cache_budget_gb)
        graphdef, state = nnx.split(self._model)
        tokens, logprobs, stats = self._run(graphdef, state, expanded, params, plan)
        out_tokens, out_lps, reasons = [], [], []
        for row_tokens, row_lps in zip(tokens, logprobs):
            t, lp, reason = finish_sample(row_tokens, row_lps, self.eos_ids,
                                          params.max_new_tokens, params.stop_on_eos)
            out_tokens.append(t)
            out_lps.append(lp)
            reasons.append(reason)
        return RolloutResult(prompt_ids=expanded, token_ids=out_tokens, logprobs=out_lps,
                             finish_reasons=reasons, prompt_index=prompt_index, stats=stats)

    # -- internals --------------------------------------------------------------------------
    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _put(self, array):
        if self.mesh is None:
            return array
        from ctopd_jax.mesh import batch_sharding

        return jax.device_put(array, batch_sharding(self.mesh, array.ndim))

    def _run(self, graphdef, state, samples, params: SamplingParams, plan):
        cfg = self._model.cfg
        slots, prompt_len, cache_len = plan["slots"], plan["prompt_len"], plan["cache_len"]
        max_new_bucket = plan["max_new_bucket"]
        cache_sharding = None
        if self.mesh is not None:
            from ctopd_jax.mesh import logical_sharding

            cache_sharding = logical_sharding(
                self.mesh, (None, "batch", None, "kv_heads", None),
                (cfg.num_layers, slots, cache_len, cfg.num_kv_heads, cfg.head_dim))
        cache = _new_slots(cfg=cfg, slots=slots, cache_len=cache_len,
                           cache_sharding=cache_sharding)
        logits = self._put(jnp.zeros((slots, cfg.vocab_size), jnp.float32))
        tokens = self._put(jnp.full((slots, max_new_bucket), self.pad_id, jnp.int32))
        logprobs = self._put(jnp.zeros((slots, max_new_bucket), jnp.float32))
        sample_ids = np.full(slots, -1, np.int32)
        steps = np.zeros(slots, np.int32)
        positions = np.zeros(slots, np.int32)
        done = np.ones(slots, bool)

        top_k = int(params.top_k) if params.top_k > 0 else 0
        eos_ids = self.eos_ids if params.stop_on_eos else ()
        eos = np.full((next_pow2(max(1, len(eos_ids))),), -1, np.int32)
        eos[:len(eos_ids)] = eos_ids
        knobs = (np.uint32(params.seed % (1 << 32)), np.float32(params.temperature or 1.0),
                 np.int32(top_k), np.float32(params.top_p), np.int32(params.max_new_tokens), eos)
        static = dict(graphdef=graphdef, prompt_len=prompt_len, greedy=params.greedy,
                      use_top_k=top_k > 0, use_top_p=params.top_p < 1.0, pad_id=self.pad_id)

        pending = collections.deque(range(len(samples)))
        out_tokens: list = [None] * len(samples)
        out_lps: list = [None] * len(samples)
        refill_step = max(1, math.ceil(self.refill_fraction * slots))

        def fill(rows, first):
            """Prefill the next pending samples into `rows` (every slot on the first call:
            slots without a sample get a one-token dummy prompt so attention is defined)."""
            nonlocal cache, logits
            chosen = [(r, pending.popleft()) for r in rows if pending]
            if not chosen and not first:
                return
            fill_rows = list(rows) if first else [r for r, _ in chosen]
            count = batch_bucket(len(fill_rows), self._batch_multiple())
            ids = np.full((count, prompt_len), self.pad_id, np.int32)
            mask = np.zeros((count, prompt_len), bool)
            ids[:, -1], mask[:, -1] = self.pad_id, True  # dummy rows
            row_index = np.full(count, slots, np.int32)  # padding newcomers: dropped
            row_index[:len(fill_rows)] = fill_rows
            for j, (r, s) in enumerate(chosen):
                if first:
                    j = fill_rows.index(r)
                prompt = samples[s]
                ids[j, :] = self.pad_id
                mask[j, :] = False
                ids[j, prompt_len - len(prompt):] = prompt  # left padding
                mask[j, prompt_len - len(prompt):] = True
                sample_ids[r], steps[r], positions[r], done[r] = s, 0, len(prompt), False
            cache, logits = _prefill_slots(state, cache, logits, self._put(row_index),
                                           self._put(ids), self._put(mask), graphdef=graphdef)

        fill(range(slots), first=True)
        decode_steps = refills = 0
        while True:
            refill_min = min(refill_step, len(pending)) if pending else slots + 1
            before = steps.copy()
            cache, logits, tokens, logprobs, steps_d, positions_d, done_d = _decode_until_refill(
                state, cache, logits, tokens, logprobs,
                self._put(np.where(sample_ids >= 0, sample_ids + params.first_sample_id, -1).astype(np.int32)),
                self._put(steps), self._put(positions), self._put(done), *knobs,
                np.int32(refill_min), **static)
            steps, positions, done = (np.array(a) for a in
                                      jax.device_get((steps_d, positions_d, done_d)))
            decode_steps += int((steps - before).max(initial=0))
            finished = np.nonzero(done & (sample_ids >= 0))[0]
            if len(finished):
                got_t, got_lp = jax.device_get(_take_rows(tokens, logprobs,
                                                          jnp.asarray(finished, jnp.int32)))
                for r, t, lp in zip(finished, got_t, got_lp):
                    s, n = int(sample_ids[r]), int(steps[r])
                    out_tokens[s], out_lps[s] = t[:n], lp[:n]
                    sample_ids[r] = -1
            if not pending and not (sample_ids >= 0).any():
                break
            free = [int(r) for r in np.nonzero(sample_ids < 0)[0]]
            if pending and free:
                refills += 1
                fill(free, first=False)
        return out_tokens, out_lps, {"decode_steps": decode_steps, "refills": refills,
                                     "slots": slots, "cache_len": cache_len,
                                     "kv_cache_gb": plan["bytes"] / 1e9}


def compiled_variants() -> int:
    """How many programs the sampler has compiled in this process (tests check reuse)."""
    return (_decode_until_refill._cache_size() + _prefill_slots._cache_size()
            + _new_slots._cache_size())
