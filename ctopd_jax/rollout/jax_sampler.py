"""Native JAX rollout engine: continuous batching over decode slots, a paged KV cache.

What it is for: the engine that runs with nothing else installed (CPU tests, the tiny demo, a
student on one accelerator beside the trainer). A decode step is memory-bound; its floor is
(decode weights + the KV of the tokens that exist) / HBM bandwidth, and this engine is built
to read only that (ctopd_jax/plan/planner.py predicts it):

- Decode weights in the compute dtype: each call casts the live student's wider floating
  parameters to `cfg.dtype` once, on the device (no host round trip), and decodes from that
  copy. The model casts every weight to `cfg.dtype` where it uses it anyway, so the tokens
  and log-probs are those of decoding from the master weights; a LoRA student keeps its
  adapters unmerged, applied as in training (`lora_weight`).
- A paged KV cache (models/kv_cache.py, PagedKVCache): one pool of `page_size`-token pages
  sized from `kv_cache_budget_gb` (in tokens, not slots x maximum length), a page table per
  slot, pages taken as rows grow; admission, waiting and preemption are in rollout/pages.py.
- Ragged decode attention (kernels/paged_attention): each step reads the valid pages only
  (the Pallas GPU kernel per row; the XLA CPU path up to the longest row).
- Shared prompt pages: the n samples of a prompt reference its prompt's pages; one prefill.

How it decodes: `max_batch_size` slots (a power of two, never more than the samples of the
call). Samples are admitted into free slots (pages.py's rule); new prompts are prefilled in
one batched call; a jitted `while_loop` then decodes one token per active slot per step,
each slot at its own step and position, until ceil(refill_fraction * slots) slots have
finished, all are done, or the next step may need more pages than are free. The host then
collects finished samples, frees their pages, preempts if the pool ran dry, and admits more.

Determinism: the randomness of sample i at its step t is `fold_in(fold_in(key(seed), i), t)`
(i = the sample's index in the call, prompt-major), independent of slot, schedule and
preemption, so the tokens do not depend on `max_batch_size` or the budget. Log-probs may move
in the last float32 bits (<= 1.5e-6 seen) when batch shapes change, as batched matmuls
reassociate. The schedule is a pure function of the prompts and settings: reruns are
bit-exact.

Recompilation: prompt lengths bucketed (powers of two up to 128, then multiples of 128), new
tokens likewise, slots to a power of two; the pool is slots x table width pages (or what the
budget holds); sampling knobs are traced.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ctopd_jax.mesh.device_mesh import batch_sharding, logical_sharding
from ctopd_jax.models.kv_cache import page_pool_token_bytes
from ctopd_jax.rollout.base import (RolloutConfigError, RolloutEngine, RolloutResult, SamplingParams,
                                    check_prompts, finish_sample, normalize_eos_ids)
from ctopd_jax.rollout.paged_decode import (admit_newcomers, decode_until_refill, decode_weights,
                                            new_pool, prefill_pages, take_rows)
from ctopd_jax.rollout.pages import PagePool, cdiv

MIN_PROMPT_BUCKET = 16
DEFAULT_KV_CACHE_BUDGET_GB = 8.0
DEFAULT_PAGE_SIZE = 16


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


def slot_buffer_bytes(cfg, slots: int, max_new_bucket: int, table_width: int) -> int:
    """Per-call device bytes besides the pool: last logits (float32), token / log-prob
    buffers and the page table, per slot."""
    return slots * (cfg.vocab_size * 4 + max_new_bucket * 8 + table_width * 4)


def pool_pages(cfg, budget_gb: float, page_size: int, slots: int, max_new_bucket: int,
               table_width: int) -> int:
    """Pages the budget holds after the slot buffers (0 if none)."""
    left = budget_gb * 1e9 - slot_buffer_bytes(cfg, slots, max_new_bucket, table_width)
    return max(0, int(left // (page_pool_token_bytes(cfg) * page_size)))


class JaxSampler(RolloutEngine):
    """The embedded default rollout engine (see module docstring).

    Args:
      model: the student `Decoder` (read live at every call).
      eos_ids: token id(s) that end a sample (the student's EOS; several allowed).
      pad_id: id used for padding (any in-vocabulary id; padded positions are masked out).
      mesh: the student's mesh; slots are sharded over ("data", "fsdp"), the pool's kv heads
        over "tensor".
      max_batch_size: decode slots (the most samples decoded together).
      max_prompt_len: prompts longer than this are rejected with a clear error.
      kv_cache_budget_gb: device memory (GB, 1e9 bytes) for the page pool and the slot
        buffers; a call whose longest sample cannot fit in it fails before any device work.
      page_size: tokens per page.
      refill_fraction: return to the host to refill once this fraction of the slots is idle.
    """

    def __init__(self, model, eos_ids, pad_id: int | None = None, mesh=None,
                 max_batch_size: int = 256, max_prompt_len: int | None = None,
                 kv_cache_budget_gb: float = DEFAULT_KV_CACHE_BUDGET_GB,
                 page_size: int = DEFAULT_PAGE_SIZE, refill_fraction: float = 0.25,
                 vocab_limit: int | None = None):
        self._model = model
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        vocab = model.cfg.vocab_size
        # the tokenizer's size when the embedding has more rows: those are never sampled
        self.vocab_limit = int(vocab_limit) if vocab_limit is not None and vocab_limit < vocab else None
        for name, ids in (("eos_ids", self.eos_ids), ("pad_id", (self.pad_id,))):
            if any(not 0 <= i < vocab for i in ids):
                raise RolloutConfigError(
                    f"rollout.{name}={ids} outside the student vocabulary [0, {vocab})")
        if max_batch_size < 1:
            raise RolloutConfigError(f"rollout.jax_decode_slots (max_batch_size)={max_batch_size} must be >= 1")
        if not kv_cache_budget_gb > 0:
            raise RolloutConfigError(
                f"rollout.jax_kv_cache_budget_gb={kv_cache_budget_gb} must be > 0 (GB)")
        if page_size < 1:
            raise RolloutConfigError(f"rollout.jax_page_size={page_size} must be >= 1 token")
        if not 0 < refill_fraction <= 1:
            raise RolloutConfigError(
                f"JaxSampler refill_fraction={refill_fraction} must be in (0, 1]")
        self.mesh = mesh
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len
        self.kv_cache_budget_gb = float(kv_cache_budget_gb)
        self.page_size = int(page_size)
        self.refill_fraction = float(refill_fraction)

    @classmethod
    def from_config(cls, model, tokenizer, rollout, mesh=None) -> "JaxSampler":
        """From the run config's `rollout` section and the student tokenizer (eos_id, pad_id)."""
        return cls(model, eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id, mesh=mesh,
                   max_batch_size=rollout.jax_decode_slots,
                   max_prompt_len=rollout.max_prompt_len,
                   kv_cache_budget_gb=rollout.jax_kv_cache_budget_gb,
                   page_size=rollout.jax_page_size, vocab_limit=tokenizer.vocab_size)

    # -- protocol ---------------------------------------------------------------------------
    def update_weights(self, model: Any) -> None:
        self._model = model

    @property
    def model(self):
        return self._model

    def plan(self, num_samples: int, longest_prompt: int, max_new_tokens: int) -> dict:
        """Slots, pool pages and bytes a call would use (no device work); raises
        RolloutConfigError when the budget cannot hold one sample of the longest length."""
        cfg, page = self._model.cfg, self.page_size
        slots = batch_bucket(min(num_samples, self.max_batch_size), self._batch_multiple())
        prompt_len = length_bucket(longest_prompt, MIN_PROMPT_BUCKET)
        max_new_bucket = length_bucket(max_new_tokens)
        width = cdiv(prompt_len + max_new_bucket, page) + 1
        one_sample = cdiv(longest_prompt, page) + 1 + cdiv(max_new_tokens, page)
        budget = pool_pages(cfg, self.kv_cache_budget_gb, page, slots, max_new_bucket, width)
        if budget < one_sample:
            need = (one_sample * page * page_pool_token_bytes(cfg)
                    + slot_buffer_bytes(cfg, slots, max_new_bucket, width)) / 1e9
            raise RolloutConfigError(
                f"JaxSampler: rollout.jax_kv_cache_budget_gb={self.kv_cache_budget_gb:g} holds "
                f"{budget} pages of {page} tokens, fewer than one sample of "
                f"{longest_prompt} + {max_new_tokens} tokens needs ({one_sample}); raise it to "
                f">= {need:.3g}, lower rollout.jax_decode_slots / rollout.generate_max_len, or "
                f"use rollout.engine='vllm'")
        # No call uses more than every slot's full table plus its prompts' pages.
        pages = min(budget, slots * width)
        return dict(slots=slots, prompt_len=prompt_len, max_new_bucket=max_new_bucket,
                    table_width=width, pages=pages, page_size=page,
                    bytes=pages * page * page_pool_token_bytes(cfg)
                    + slot_buffer_bytes(cfg, slots, max_new_bucket, width))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        cfg = self._model.cfg
        prompts = check_prompts(prompts, cfg.vocab_size, self.max_prompt_len,
                                max_new_tokens=params.max_new_tokens,
                                positions=(cfg.max_position_embeddings,
                                           "the model's max_position_embeddings"))
        prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
        plan = self.plan(len(prompt_index), max(len(p) for p in prompts), params.max_new_tokens)
        graphdef, state = nnx.split(self._model)
        state = decode_weights(state, jnp.dtype(cfg.compute_dtype))
        tokens, logprobs, stats = self._run(graphdef, state, prompts, prompt_index, params, plan)
        out_tokens, out_lps, reasons = [], [], []
        for row_tokens, row_lps in zip(tokens, logprobs):
            t, lp, reason = finish_sample(row_tokens, row_lps, self.eos_ids,
                                          params.max_new_tokens, params.stop_on_eos)
            out_tokens.append(t)
            out_lps.append(lp)
            reasons.append(reason)
        return RolloutResult(prompt_ids=[prompts[i] for i in prompt_index], token_ids=out_tokens,
                             logprobs=out_lps, finish_reasons=reasons,
                             prompt_index=prompt_index, stats=stats)

    # -- internals --------------------------------------------------------------------------
    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _put(self, array):
        if self.mesh is None:
            return array
        return jax.device_put(array, batch_sharding(self.mesh, array.ndim))

    def _run(self, graphdef, state, prompts, prompt_index, params: SamplingParams, plan):
        cfg = self._model.cfg
        slots, prompt_len, page = plan["slots"], plan["prompt_len"], plan["page_size"]
        max_new_bucket, width = plan["max_new_bucket"], plan["table_width"]
        sharding = None
        if self.mesh is not None:
            shape = (cfg.num_kv_heads, plan["pages"], page, cfg.head_dim)
            sharding = logical_sharding(self.mesh, ("kv_heads", None, None, None), shape)
        k, v = new_pool(cfg=cfg, pages=plan["pages"], page_size=page, sharding=sharding)
        logits = self._put(jnp.zeros((slots, cfg.vocab_size), jnp.float32))
        tokens = self._put(jnp.full((slots, max_new_bucket), self.pad_id, jnp.int32))
        logprobs = self._put(jnp.zeros((slots, max_new_bucket), jnp.float32))
        pool = PagePool(plan["pages"], page, [len(p) for p in prompts],
                        [prompt_index.count(i) for i in range(len(prompts))])
        sample_ids = np.full(slots, -1, np.int32)
        steps = np.zeros(slots, np.int32)
        lengths = np.zeros(slots, np.int32)
        done = np.ones(slots, bool)
        table = np.zeros((slots, width), np.int32)

        top_k = int(params.top_k) if params.top_k > 0 else 0
        eos_ids = self.eos_ids if params.stop_on_eos else ()
        eos = np.full((next_pow2(max(1, len(eos_ids))),), -1, np.int32)
        eos[:len(eos_ids)] = eos_ids
        knobs = (np.uint32(params.seed % (1 << 32)), np.float32(params.temperature or 1.0),
                 np.int32(top_k), np.float32(params.top_p), np.int32(params.max_new_tokens), eos)
        static = dict(graphdef=graphdef, greedy=params.greedy, use_top_k=top_k > 0,
                      use_top_p=params.top_p < 1.0, pad_id=self.pad_id,
                      vocab_limit=self.vocab_limit)

        pending = collections.deque(range(len(prompt_index)))
        out_tokens: list = [None] * len(prompt_index)
        out_lps: list = [None] * len(prompt_index)
        refill_step = max(1, math.ceil(self.refill_fraction * slots))
        stats = collections.Counter()

        def admit():
            """Admit pending samples into free slots while pages allow (pages.py)."""
            nonlocal k, v, logits
            free = [int(r) for r in np.nonzero(sample_ids < 0)[0]]
            occupied = slots - len(free)
            admitted, copies, new_prompts = [], [], []
            for r in free:
                if not pending or not pool.can_admit(prompt_index[pending[0]], occupied + 1):
                    break
                s = pending.popleft()
                row, copy, new = pool.admit(prompt_index[s])
                new_prompts += [prompt_index[s]] if new else []
                copies += [copy] if copy else []
                table[r] = 0
                table[r, :len(row)] = row
                sample_ids[r], steps[r], done[r] = s, 0, False
                lengths[r] = len(prompts[prompt_index[s]])
                admitted.append(r)
                occupied += 1
            if new_prompts:
                k, v = self._prefill(graphdef, state, pool, prompts, new_prompts, prompt_len,
                                     k, v, stats)
            if admitted:
                # One program per power-of-two count of newcomers (copies <= newcomers).
                rows = np.full(batch_bucket(len(admitted), self._batch_multiple()), slots,
                               np.int32)   # padding rows: dropped
                rows[:len(admitted)] = admitted
                src = np.zeros(len(rows), np.int32)
                dst = np.full(len(rows), plan["pages"], np.int32)
                if copies:
                    src[:len(copies)], dst[:len(copies)] = zip(*copies)
                new_logits = np.zeros((len(rows), cfg.vocab_size), np.float32)
                new_logits[:len(admitted)] = [pool.resident[prompt_index[sample_ids[r]]].logits
                                              for r in admitted]
                k, v, logits = admit_newcomers(k, v, logits, src, dst, self._put(rows),
                                               self._put(new_logits))
                stats["refills"] += 1

        def release(r, finished):
            s = int(sample_ids[r])
            pool.release(prompt_index[s], table[r], int(lengths[r]), finished)
            sample_ids[r], done[r] = -1, True

        admit()
        stats["refills"] = 0
        while True:
            refill_min = min(refill_step, len(pending)) if pending else slots + 1
            before = steps.copy()
            stack = np.zeros(plan["pages"], np.int32)
            stack[:len(pool.free)] = pool.free
            (k, v, logits, tokens, logprobs, lengths_d, steps_d, done_d, top_d,
             table_d) = decode_until_refill(
                state, k, v, logits, tokens, logprobs, self._put(table), self._put(lengths),
                self._put(np.where(sample_ids >= 0, sample_ids + params.first_sample_id,
                                   -1).astype(np.int32)),
                self._put(steps), self._put(done), stack, np.int32(len(pool.free)), *knobs,
                np.int32(refill_min), **static)
            lengths, steps, done, table = (np.array(a) for a in jax.device_get(
                (lengths_d, steps_d, done_d, table_d)))
            pool.popped_to(int(top_d))
            stats["decode_steps"] += int((steps - before).max(initial=0))
            finished = np.nonzero(done & (sample_ids >= 0))[0]
            if len(finished):
                # the index padded to a power of two (repeating a row): one program per
                # bucket, not one per count of samples that finished together
                bucket = np.resize(finished, 1 << (len(finished) - 1).bit_length()).astype(np.int32)
                got_t, got_lp = jax.device_get(take_rows(tokens, logprobs, jnp.asarray(bucket)))
                for r, t, lp in zip(finished, got_t, got_lp):
                    s, n = int(sample_ids[r]), int(steps[r])
                    out_tokens[s], out_lps[s] = t[:n], lp[:n]
                    release(r, finished=True)
            if not pending and not (sample_ids >= 0).any():
                break
            if np.sum(~done & (lengths % page == 0)) > len(pool.free):
                # The pool ran dry: preempt the highest samples until the next step fits.
                while np.sum(~done & (lengths % page == 0)) > len(pool.free):
                    r = int(np.argmax(np.where(done, -1, sample_ids)))
                    pending.appendleft(int(sample_ids[r]))
                    release(r, finished=False)
                    stats["preemptions"] += 1
                continue  # decode before admitting again, so the preempted cannot bounce
            admit()
            if pending and not (sample_ids >= 0).any():   # plan() rules this out; never spin
                raise RuntimeError(f"JaxSampler: {len(pool.free)} free pages admit no sample")
        stats.update(slots=slots, pages=plan["pages"], page_size=page,
                     peak_pages=pool.peak_used, kv_cache_gb=plan["bytes"] / 1e9)
        return out_tokens, out_lps, dict(stats)

    def _prefill(self, graphdef, state, pool, prompts, new_prompts, prompt_len, k, v, stats):
        """One batched prefill of the prompts `new_prompts` into their pages (returns the
        pools); keeps each prompt's last logits on the host (pool.resident[...].logits)."""
        count = batch_bucket(len(new_prompts), self._batch_multiple())
        ids = np.full((count, prompt_len), self.pad_id, np.int32)
        mask = np.zeros((count, prompt_len), bool)
        table = np.zeros((count, cdiv(prompt_len, self.page_size)), np.int32)
        for j, p in enumerate(new_prompts):
            prompt = prompts[p]
            ids[j, prompt_len - len(prompt):] = prompt  # left padding
            mask[j, prompt_len - len(prompt):] = True
            pages = pool.resident[p].pages
            table[j, :len(pages)] = pages
            stats["prefill_tokens"] += len(prompt)
        k, v, last = prefill_pages(state, k, v, self._put(table), self._put(ids), self._put(mask),
                              graphdef=graphdef)
        last = np.asarray(jax.device_get(last))
        for j, p in enumerate(new_prompts):
            pool.resident[p].logits = last[j]
        return k, v


def compiled_variants() -> int:
    """How many programs the sampler has compiled in this process (tests check reuse)."""
    return (decode_until_refill._cache_size() + prefill_pages._cache_size()
            + admit_newcomers._cache_size() + new_pool._cache_size())
