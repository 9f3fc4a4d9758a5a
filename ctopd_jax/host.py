"""Host collection of one iteration: render → generate → decode → re-tokenize → align.

`Collector.collect(prompts, seed)` returns a `HostBatch`: the re-tokenized student and teacher
sides (tokenization.retokenize, SPEC §1 step 3), their strict alignment (align.strict_align,
SPEC §2) and the engine's log-probs of the sampled tokens where the re-tokenized response
equals them. Objectives cut micro-batches out of it (`Objective.prepare`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ctopd_jax.rollout.base import SamplingParams


@dataclass
class HostBatch:
    student: Any                     # tokenization.retokenize.RetokenizedBatch
    teacher: Any                     # the teacher side, same samples
    alignment: Any                   # align.StrictAlignment
    rollout_logprobs: tuple[np.ndarray, np.ndarray] | None  # (values, weights) per response row
    responses: list[str]
    finish_reasons: list[str]

    @property
    def size(self) -> int:
        return self.student.batch_size

    def tokens(self, start: int, stop: int) -> float:
        """Student response tokens (EOS included) of samples [start, stop): SPEC §1's N."""
        return float(self.student.response_lens[start:stop].sum())


def render(side, prompt) -> str:
    return side.render_chat(list(prompt.messages), add_generation_prompt=True)


def sampling_params(rollout, seed: int) -> SamplingParams:
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=max(0, rollout.top_k), max_new_tokens=rollout.generate_max_len,
                          n=rollout.n_samples_per_prompt, seed=seed)


def rollout_logprobs(result, student, eos_ids) -> tuple[np.ndarray, np.ndarray]:
    """Engine log-probs per response row (loss-mask order), weight 1 where the re-tokenized
    response equals the sampled ids (else there is nothing to compare)."""
    values, weights = [], []
    eos = set(eos_ids)
    for b, (sampled, lps) in enumerate(zip(result.token_ids, result.logprobs)):
        n = int(student.response_lens[b])
        resp = student.resp_ids[student.resp_offsets[b]:student.resp_offsets[b + 1]]
        sampled = list(sampled)
        ended = bool(sampled) and sampled[-1] in eos
        body = sampled[:-1] if ended else sampled
        v, w = np.zeros(n, np.float32), np.zeros(n, np.float32)
        if len(body) == len(resp) and np.array_equal(np.asarray(body), resp):
            v[:len(body)], w[:len(body)] = lps[:len(body)], 1.0
            if ended:
                v[n - 1], w[n - 1] = lps[-1], 1.0
        values.append(v)
        weights.append(w)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.float32)
    return cat(values), cat(weights)


class Collector:
    """Student rollouts of a prompt batch, re-tokenized on both sides and aligned."""

    def __init__(self, student_tok, teacher_tok, engine, rollout_section):
        self.s_tok, self.t_tok, self.engine, self.rollout = student_tok, teacher_tok, engine, rollout_section

    def collect(self, prompts, seed: int, timer) -> HostBatch:
        from ctopd_jax.align import strict_align
        from ctopd_jax.tokenization.retokenize import retokenize_pair

        s_texts = [render(self.s_tok, p) for p in prompts]
        t_texts = [render(self.t_tok, p) for p in prompts]
        with timer("rollout"):
            result = self.engine.generate([self.s_tok.encode(t) for t in s_texts],
                                          sampling_params(self.rollout, seed))
        with timer("align"):
            responses = [self.s_tok.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
            idx = result.prompt_index
            t_rt, s_rt = retokenize_pair(self.t_tok, self.s_tok, [t_texts[i] for i in idx],
                                         [s_texts[i] for i in idx], responses, pad_to_multiple=64)
            alignment = strict_align(t_rt, s_rt)
            eos = tuple(getattr(self.engine, "eos_ids", ())) + (self.s_tok.eos_id,)
            logprobs = rollout_logprobs(result, s_rt, eos)
        return HostBatch(s_rt, t_rt, alignment, logprobs, responses, list(result.finish_reasons))
