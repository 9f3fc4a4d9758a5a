"""Host collection of one iteration: render → generate → decode → re-tokenize → align.

`Collector.collect(prompts, seed)` returns a `HostBatch`: the re-tokenized student and teacher
sides (tokenization.retokenize, SPEC §1 step 3), their strict alignment (align.strict_align,
SPEC §2) and the engine's log-probs of the sampled tokens where the re-tokenized response
equals them. Objectives cut micro-batches out of it (`Objective.prepare`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ctopd_jax.algorithms import packed_rows
from ctopd_jax.algorithms.padded_rows import round_up
from ctopd_jax.align import strict_align
from ctopd_jax.align.strict import StrictAlignment
from ctopd_jax.data.prompts import response_text
from ctopd_jax.rollout.base import SamplingParams
from ctopd_jax.tokenization.retokenize import IGNORE_INDEX, RetokenizedBatch, retokenize_pair

if TYPE_CHECKING:
    from ctopd_jax.algorithms.turns import TurnRows


@dataclass
class HostBatch:
    """One iteration's collected samples, what every objective's `prepare` reads."""
    student: RetokenizedBatch        # the student side of the samples
    teacher: RetokenizedBatch        # the teacher side, same samples (the same object when
                                     # one tokenizer serves both)
    alignment: StrictAlignment       # the strict 1:1 pairs (SPEC §2)
    rollout_logprobs: tuple[np.ndarray, np.ndarray] | None  # (values, weights) per response row
    responses: list[str]
    finish_reasons: list[str]
    shard_samples: int = 0           # samples this process generated itself (its shard)
    turns: TurnRows | None = None    # turn structure of episodes (collect/episode_collector)
    turn_stats: dict | None = None   # their per-iteration metrics (reward, turns, curriculum)
    sources: list[str] | None = None  # where each sample's response came from (RESPONSE_SOURCES)
    # a served teacher's scores of the teacher side (teacher_service.batch_rows.ServedRows),
    # set by the loop after collection; None with a local teacher (its hidden rows run on device)
    served_teacher_rows: Any = None
    overlap: Any = None              # the teacher's OverlapMap with the student (set by the loop)
    derived: dict[str, Any] = field(default_factory=dict, repr=False)   # see `once`

    def once(self, key: str, compute: Callable[["HostBatch"], Any]) -> Any:
        """compute(self), computed the first time `key` is asked for on this batch: data an
        objective derives from the whole collected batch (SimCT segments, MP-OPD atoms) and
        reads for every micro-batch."""
        if key not in self.derived:
            self.derived[key] = compute(self)
        return self.derived[key]

    @property
    def size(self) -> int:
        return self.student.batch_size

    def mismatch_samples(self, limit: int = 2) -> list[dict]:
        """Records of samples whose byte views differ between the sides (for samples.jsonl)."""
        return [{"kind": "byte_mismatch", "response": self.responses[b],
                 "student_bytes": self.student.resp_bytes[b].decode("utf-8", "replace"),
                 "teacher_bytes": self.teacher.resp_bytes[b].decode("utf-8", "replace")}
                for b in np.flatnonzero(self.alignment.byte_mismatch)[:limit]]

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


def sort_by_length(result, group: int, budget: int = 0):
    """The samples of each consecutive block of `group` (one optimizer batch) ordered by
    generated length, longest first, so that its micro-batches hold similar lengths and pad to
    their own small buckets; with a packing `budget`, in first-fit-decreasing micro-batches of
    it instead (packed_rows.order, over prompt + response tokens). Which samples form an optimizer
    batch does not change, so neither does its loss (a sum over its samples ÷ its tokens).
    Stable: ties keep the engine's order."""
    order = []
    for start in range(0, len(result), group):
        block = np.arange(start, min(start + group, len(result)))
        if budget:
            lengths = np.array([[len(result.prompt_ids[result.prompt_index[i]]) + len(result.token_ids[i])]
                                for i in block])
            order += list(block[packed_rows.order(lengths, budget, [round_up(int(lengths.max()), 64)])])
        else:
            order += sorted(block, key=lambda i: -len(result.token_ids[i]))
    pick = lambda xs: [xs[i] for i in order]
    return type(result)(result.prompt_ids, pick(result.token_ids), pick(result.logprobs),
                        pick(result.finish_reasons), pick(result.prompt_index), result.stats)


