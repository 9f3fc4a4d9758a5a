"""Settings of a teacher behind an inference server (`teacher.engine: vllm_server | sglang_server`).

They live with the configuration (the `teacher:` section extends them) and the client
(teacher_service/) imports them, so the settings import nothing of the rollout side.

A frozen dataclass with one `validate()` that raises `TeacherSettingError` (a ValueError) whose
message is one line: the field's full name (`teacher.url`), what is wrong, and the fix. The
config integration (the `teacher:` section, and `teachers:` entries named `teachers[math]`) passes
its own `prefix`, so the same checks name the field the user wrote.

`local` is today's path (the teacher on the trainer's mesh); the served engines need a URL,
except with `launch: true` (vLLM only): the run then starts `vllm serve` of model.teacher on a free
port of 127.0.0.1 itself and stops it when it ends (teacher_service/launch.py), so `url` stays
empty. `launch_python` is the Python that has vLLM (on CPU the .venv-vllm of `make test-vllm`,
whose numpy pins keep vLLM out of the trainer's venv); "" is the trainer's own.
"""
from __future__ import annotations

import dataclasses
import math
import urllib.parse

ENGINES = ("local", "vllm_server", "sglang_server")
SERVED_ENGINES = ("vllm_server", "sglang_server")

# Bounds that catch typos (a timeout in ms, a concurrency of 10_000) rather than taste.
MAX_CONCURRENCY = 256
MAX_RETRIES = 20
MAX_TOP_K = 1024


class TeacherSettingError(ValueError):
    """A bad teacher setting: one line naming the field and the fix."""


@dataclasses.dataclass(frozen=True)
class TeacherServiceSettings:
    engine: str = "local"           # local | vllm_server | sglang_server
    url: str = ""                   # http://host:port of the server (no path)
    model: str = ""                 # the served model name to expect; "" = the one it serves
    timeout_s: float = 120.0        # one HTTP request, connect + answer
    max_concurrency: int = 8        # requests in flight at once
    retries: int = 3                # extra tries after a time-out, a refused connection, 5xx, non-JSON
    backoff_s: float = 0.5          # first retry waits this long, then 2x, 4x, ... (capped 30 s)
    top_k: int = 16                 # teacher top-k entries per response position
    max_tokens_per_request: int = 16384  # sequences are packed into requests up to this many tokens
    launch: bool = False            # the run starts (and stops) its own vLLM server of model.teacher
    launch_python: str = ""         # the Python with vLLM that runs it; "" = the trainer's own

    @property
    def served(self) -> bool:
        return self.engine in SERVED_ENGINES

    def validate(self, prefix: str = "teacher") -> "TeacherServiceSettings":
        """Raise TeacherSettingError for the first bad field; return self when all are fine."""
        def bad(field: str, message: str):
            raise TeacherSettingError(f"{prefix}.{field}: {message}")

        if self.engine not in ENGINES:
            bad("engine", f"{self.engine!r} is not an engine; use one of {', '.join(ENGINES)}")
        # every number in range whatever the engine: a wrong value is wrong before it is used
        _check_number(bad, "timeout_s", self.timeout_s, 0.0, 3600.0, "seconds", open_low=True)
        _check_int(bad, "max_concurrency", self.max_concurrency, 1, MAX_CONCURRENCY)
        _check_int(bad, "retries", self.retries, 0, MAX_RETRIES)
        _check_number(bad, "backoff_s", self.backoff_s, 0.0, 60.0, "seconds")
        _check_int(bad, "top_k", self.top_k, 1, MAX_TOP_K)
        _check_int(bad, "max_tokens_per_request", self.max_tokens_per_request, 2, 10_000_000)
        if not isinstance(self.launch, bool):
            bad("launch", f"{self.launch!r} must be true or false")
        if not isinstance(self.launch_python, str):
            bad("launch_python", f"{self.launch_python!r} must be the path of a Python executable")
        if self.launch_python and not self.launch:
            bad("launch_python", f"is set but {prefix}.launch is false; set {prefix}.launch: true "
                                 f"or remove {prefix}.launch_python")
        if self.launch and self.engine != "vllm_server":
            bad("launch", f"starts a vLLM server, but {prefix}.engine is {self.engine}; set "
                          f"{prefix}.engine: vllm_server, or start the server yourself and set "
                          f"{prefix}.launch: false")
        if not self.served:
            if self.url:
                bad("url", f"is set ({self.url!r}) but {prefix}.engine is local; set "
                           f"{prefix}.engine: vllm_server or sglang_server, or remove {prefix}.url")
            return self
        if self.launch:
            if self.url:
                bad("url", f"is set ({self.url!r}) but {prefix}.launch starts a server of its own "
                           f"on a free port; remove {prefix}.url or set {prefix}.launch: false")
            return self
        if not self.url:
            bad("url", f"is empty; {prefix}.engine: {self.engine} needs the server's address, "
                       f"e.g. http://127.0.0.1:8000 (or {prefix}.launch: true to start one)")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            bad("url", f"{self.url!r} is not an http(s)://host:port address; write it as "
                       f"http://127.0.0.1:8000")
        try:
            parsed.port
        except ValueError:
            bad("url", f"{self.url!r} has a bad port; write it as http://127.0.0.1:8000")
        if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
            bad("url", f"{self.url!r} has a path; give the server root (http://host:port), the "
                       f"client adds /v1/completions or /generate itself")
        return self

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


