"""Rollouts over several processes (jax.distributed): each process samples its shard of the
prompts with its own engine, and the samples are gathered, so every process runs the same host
work on the same data and assembles the same global arrays."""
from __future__ import annotations

from typing import Any, Callable

import jax

from ctopd_jax.mesh.arrays import allgather_objects, local_copy
from ctopd_jax.rollout.base import RolloutResult


class ProcessShardedEngine:
    """One engine per process (jax.distributed): process p samples only its shard of the prompts
    (a contiguous block, with the global sample ids, so the draws equal a single process's), and
    the samples are gathered so that every process builds the same host batch.

    The engine samples from a local copy of the student (gathered from the mesh each sync): fine
    for the embedded sampler and small students; vLLM gets its own copy per process likewise."""

    def __init__(self, make_engine: Callable[[Any], Any], student):
        self.engine = make_engine(local_copy(student))
        self.eos_ids = getattr(self.engine, "eos_ids", ())

    def generate(self, prompts, params):
        count, index = jax.process_count(), jax.process_index()
        per = -(-len(prompts) // count)
        first = min(index * per, len(prompts))
        mine = list(prompts[first:first + per])
        part = {"prompt_ids": [], "token_ids": [], "logprobs": [], "finish_reasons": [], "prompt_index": []}
        if mine:
            r = self.engine.generate(mine, params.replace(first_sample_id=first * params.n))
            part = {"prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "logprobs": r.logprobs,
                    "finish_reasons": r.finish_reasons, "prompt_index": [first + i for i in r.prompt_index]}
        parts = allgather_objects({k: [list(map(float, x)) if k == "logprobs" else x for x in v]
                                   for k, v in part.items()})
        merged = {k: [x for p in parts for x in p[k]] for k in part}
        return RolloutResult(**merged, stats={"shard_samples": len(part["token_ids"])})

    def update_weights(self, model) -> None:
        self.engine.update_weights(local_copy(model))

    def push_metrics(self) -> dict[str, float]:
        return self.engine.push_metrics()