class Collector:
    """Student rollouts of a prompt batch, re-tokenized on both sides and aligned.

    `group`: samples per optimizer batch; each such block is ordered by length, or in packed
    micro-batches of `budget` tokens (sort_by_length)."""

    def __init__(self, student_tok, teacher_tok, engine, rollout_section, group: int = 1, budget: int = 0):
        self.s_tok, self.t_tok, self.engine, self.rollout = student_tok, teacher_tok, engine, rollout_section
        self.group, self.budget = group, budget

    def collect(self, prompts, seed: int, timer, rollout_index: int = 0) -> HostBatch:
        s_texts = [render(self.s_tok, p) for p in prompts]
        t_texts = [render(self.t_tok, p) for p in prompts]
        with timer("rollout"):
            result = sort_by_length(self.engine.generate([self.s_tok.encode(t) for t in s_texts],
                                                         sampling_params(self.rollout, seed)), self.group, self.budget)
        with timer("align"):
            responses = [self.s_tok.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
            idx = result.prompt_index
            t_rt, s_rt = retokenize_pair(self.t_tok, self.s_tok, [t_texts[i] for i in idx],
                                         [s_texts[i] for i in idx], responses, pad_to_multiple=64)
            alignment = strict_align(t_rt, s_rt)
            eos = tuple(getattr(self.engine, "eos_ids", ())) + (self.s_tok.eos_id,)
            logprobs = rollout_logprobs(result, s_rt, eos)
        return HostBatch(s_rt, t_rt, alignment, logprobs, responses, list(result.finish_reasons),
                         int(result.stats.get("shard_samples", len(result))))


# ---------------------------------------------------------------------------------------------
# Same-tokenizer path (SPEC §9): the sampled ids are reused, no re-tokenization.
#
# Decisions where SPEC is silent:
# - A sample is cut at its FIRST EOS (any of the engine's EOS ids or the tokenizer's): that EOS
#   is trained, nothing after it is seen. A truncated sample gets the tokenizer's EOS appended,
#   as SPEC §1 does for every sample; that appended EOS has no engine log-prob (weight 0), so
#   the OPD family uses the recomputed π_old there (ratio 1).
# - Dataset responses (GKD off-policy) are tokenized once with the shared tokenizer + EOS; they
#   and teacher-generated responses (seq_kd) carry no student rollout log-probs.
# - With a mixed λ draw (gkd_lambda_granularity: micro_batch) each source generates one sample
#   per (prompt, sample) slot (n = 1, seed + source index), so slots keep their prompt.


def same_tokenizer_batch(side, prompt_ids, sampled, logprobs, eos_ids, pad_to_multiple: int = 64):
    """A RetokenizedBatch (tokenization.retokenize layout) of the reused sampled ids, and the
    rollout log-probs per response row (values, weights); see the decisions above."""
    eos = set(int(e) for e in eos_ids) | {side.eos_id}
    responses, values, weights = [], [], []
    for ids, lps in zip(sampled, logprobs):
        ids = [int(t) for t in ids]
        lps = list(lps) if lps is not None else [0.0] * len(ids)
        cut = next((i for i, t in enumerate(ids) if t in eos), None)
        body = ids if cut is None else ids[:cut]
        final = side.eos_id if cut is None else ids[cut]
        v = np.zeros(len(body) + 1, np.float32)
        w = np.zeros(len(body) + 1, np.float32)
        if logprobs is not None and len(lps) >= len(body):
            v[:len(body)], w[:len(body)] = lps[:len(body)], 1.0
            if cut is not None:
                v[-1], w[-1] = lps[cut], 1.0
        responses.append(body + [final])
        values.append(v)
        weights.append(w)
    trained = [np.ones(len(r), bool) for r in responses]
    return token_batch(side, prompt_ids, responses, trained, pad_to_multiple), \
        (np.concatenate(values), np.concatenate(weights))


def token_batch(side, prompt_ids, responses, trained, pad_to_multiple: int = 64):
    """A RetokenizedBatch of prompt + response ids whose loss covers the response tokens where
    `trained` is True (the rest, e.g. environment observations, is context only). Each response
    ends with its trained EOS; `resp_*` describe the trained tokens before it."""
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, responses)]
    lengths = np.array([len(s) for s in seqs])
    seq_len = -(-int(lengths.max()) // pad_to_multiple) * pad_to_multiple
    batch = len(seqs)
    input_ids = np.full((batch, seq_len), side.pad_id, np.int32)
    loss_mask = np.zeros((batch, seq_len), bool)
    prompt_lens = np.asarray([len(p) for p in prompt_ids], np.int32)
    bodies = []
    for b, (s, r, t) in enumerate(zip(seqs, responses, trained)):
        input_ids[b, :len(s)] = s
        loss_mask[b, prompt_lens[b] - 1 + np.flatnonzero(t)] = True   # row p predicts token p + 1
        bodies.append(np.asarray(r, np.int32)[np.asarray(t, bool)][:-1])
    pos = np.arange(seq_len)[None, :]
    labels = np.full((batch, seq_len), IGNORE_INDEX, np.int32)
    labels[:, :-1] = np.where(loss_mask[:, :-1], input_ids[:, 1:], IGNORE_INDEX)
    flat = np.concatenate(bodies) if bodies else np.zeros(0, np.int32)
    table = side.token_bytes
    return RetokenizedBatch(
        input_ids=input_ids, loss_mask=loss_mask, labels=labels, attention_mask=pos < lengths[:, None],
        prompt_lens=prompt_lens, response_lens=np.array([int(np.sum(t)) for t in trained], np.int32),
        resp_offsets=np.concatenate([[0], np.cumsum([len(x) for x in bodies])]).astype(np.int64),
        resp_ids=flat, resp_byte_len=side.token_byte_len[flat], resp_pairable=~side.is_added[flat],
        resp_stripped=np.zeros(len(flat), bool),
        resp_bytes=[b"".join(table[i] for i in x.tolist()) for x in bodies],
        responses=[side.decode(r) for r in responses], eos_id=side.eos_id)


def identity_alignment(batch):
    """The alignment of a same-tokenizer batch with itself: every trained row pairs with
    itself (the same ids on both sides), in loss-mask order, the last row of a sample its EOS."""
    rows = np.flatnonzero(batch.loss_mask.reshape(-1)).astype(np.int32)
    sample = (rows // batch.seq_len).astype(np.int32)
    is_eos = np.r_[sample[1:] != sample[:-1], True] if len(rows) else np.zeros(0, bool)
    counts = batch.response_lens.astype(np.int32)
    return StrictAlignment(teacher_rows=rows, student_rows=rows, pair_sample=sample, pair_is_eos=is_eos,
                           mismatch_groups=np.zeros((0, 5), np.int32),
                           byte_mismatch=np.zeros(batch.batch_size, bool), teacher_pairs=counts,
                           teacher_response_tokens=counts, student_response_tokens=counts,
                           group_source=(batch, batch))


class SameTokenizerCollector:
    """Responses for a same-tokenizer objective (`needs.reuse_sampled_ids`): student rollouts,
    teacher rollouts (`seq_kd`, a second engine over the teacher) or dataset responses, per the
    objective's `response_sources` (GKD's λ draw); the sampled ids are reused."""

    def __init__(self, side, engine, rollout_section, objective, *, teacher_engine=None,
                 train_batch_size: int = 0, micro_batch_size: int = 0):
        self.side, self.engine, self.rollout, self.objective = side, engine, rollout_section, objective
        self.teacher_engine = teacher_engine
        self.train_batch_size, self.micro_batch_size = train_batch_size, micro_batch_size

    def sample_sources(self, samples: int) -> list[str]:
        out = []
        per = self.train_batch_size or samples
        micro = self.micro_batch_size or per
        for _ in range(0, samples, per):  # one call per optimizer step
            for source in self.objective.response_sources(per // micro):
                out.extend([source] * micro)
        return out[:samples]

    def _generate(self, engine, prompt_ids, params):
        result = engine.generate(prompt_ids, params)
        return result.prompt_index, result.token_ids, result.logprobs, list(result.finish_reasons)

    def collect(self, prompts, seed: int, timer, rollout_index: int = 0) -> HostBatch:
        n = self.rollout.n_samples_per_prompt
        total = len(prompts) * n
        sources = self.sample_sources(total)
        encoded = [self.side.encode(render(self.side, p)) for p in prompts]
        slots = [None] * total  # (prompt ids, sampled ids, logprobs or None, finish reason)
        with timer("rollout"):
            for k, source in enumerate(sorted(set(sources))):
                idx = [b for b in range(total) if sources[b] == source]
                if source == "dataset":
                    for b in idx:
                        ids = self.side.encode(response_text(prompts[b // n]))
                        slots[b] = (encoded[b // n], ids + [self.side.eos_id], None, "dataset")
                    continue
                engine = self.engine if source == "student" else self.teacher_engine
                if engine is None:
                    raise ValueError(f"response source {source!r} needs an engine over the teacher "
                                     "(the objective's needs.teacher_engine); none was built")
                params = sampling_params(self.rollout, seed + k)
                if len(idx) == total:   # every slot: n samples per prompt, prompt-major
                    p_index, toks, lps, reasons = self._generate(engine, encoded, params)
                    order = range(total)
                else:
                    p_index, toks, lps, reasons = self._generate(
                        engine, [encoded[b // n] for b in idx], params.replace(n=1))
                    order = idx
                for j, b in enumerate(order):
                    slots[b] = (encoded[b // n], toks[j], lps[j] if source == "student" else None, reasons[j])
        with timer("align"):
            eos = tuple(getattr(self.engine, "eos_ids", ())) + (self.side.eos_id,)
            batch, (values, weights) = same_tokenizer_batch(
                self.side, [s[0] for s in slots], [s[1] for s in slots],
                [s[2] if s[2] is not None else [0.0] * len(s[1]) for s in slots], eos)
            for b, s in enumerate(slots):   # non-student responses carry no π_old
                if s[2] is None:
                    lo, hi = int(batch.response_lens[:b].sum()), int(batch.response_lens[:b + 1].sum())
                    weights[lo:hi] = 0.0
            alignment = identity_alignment(batch)
        return HostBatch(batch, batch, alignment, (values, weights), list(batch.responses),
                         [s[3] for s in slots], sources=sources)