def _check_int(bad, field, value, low, high):
    if isinstance(value, bool) or not isinstance(value, int):
        bad(field, f"{value!r} must be a whole number in [{low}, {high}]")
    if not low <= value <= high:
        bad(field, f"{value} is outside [{low}, {high}]; set a value in that range")


def _check_number(bad, field, value, low, high, unit, open_low=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        bad(field, f"{value!r} must be a finite number of {unit}")
    if (value <= low if open_low else value < low) or value > high:
        side = "(" if open_low else "["
        bad(field, f"{value} is outside {side}{low:g}, {high:g}] {unit}; set a value in that range")


# ----------------------------------------------------------------------------- rollout servers
# The student on a server of its own (rollout.engine vllm_server | sglang_server) shares the
# served teacher's fields and checks: one place for both.


def server_urls(rollout) -> tuple[str, ...]:
    return (rollout.url,) if isinstance(rollout.url, str) else tuple(rollout.url)


def check_settings(rollout) -> None:
    """One TeacherSettingError line for the first bad rollout-server field (config.validate,
    and the rollout engine on a server: rollout/served.py)."""
    served = rollout.engine in SERVED_ENGINES
    fields = ("url", "launch", "launch_python")
    # numbers in range whatever the engine: a wrong value is wrong before it is used
    dataclasses.replace(settings_for(rollout, ""), engine="local", launch=False,
                        launch_python="").validate("rollout")
    if not 1 <= rollout.logprob_check_rows <= 64:
        raise TeacherSettingError(f"rollout.logprob_check_rows: {rollout.logprob_check_rows} is "
                                  "outside [1, 64]; set a value in that range")
    if not 1 <= rollout.server_gpus <= 64:
        raise TeacherSettingError(f"rollout.server_gpus: {rollout.server_gpus} is outside [1, 64]")
    if rollout.async_staleness not in (0, 1):
        raise TeacherSettingError(f"rollout.async_staleness: {rollout.async_staleness} is not 0 or 1 "
                                  "(updates between the generating and the trained weights); set 0 or 1")
    if not rollout.async_tis_cap >= 1.0:
        raise TeacherSettingError(f"rollout.async_tis_cap: {rollout.async_tis_cap} must be >= 1 (it "
                                  "truncates importance weights from above); set e.g. 2.0")
    if rollout.async_rollouts and not served:
        raise TeacherSettingError(f"rollout.async_rollouts: needs a rollout server, but rollout.engine "
                                  f"is {rollout.engine} (it shares the trainer's device); set "
                                  "rollout.engine: vllm_server or sglang_server, or "
                                  "rollout.async_rollouts: false")
    if not served:
        for name in fields:
            if getattr(rollout, name):
                raise TeacherSettingError(
                    f"rollout.{name}: is set but rollout.engine is {rollout.engine}; set "
                    f"rollout.engine: vllm_server or sglang_server, or remove rollout.{name}")
        return
    urls = server_urls(rollout)
    if rollout.launch and len(urls) > 1:
        raise TeacherSettingError("rollout.launch: starts one server, but rollout.url lists "
                                  f"{len(urls)}; remove rollout.url or set rollout.launch: false")
    if not urls:
        raise TeacherSettingError("rollout.url: is an empty list; give one server or several")
    for url in urls:
        settings_for(rollout, url).validate("rollout")


def settings_for(rollout, url: str) -> TeacherServiceSettings:
    """The served teacher's settings for one rollout server: the same fields, the same checks."""
    return TeacherServiceSettings(engine=rollout.engine, url=url, timeout_s=rollout.timeout_s,
                                  max_concurrency=rollout.max_concurrency,
                                  retries=rollout.retries, backoff_s=rollout.backoff_s,
                                  launch=rollout.launch, launch_python=rollout.launch_python)
