"""What a served teacher returns for one sequence, and the checks every engine's parser shares.

For a sequence `ids` scored from `start` (the first response position), row j describes position
t = start + j: `token_logprobs[j] = log p_T(ids[t] | ids[:t])` and the teacher's top-k of that
same next-token distribution, sorted by log-prob (descending, ties by id). These are
full-vocabulary log-probs at temperature 1 (both engines report the raw model distribution).

The local teacher's equivalent is its prefill row t - 1 (the row that predicts ids[t]).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# vLLM reports a -inf log-prob as -9999.0 and SGLang as -999999999.0 (JSON has no -inf): any
# value at or below this is -inf again. A real float32 log-softmax never gets near it.
NEG_INF_SENTINEL = -9999.0


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The scoring side of one engine's server, which every protocol module states the same way
    (`vllm_protocol.ENDPOINTS`, `sglang_protocol.ENDPOINTS`)."""
    score: str           # POST: the log-probs and top-k of a batch of sequences
    health: str          # GET: 200 while the server (and its engine) lives
    info: str            # GET: the served model's facts (`server_info`)
    start_command: str   # how a user starts one (named when none answers)
    top_k_fix: str       # the fix when teacher.top_k is above the server's limit


class ProtocolError(RuntimeError):
    """The server answered, but not in the shape its engine's protocol promises."""


def adapter_request(name: str, folder: str) -> dict:
    """The body that loads a LoRA adapter from `folder` as `name`: vLLM's /v1/load_lora_adapter
    and SGLang's /load_lora_adapter take the same one (each protocol module re-exports it)."""
    return {"lora_name": name, "lora_path": folder}


@dataclasses.dataclass(frozen=True, eq=False)
class ScoredSequence:
    token_logprobs: np.ndarray  # float32 [n]
    topk_ids: np.ndarray        # int32 [n, k]
    topk_logprobs: np.ndarray   # float32 [n, k]

    def __len__(self) -> int:
        return int(self.token_logprobs.shape[0])


def answer_items(items, count: int, noun: str) -> list:
    """`items` when it is a list of `count` answers (one per request row), else ProtocolError
    "expected <noun with the count>, got ..." (`noun`: e.g. "{} choices")."""
    if not isinstance(items, list) or len(items) != count:
        raise ProtocolError(f"expected {noun.format(count)}, got "
                            f"{len(items) if isinstance(items, list) else type(items)}")
    return items


def logprob_value(value) -> float:
    if value is None:
        raise ProtocolError("a log-prob is null where the request asked for one")
    value = float(value)
    if math.isnan(value):
        raise ProtocolError("a log-prob is NaN")
    return -math.inf if value <= NEG_INF_SENTINEL else value


def top_k_rows(entries_per_row: list[list[tuple[int, float]]], k: int) -> tuple[np.ndarray,
                                                                                 np.ndarray]:
    """[(id, log-prob), ...] per row → the k best as int32 [n, k], float32 [n, k].

    The engines list the top-k plus, in vLLM, the realised token when it is outside the top-k;
    sorting here by (-log-prob, id) gives one order whatever the server's."""
    n = len(entries_per_row)
    ids = np.zeros((n, k), np.int32)
    logprobs = np.zeros((n, k), np.float32)
    for row, entries in enumerate(entries_per_row):
        best = {}
        for token, value in entries:
            best[token] = value
        if len(best) < k:
            raise ProtocolError(f"{len(best)} top log-probs at a position where {k} were asked")
        ranked = sorted(best.items(), key=lambda item: (-item[1], item[0]))[:k]
        ids[row] = [token for token, _ in ranked]
        logprobs[row] = [value for _, value in ranked]
    return ids, logprobs


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    model: str                  # the name to put in requests ("" where the engine needs none)
    names: tuple[str, ...]      # every name the server answers to (served name, model path)
    max_model_len: int | None   # longest sequence + generated token it accepts; None: unknown
