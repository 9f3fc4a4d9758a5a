"""Start (and stop) a vLLM OpenAI server for a local HF checkpoint on 127.0.0.1.

For tests, benchmarks and runs that serve their own teacher (`teacher.launch: true`, launch.py):

    with local_vllm_server("ctopd_jax/assets/demo/teacher", served_name="demo-teacher") as server:
        ...  # server.url: http://127.0.0.1:<free port>; server.pid, server.log_path

The server runs in its own process group (so its engine process goes with it, and a Ctrl-C
in the terminal reaches only the caller, which may still need the server to finish a step) from
`python` (default: this interpreter, which must have vLLM installed: the .venv-vllm of `make
test-vllm`). Start-up on this 2-core CPU takes ~30-60 s; the server is stopped when the block
exits, also on an error or Ctrl-C: the whole process group, even when its main process was
killed from outside (`_stop`). Its log is a temporary file that goes with the server: moved to
`keep_log_as` when that file's folder exists (a run's output_dir), else removed; only a server
that failed to start leaves it in place, named in the error (a caller's own `log_path` is
never touched). A caller that dies without unwinding (SIGKILL, os._exit of a
second Ctrl-C) takes the server with it: the server asks Linux for SIGTERM when its parent dies
(PR_SET_PDEATHSIG, set in the server process before it becomes vLLM). The CPU flags are those
the in-process engine uses (float32, eager, 1 GiB of KV cache).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


# Run as `python -c DIE_WITH_PARENT <parent pid> -m vllm...`: on Linux, ask for SIGTERM when the
# parent dies (kept across exec), give up if it already died, then become the server.
DIE_WITH_PARENT = """import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit("the process that started this vLLM server is gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class LocalServerError(RuntimeError):
    """The local server did not come up: the last lines of its log say why."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def local_vllm_server(model_dir, *, served_name: str = "teacher", max_model_len: int = 256,
                      max_logprobs: int = 64, dtype: str = "float32", python: str | None = None,
                      port: int | None = None, start_timeout_s: float = 600.0,
                      log_path=None, keep_log_as=None, extra_args=(), extra_env=None):
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    command = [python or sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()),
               "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
               "--max-logprobs", str(max_logprobs), "--served-model-name", served_name,
               *extra_args]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra_env or {})
    env.pop("XLA_FLAGS", None)  # the trainer's fake-device flags mean nothing to the server
    owned_log = not log_path
    log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm_server_",
                                                                     suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    started = False
    try:
        _wait_until_up(url, process, log_path, start_timeout_s)
        started = True
        yield LocalServer(url, process.pid, log_path)
    finally:
        _stop(process)
        if owned_log and started:
            _settle_log(log_path, keep_log_as)


@dataclasses.dataclass(frozen=True)
class LocalServer:
    url: str          # http://127.0.0.1:<port>
    pid: int          # the server process (its group: the engine too)
    log_path: Path    # its stdout and stderr


def _wait_until_up(url: str, process, log_path: Path, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LocalServerError(f"the vLLM server exited with {process.returncode} before "
                                   f"answering: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
                if json.loads(answer.read()).get("data"):
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1.0)
    raise LocalServerError(f"the vLLM server did not answer within {timeout_s:g} s: "
                           f"{_tail(log_path)}")


def _stop(process, grace_s: float = 30.0):
    """Stop the server's whole process group, whatever state its main process is in: a main
    process killed from outside (or exited) leaves vLLM's engine and workers running in the
    group, so the group is signalled even then, and SIGKILLed if it outlives `grace_s`."""
    group = process.pid  # start_new_session: the group id is the main process's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)  # the group this module started, nothing else
    deadline = time.monotonic() + grace_s
    while _group_alive(group, process) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(group, process):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def _group_alive(group: int, process) -> bool:
    process.poll()  # reap the main process once it exits, or it counts as alive (a zombie)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _settle_log(log_path: Path, keep_log_as) -> None:
    """A temporary log after its server stopped: moved to `keep_log_as` when that file's folder
    exists (a run's output_dir), else removed."""
    keep = Path(keep_log_as) if keep_log_as else None
    if keep is not None and keep.parent.is_dir():
        shutil.move(str(log_path), str(keep))
    else:
        log_path.unlink(missing_ok=True)


def _tail(log_path: Path, lines: int = 5) -> str:
    try:
        text = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {log_path})"
    return " | ".join(text[-lines:]) + f" (log: {log_path})"
