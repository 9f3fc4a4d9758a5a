"""SGLang's native server: what to send and how to read the answer.

Scoring request (POST /generate), one or several sequences per request:
    {"input_ids": [[ids...], ...],
     "sampling_params": {"max_new_tokens": 1, "temperature": 1, "top_p": 1},
     "return_logprob": true, "logprob_start_len": [L, ...], "top_logprobs_num": k}
Ids in, so nothing is tokenized by the server. Temperature and top_p are 1 on purpose: a server
started with temperature-scaled / top-p-normalised log-probs applies the request's sampling
settings to the returned log-probs too, and the client promises the raw (τ = 1) distribution.

Answer: a list, one object per sequence in request order, with
    meta_info.input_token_logprobs = [[logprob, token_id, text|null], ...]
    meta_info.input_top_logprobs   = [null | [[logprob, token_id, text|null] x k], ...]
covering the input positions L .. n-1 (SGLang's own tests assert len + L == prompt_tokens; the
entry of position 0 has a null log-prob). We ask from L = start - 1 and keep the last n - start
entries, after checking each entry's token id against ids[t]: that reads right whichever of
the two conventions a release uses (an older one started one position later), and a shifted
answer is caught instead of silently misaligned.

Server facts: GET /get_model_info gives {"model_path", "tokenizer_path", ...}; GET
/get_server_info the server arguments (`served_model_name`, `context_length`) where the release
has it. An input id >= the vocabulary size is refused: "The input_ids ... contains values
greater than the vocab size (V)". SGLang does not install on this project's machines (see
docs/served_teacher.md): this module is tested against answers written after that shape.
"""
from __future__ import annotations

import numpy as np

from ctopd_jax.teacher_service.scores import (Endpoints, ProtocolError, ScoredSequence,
                                              ServerInfo, answer_items, logprob_value, top_k_rows)
from ctopd_jax.teacher_service.scores import adapter_request  # noqa: F401  (this engine's too)
from ctopd_jax.teacher_service.transport import ServerError

ENDPOINTS = Endpoints("/generate", "/health", "/get_model_info",
                      "python -m sglang.launch_server --model-path <teacher> --port <port>",
                      "lower {prefix}.top_k")


def score_request(batch: list[tuple[list[int], int]], top_k: int, model: str) -> dict:
    return {"input_ids": [ids for ids, _ in batch],
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0},
            "return_logprob": True,
            "logprob_start_len": [start - 1 for _, start in batch],
            "top_logprobs_num": top_k}


def parse_scores(answer, batch: list[tuple[list[int], int]], top_k: int):
    if isinstance(answer, dict) and len(batch) == 1:
        answer = [answer]
    answer = answer_items(answer, len(batch), "a list of {} results")
    return [_one(item, ids, start, top_k) for item, (ids, start) in zip(answer, batch)]


def _one(item: dict, ids: list[int], start: int, top_k: int) -> ScoredSequence:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        raise ProtocolError("a result has no meta_info")
    tokens, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    n = len(ids) - start
    if top_k == 0 and isinstance(tokens, list):  # no top-k asked: SGLang may omit the field
        tops = [[] for _ in tokens]
    if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops):
        raise ProtocolError("meta_info lacks input_token_logprobs / input_top_logprobs of one "
                            "length (was return_logprob honoured?)")
    if len(tokens) < n:
        raise ProtocolError(f"{len(tokens)} input log-probs for {n} response positions")
    tokens, tops = tokens[len(tokens) - n:], tops[len(tops) - n:]
    token_logprobs = np.zeros(n, np.float32)
    entries = []
    for j, t in enumerate(range(start, len(ids))):
        value, token = tokens[j][0], int(tokens[j][1])
        if token != ids[t]:
            raise ProtocolError(f"input_token_logprobs names id {token} at position {t}, where "
                                f"the request had {ids[t]} (positions shifted)")
        token_logprobs[j] = logprob_value(value)
        if not isinstance(tops[j], list):
            raise ProtocolError(f"input_top_logprobs at position {t} is {tops[j]!r}")
        entries.append([(int(e[1]), logprob_value(e[0])) for e in tops[j]])
    topk_ids, topk_logprobs = top_k_rows(entries, top_k)
    return ScoredSequence(token_logprobs, topk_ids, topk_logprobs)


