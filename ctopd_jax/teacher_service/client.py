"""The served teacher: score token-id sequences on a vLLM or SGLang server.

    teacher = ServedTeacher(settings)            # settings validated here
    teacher.start(vocab_size=800)                # the start-up check (startup.py), once
    scored = teacher.score(sequences, starts)    # list[ScoredSequence], one per sequence
    future = teacher.submit(sequences, starts)   # the same in the background; .result()

`sequences[i]` is the teacher's full input ids (prompt + response + EOS, as the local teacher's
prefill sees them) and `starts[i]` the position of the first response token; see scores.py for
what each row holds. `top_k` defaults to `teacher.top_k`; `top_k=0` asks for the realised tokens'
log-probs only (what the sampled objectives need: opd, sod, tcod, mp_opd), a much smaller
answer (vLLM then returns one entry per position instead of k + 1).

The batch is packed into requests of at most `max_tokens_per_request` tokens (whole sequences:
a sequence never straddles two requests, as its scores depend on its whole prefix), sent
`max_concurrency` at a time from a thread pool, and reassembled in input order. A request
that still fails after its retries stops the batch with one line naming `teacher.url`
(TeacherServiceError).
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Sequence

from ctopd_jax.config.served import TeacherServiceSettings
from ctopd_jax.teacher_service import sglang_protocol, vllm_protocol
from ctopd_jax.teacher_service.scores import ProtocolError, ScoredSequence, ServerInfo
from ctopd_jax.teacher_service.startup import check_server
from ctopd_jax.teacher_service.transport import ServerError, Transport

PROTOCOLS = {"vllm_server": vllm_protocol, "sglang_server": sglang_protocol}


class TeacherServiceError(RuntimeError):
    """A served teacher failed during a run: one line naming teacher.url and what to do."""


class ServedTeacher:
    def __init__(self, settings: TeacherServiceSettings, *, prefix: str = "teacher",
                 sleep=time.sleep):
        settings.validate(prefix)
        if not settings.served:
            raise ValueError(f"{prefix}.engine is local: the local teacher needs no client")
        self.settings = settings
        self.prefix = prefix
        self.protocol = PROTOCOLS[settings.engine]
        self.transport = Transport(settings.base_url, settings.timeout_s, settings.retries,
                                   settings.backoff_s, sleep=sleep,
                                   health_path=self.protocol.ENDPOINTS.health)
        self.info: ServerInfo | None = None
        self._background: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, sequences, starts, top_k: int | None = None) -> concurrent.futures.Future:
        """`score` in a background thread, so the caller can overlap the server's work with
        its own (the student's forward, the next batch's alignment); `.result()` returns or
        raises what `score` would. Batches run one after another, in submission order."""
        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(1, "served-teacher")
        return self._background.submit(self.score, sequences, starts, top_k)

    def close(self):
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None

    def start(self, vocab_size: int) -> ServerInfo:
        """The start-up check (server up, right engine, right model and vocabulary)."""
        self.info = check_server(self, vocab_size)
        return self.info

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top_k: int | None = None) -> list[ScoredSequence]:
        top_k = self.settings.top_k if top_k is None else top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= \
                self.settings.top_k:
            raise ValueError(f"top_k={top_k!r} must be in [0, {self.prefix}.top_k="
                             f"{self.settings.top_k}] (the start-up check vouches for that many)")
        batch = self._checked_batch(sequences, starts)
        groups = plan_requests([len(ids) for ids, _ in batch],
                               self.settings.max_tokens_per_request)
        results: list[ScoredSequence | None] = [None] * len(batch)
        workers = min(self.settings.max_concurrency, max(len(groups), 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(self._request, [batch[i] for i in group], top_k): group
                       for group in groups}
            try:
                for future in concurrent.futures.as_completed(futures):
                    for i, scored in zip(futures[future], future.result()):
                        results[i] = scored
            except BaseException:
                for future in futures:  # a failed batch stops: send nothing more
                    future.cancel()
                raise
        return results

    def _request(self, batch, top_k: int):
        payload = self.protocol.score_request(batch, top_k, self.info.model if self.info else
                                              self.settings.model)
        try:
            answer = self.transport.post(self.protocol.ENDPOINTS.score, payload)
            return self.protocol.parse_scores(answer, batch, top_k)
        except ServerError as err:
            raise TeacherServiceError(self._failure_line(err)) from None
        except ProtocolError as err:
            raise TeacherServiceError(mismatch_line(f"{self.prefix}.url {self.settings.url}",
                                                    self.prefix, self.settings.engine,
                                                    err)) from None

    def _failure_line(self, err: ServerError) -> str:
        where = f"{self.prefix}.url {self.settings.url}"
        return failure_line(where, self.prefix, self.settings.retries, err, "scoring")

    def _checked_batch(self, sequences, starts) -> list[tuple[list[int], int]]:
        if len(sequences) != len(starts):
            raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
        limit = self.info.max_model_len if self.info else None
        batch = []
        for i, (ids, start) in enumerate(zip(sequences, starts)):
            ids = [int(token) for token in ids]
            start = int(start)
            if not 1 <= start <= len(ids):
                raise ValueError(f"sequence {i}: start {start} must be in [1, {len(ids)}] (position"
                                 f" 0 has no prefix to be scored from)")
            if limit is not None and len(ids) + 1 > limit:
                raise ValueError(
                    f"{self.prefix}.url {self.settings.url}: sequence {i} has {len(ids)} tokens "
                    f"but the server takes at most {limit} (its max_model_len, one generated token "
                    f"included); restart it with a larger --max-model-len or shorten "
                    f"rollout.generate_max_len / the prompts")
            batch.append((ids, start))
        return batch


def failure_line(where: str, prefix: str, retries: int, err: ServerError, what: str) -> str:
    """One line for a request that failed for good: a time-out says so and names timeout_s; a
    dropped or refused connection says the server is down; answers that are not JSON say they
    are broken. (The trainer adds the step and the last checkpoint; at start-up there is no run
    to resume yet.)"""
    if not err.transient:
        return f"{where}: the server refused a {what} request: {err}"
    if err.status is not None and err.status < 400:   # it answered, but not in JSON
        return (f"{where}: {err} (after {retries} retries); its answers are broken: check the "
                f"server's log (or the proxy in front of it) and restart it")
    if err.timed_out:
        return (f"{where}: {err} (after {retries} retries): a time-out, the server is alive but "
                f"too slow for {prefix}.timeout_s; raise {prefix}.timeout_s, or lower the load "
                f"({prefix}.max_concurrency) or check the server's log")
    return (f"{where}: {err} (after {retries} retries); the server is down or overloaded: check "
            f"its log and restart it, or raise {prefix}.retries")


def mismatch_line(where: str, prefix: str, engine: str, err: ProtocolError) -> str:
    """One line for JSON of the wrong shape (fewer log-probs than tokens, a field missing). It
    is not retried: the server understood the request, and the same request gets the same
    answer."""
    return (f"{where}: the {engine} answer does not match the request ({err}); not retried, as "
            f"the server would answer the same again: check its log and {prefix}.engine")


def plan_requests(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack sequence indices, in order, into requests of at most `max_tokens` tokens.

    Greedy and order-keeping: a new request starts when the next sequence would overflow the
    current one. A sequence longer than `max_tokens` goes alone (it cannot be split)."""
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups
