"""JSON over HTTP with the standard library, and the retry rule of a served teacher.

Transient failures are retried with exponential backoff: a time-out, a refused or reset
connection, HTTP 5xx, and 429 (a server shedding load says so with 429 or 503). Everything else
(4xx: a request the server will never accept) fails at once with the server's own message, since
repeating it cannot help. `sleep` is injectable so tests can check the backoff without waiting.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Callable

BACKOFF_CAP_S = 30.0


class ServerError(RuntimeError):
    """A request that failed for good. `status` is the HTTP status (None: no answer at all);
    `transient` says whether it was retried until the retries ran out."""

    def __init__(self, message: str, status: int | None, transient: bool):
        super().__init__(message)
        self.status = status
        self.transient = transient


@dataclasses.dataclass
class Transport:
    base_url: str
    timeout_s: float
    retries: int
    backoff_s: float
    sleep: Callable[[float], None] = time.sleep

    def get(self, path: str) -> dict:
        return self._with_retries("GET", path, None)

    def post(self, path: str, payload: dict) -> dict:
        return self._with_retries("POST", path, json.dumps(payload).encode())

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): backoff_s * 2**attempt."""
        return min(self.backoff_s * (2.0 ** attempt), BACKOFF_CAP_S)

    def _with_retries(self, method: str, path: str, body: bytes | None):
        attempt = 0
        while True:
            try:
                return self._once(method, path, body)
            except ServerError as err:
                if not err.transient or attempt >= self.retries:
                    raise
                self.sleep(self.backoff(attempt))
                attempt += 1

    def _once(self, method: str, path: str, body: bytes | None):
        url = self.base_url + path
        request = urllib.request.Request(url, data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            status = err.code
            detail = _error_text(err.read())
            transient = status >= 500 or status == 429
            raise ServerError(f"{method} {path}: HTTP {status}: {detail}", status, transient)
        except (TimeoutError, socket.timeout):
            raise ServerError(f"{method} {path}: no answer within {self.timeout_s:g} s", None, True)
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise ServerError(f"{method} {path}: no answer within {self.timeout_s:g} s",
                                  None, True)
            raise ServerError(f"{method} {path}: {_reason_text(reason)}", None, True)
        except (ConnectionError, OSError) as err:  # reset mid-answer, broken pipe
            raise ServerError(f"{method} {path}: {_reason_text(err)}", None, True)
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{method} {path}: the answer is not JSON "
                              f"({raw[:80]!r})", 200, False)


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