def server_info(get) -> ServerInfo:
    """The served model from GET /get_model_info (+ /get_server_info where it exists)."""
    info = get(ENDPOINTS.info)
    if not isinstance(info, dict) or "model_path" not in info:
        raise ProtocolError("GET /get_model_info has no model_path")
    names = [str(info["model_path"])]
    if info.get("tokenizer_path"):
        names.append(str(info["tokenizer_path"]))
    max_len = None
    try:
        server = get("/get_server_info")
    except ServerError as err:
        if err.status is None or err.status >= 500:
            raise
        server = {}  # an older release without the route: no length limit to learn
    if isinstance(server, dict):
        served = server.get("served_model_name")
        if served:
            names.insert(0, str(served))
        if isinstance(server.get("context_length"), int):
            max_len = server["context_length"]
    return ServerInfo(model="", names=tuple(names), max_model_len=max_len)


def is_out_of_vocabulary(message: str) -> bool:
    return "vocab size" in message


def is_top_k_limit(message: str) -> bool:
    return False  # SGLang sets no limit on top_logprobs_num


# -- the student's rollouts on an SGLang server (rollout.engine: sglang_server, rollout/served.py)
# Generation: POST /generate with `input_ids` (each prompt repeated n times: one result per
# sample, in order) and return_logprob; meta_info.output_token_logprobs = [[logprob, id, null],
# ...] per generated token (SGLang's logprobs are of the unmodified distribution unless the
# server was started with --enable-... temperature scaling; the client asks at temperature 1
# only for scoring). Weights: POST /load_lora_adapter {lora_name, lora_path} (generated with
# "lora_path": name), full weights POST /update_weights_from_disk {"model_path": folder} (it
# flushes the cache itself). GPU-only routes: /update_weights_from_distributed (NCCL group set
# up by /init_weights_update_group) and /update_weights_from_tensor (same-GPU tensors).
GENERATE_PATH = "/generate"
LOAD_ADAPTER_PATH = "/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/unload_lora_adapter"
RESET_CACHE_PATH = None
SERVER_ENV: dict = {}


def generate_request(prompts: list[list[int]], params, model: str, eos_ids, seed: int) -> dict:
    payload = {"input_ids": [ids for ids in prompts for _ in range(params.n)],
               "sampling_params": {"max_new_tokens": params.max_new_tokens,
                                   "temperature": params.temperature, "top_p": params.top_p,
                                   "top_k": params.top_k if params.top_k > 0 else -1,
                                   "stop_token_ids": list(eos_ids) if params.stop_on_eos else [],
                                   "ignore_eos": True, "sampling_seed": seed},
               "return_logprob": True, "logprob_start_len": -1}
    if model:
        payload["lora_path"] = model
    return payload


def parse_generation(answer, n_prompts: int, n: int) -> list[tuple[list[int], list[float]]]:
    if isinstance(answer, dict) and n_prompts * n == 1:
        answer = [answer]
    answer = answer_items(answer, n_prompts * n, "a list of {} results")
    out = []
    for item in answer:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list):
            raise ProtocolError("a result lacks meta_info.output_token_logprobs (was "
                                "return_logprob honoured?)")
        out.append(([int(e[1]) for e in entries], [logprob_value(e[0]) for e in entries]))
    return out


def reload_request(folder: str) -> tuple[str, dict]:
    return "/update_weights_from_disk", {"model_path": folder}


# Weights without a file, GPU only (rollout/weight_transfer.py): `nccl` joins the trainer as rank
# 0 of a torch.distributed NCCL group the server's workers open on POST /init_weights_update_group,
# then per push POST /update_weights_from_distributed with the tensors' names, dtypes and shapes
# while the trainer broadcasts them in that order; `ipc` posts the tensors as SGLang's own
# serialized CUDA IPC handles to /update_weights_from_tensor (same GPU). Answers: {"success",
# "message"}.
GROUP_INIT_PATH = "/init_weights_update_group"
DISTRIBUTED_UPDATE_PATH = "/update_weights_from_distributed"
TENSOR_UPDATE_PATH = "/update_weights_from_tensor"
GROUP_NAME = "ctopd_weight_push"


def group_init_request(master_address: str, master_port: int, world_size: int) -> dict:
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": 1,
            "world_size": int(world_size), "group_name": GROUP_NAME, "backend": "nccl"}


def distributed_update_request(names, dtypes, shapes) -> dict:
    return {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": GROUP_NAME, "flush_cache": True}


def tensor_update_request(serialized: list[str]) -> dict:
    return {"serialized_named_tensors": serialized, "flush_cache": True}


def check_update_answer(answer) -> None:
    """SGLang answers a failed update with 200 and success false: a ProtocolError then."""
    if not isinstance(answer, dict) or answer.get("success") is not True:
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise ProtocolError(f"the server refused the weight update: {message}")
