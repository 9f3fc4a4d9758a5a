"""The rollout protocol: what every engine (native JAX sampler, vLLM) offers the trainer.

Decisions where SPEC is silent:
- Samples are ordered prompt-major: the `n` samples of prompt i sit at indices i*n .. i*n+n-1
  (SPEC §1 "repeat each prompt n times").
- `token_ids` of a sample holds the generated tokens only (no prompt); when generation stopped
  on an EOS, that EOS is the last token and the finish reason is "stop"; otherwise the sample
  has exactly `max_new_tokens` tokens and the reason is "length".
- `logprobs[t]` is log softmax of the engine's UNMODIFIED logits (temperature 1, no top-k/top-p)
  at the sampled token. That is what vLLM returns by default ("raw_logprobs") and what the
  trainer recomputes, so the gap between them measures weight-sync and numerics drift only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class RolloutConfigError(ValueError):
    """Bad sampling parameters or engine settings; the message names the field and the fix."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature == 0 means greedy; top_k <= 0 and top_p == 1 disable them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    n: int = 1
    seed: int = 0
    stop_on_eos: bool = True
    # id of this call's first sample: randomness depends on (seed, sample id), so a process
    # that samples a shard of a batch passes its offset and draws what a single process would
    first_sample_id: int = 0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise RolloutConfigError(
                f"sampling.temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise RolloutConfigError(
                f"sampling.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable it")
        if int(self.top_k) != self.top_k:
            raise RolloutConfigError(f"sampling.top_k={self.top_k} must be an integer")
        if self.max_new_tokens < 1:
            raise RolloutConfigError(
                f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.n < 1:
            raise RolloutConfigError(f"sampling.n={self.n} must be >= 1 samples per prompt")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass
class RolloutResult:
    """Generated samples, prompt-major (see module docstring)."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    prompt_index: list[int]
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates with the current student policy."""

    eos_ids: tuple[int, ...]
    pad_id: int

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> RolloutResult: ...

    def update_weights(self, model: Any) -> None:
        """Make the next `generate` use these student weights (an NNX module)."""

    def push_metrics(self) -> dict[str, float]:
        """The last `update_weights`' metrics (a server's push: seconds, bytes, logprob_gap);
        {} for an engine that shares the trainer's weights in process."""
        return {}


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int,
                  max_len: int | None = None, *, max_new_tokens: int = 0,
                  positions: tuple[int, str] | None = None) -> list[list[int]]:
    """Validate prompt token ids before any device work; returns plain int lists.
    `positions`: (limit, what it is) that the longest prompt + `max_new_tokens` must fit, e.g.
    (max_position_embeddings, "the model's max_position_embeddings")."""
    if len(prompts) == 0:
        raise RolloutConfigError("generate: prompts is empty; pass at least one token id list")
    out = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise RolloutConfigError(
                f"generate: prompts[{i}] is empty; every prompt needs at least one token "
                "(render it with the chat template first)")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RolloutConfigError(
                f"generate: prompts[{i}] has token ids {bad[:5]} outside the vocabulary "
                f"[0, {vocab_size}); tokenize with the student's tokenizer")
        if max_len is not None and len(ids) > max_len:
            raise RolloutConfigError(
                f"generate: prompts[{i}] has {len(ids)} tokens, more than the engine's "
                f"max prompt length {max_len}; truncate prompts or raise rollout.max_prompt_len")
        out.append(ids)
    longest = max(len(p) for p in out)
    if positions is not None and longest + max_new_tokens > positions[0]:
        raise RolloutConfigError(
            f"generate: prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"{positions[1]}={positions[0]}; lower rollout.max_prompt_len / rollout.generate_max_len")
    return out


def normalize_eos_ids(eos_ids) -> tuple[int, ...]:
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, int):
        return (int(eos_ids),)
    return tuple(int(e) for e in eos_ids)


def finish_sample(tokens: Sequence[int], logprobs: Sequence[float], eos_ids: Sequence[int],
                  max_new_tokens: int, stop_on_eos: bool) -> tuple[list[int], list[float], str]:
    """Cut a generated row at its first EOS (kept) and name why it finished."""
    tokens = [int(t) for t in tokens[:max_new_tokens]]
    logprobs = [float(x) for x in logprobs[:max_new_tokens]]
    if stop_on_eos:
        for i, t in enumerate(tokens):
            if t in eos_ids:
                return tokens[: i + 1], logprobs[: i + 1], FINISH_STOP
    return tokens, logprobs, FINISH_LENGTH
