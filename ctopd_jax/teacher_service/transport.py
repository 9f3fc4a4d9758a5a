"""JSON over HTTP with the standard library, and the retry rule of a served engine.

Transient failures are retried with exponential backoff: a time-out, a refused or dropped
connection, HTTP 5xx, 429 (a server shedding load says so with 429 or 503), and a 200 whose body
is not JSON (an answer broken on the way: cut short by a worker that died mid-write, or a proxy's
error page while the engine behind it restarts; every request here is idempotent, so asking again
is safe). Everything else (4xx: a request the server will never accept) fails at once with the
server's own message, since repeating it cannot help. JSON of the wrong shape (fewer log-probs
than tokens) is the protocol modules' ProtocolError, not retried either: the server understood the
request and would answer it the same way again. `sleep` is injectable so tests can check the
backoff without waiting.

A server that dies while a request waits (vLLM stopped by SIGTERM closes its listening socket but
keeps the accepted connection open without ever answering) would otherwise hold the caller for
the whole `timeout_s`. So while no answer has come, the transport asks the server's health route
(`health_path`, a fresh connection) every HEALTH_EVERY_S: a refused connection or a 5xx there
ends the wait at once as a dropped connection. A health probe that is merely slow counts as
alive (a busy server is not a dead one); only `timeout_s` ends that wait, and the error then
says it was a time-out (`ServerError.timed_out`).
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import select
import socket
import time
import urllib.parse
from typing import Callable

BACKOFF_CAP_S = 30.0
HEALTH_EVERY_S = 1.0
HEALTH_TIMEOUT_S = 5.0


class ServerError(RuntimeError):
    """A request that failed for good. `status` is the HTTP status (None: no answer at all; below
    400: an answer that is not JSON); `transient` says whether it was retried until the retries
    ran out; `timed_out` that the last try ended on `timeout_s` rather than on an answer or a
    dropped connection."""

    def __init__(self, message: str, status: int | None, transient: bool,
                 timed_out: bool = False):
        super().__init__(message)
        self.status = status
        self.transient = transient
        self.timed_out = timed_out


@dataclasses.dataclass
class Transport:
    base_url: str
    timeout_s: float
    retries: int
    backoff_s: float
    sleep: Callable[[float], None] = time.sleep
    health_path: str | None = None   # GET route that says the server lives (both engines: /health)

    def get(self, path: str) -> dict:
        return self._with_retries("GET", path, None)

    def post(self, path: str, payload: dict, answer_is_json: bool = True):
        """The JSON answer; with answer_is_json=False its text (vLLM's adapter routes answer
        a plain sentence)."""
        return self._with_retries("POST", path, json.dumps(payload).encode(), answer_is_json)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): backoff_s * 2**attempt."""
        return min(self.backoff_s * (2.0 ** attempt), BACKOFF_CAP_S)

    def _with_retries(self, method: str, path: str, body: bytes | None, as_json: bool = True):
        attempt = 0
        while True:
            try:
                return self._once(method, path, body, as_json)
            except ServerError as err:
                if not err.transient or attempt >= self.retries:
                    raise
                self.sleep(self.backoff(attempt))
                attempt += 1

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        parsed = urllib.parse.urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        return kind(parsed.hostname, parsed.port, timeout=timeout)

    def _once(self, method: str, path: str, body: bytes | None, as_json: bool = True):
        deadline = time.monotonic() + self.timeout_s
        timed_out = ServerError(f"{method} {path}: time-out: no answer within {self.timeout_s:g} s",
                                None, True, timed_out=True)
        connection = self._connection(self.timeout_s)
        try:
            connection.request(method, path, body=body,
                               headers={"Content-Type": "application/json"})
            self._wait_for_answer(connection.sock, deadline, method, path, timed_out)
            connection.sock.settimeout(max(deadline - time.monotonic(), 0.05))
            response = connection.getresponse()
            raw = response.read()
        except (TimeoutError, socket.timeout):
            raise timed_out from None
        except http.client.RemoteDisconnected:
            raise ServerError(f"{method} {path}: the server closed the connection without an "
                              f"answer", None, True) from None
        except (http.client.HTTPException, OSError) as err:  # refused, reset mid-answer
            raise ServerError(f"{method} {path}: {_reason_text(err)}", None, True) from None
        finally:
            connection.close()
        if response.status >= 400:
            transient = response.status >= 500 or response.status == 429
            raise ServerError(f"{method} {path}: HTTP {response.status}: {_error_text(raw)}",
                              response.status, transient)
        if not as_json:
            return raw.decode(errors="replace")
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{method} {path}: the answer is not JSON "
                              f"({raw[:80]!r})", response.status, True) from None

    def _wait_for_answer(self, sock, deadline: float, method: str, path: str, timed_out):
        """Until the answer's first bytes arrive: the deadline, or the health probe failing."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise timed_out
            ready, _, _ = select.select([sock], [], [], min(HEALTH_EVERY_S, left))
            if ready:
                return
            dead = self.health_path and self._dead()
            if dead:
                raise ServerError(f"{method} {path}: the server stopped answering mid-request "
                                  f"(GET {self.health_path}: {dead})", None, True)

    def _dead(self) -> str:
        """Why the server is dead ("" when it is alive or merely slow to say so)."""
        connection = self._connection(min(HEALTH_TIMEOUT_S, self.timeout_s))
        try:
            connection.request("GET", self.health_path)
            status = connection.getresponse().status
        except (TimeoutError, socket.timeout):
            return ""
        except (http.client.HTTPException, OSError) as err:
            return _reason_text(err)
        finally:
            connection.close()
        return f"HTTP {status}" if status >= 500 else ""


def _reason_text(reason) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (no server listens there)"
    return str(reason) or type(reason).__name__


def _error_text(raw: bytes) -> str:
    """The server's error message in one line: vLLM {"error": {"message"}}, SGLang
    {"error": {"message"}} or {"detail"}, else the first 200 bytes."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:200].decode(errors="replace").replace("\n", " ").strip() or "(empty)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"]).replace("\n", " ")
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key]).replace("\n", " ")
    return str(data)[:200]
