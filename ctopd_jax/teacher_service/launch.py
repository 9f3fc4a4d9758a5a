"""`teacher.launch` / `rollout.launch: true`: the run serves its own model with vLLM, then
stops the server. One launcher for both (the teacher's folder, or the student's exported one):

    check_launch_python(settings, "teacher")            # cheap, with preflight's package checks
    with launched_server(settings, folder, "teacher", max_model_len=..., max_logprobs=k,
                         dtype=dtype) as server:
        ServedTeacher(dataclasses.replace(settings, url=server.url, launch=False)).start(V)

The server is `vllm serve` of model.teacher's folder (local_server.local_vllm_server) on a free
port of 127.0.0.1, run by `teacher.launch_python` (the trainer's own Python when empty: on CPU
vLLM lives in .venv-vllm, whose numpy pins keep it out of the trainer's venv). preflight starts
it last, after every cheap check, and the run's `with preflight(...)` stops it: at the end, on
an error, on Ctrl-C; a trainer killed outright takes it along (local_server's parent-death
signal).

Decisions: the server's context is the teacher's `max_position_embeddings` (the longest input
the local teacher could score), `--max-logprobs` is `teacher.top_k` (what the start-up check
asks for), `--dtype` is `model.dtype`, its served name `teacher.model` (else "teacher"); its log
goes to a temporary file named on stderr while it runs, not to output_dir (a run that fails to
start writes nothing there); when the server stops the log moves to
`<output_dir>/teacher_server.log` if the run made that folder, else it is removed. The flags are the CPU ones of local_server (eager, 1 GiB of KV cache): a GPU
teacher is better served by a server started with its own flags and `teacher.url`.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

from ctopd_jax.teacher_service.local_server import local_vllm_server
from ctopd_jax.config.served import TeacherSettingError

HAS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
VLLM_VENV_FIX = ("make .venv-vllm/.installed and set teacher.launch_python=.venv-vllm/bin/python, "
                 "or start a server yourself and set teacher.url")


def launch_python(settings) -> str:
    """The interpreter that runs the server: <prefix>.launch_python (a path, or a name on PATH),
    else this one."""
    python = settings.launch_python or sys.executable
    return shutil.which(python) or python


def check_launch_python(settings, prefix: str = "teacher") -> None:
    """One line (TeacherSettingError) unless <prefix>.launch_python runs and has vLLM."""
    python = launch_python(settings)
    fix = VLLM_VENV_FIX.replace("teacher.", f"{prefix}.")
    field = f"{prefix}.launch_python" if settings.launch_python else f"{prefix}.launch"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise TeacherSettingError(f"{prefix}.launch_python: {python!r} is not an executable; "
                                  f"{fix}")
    try:
        code = subprocess.run([python, "-c", HAS_VLLM], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TeacherSettingError(f"{prefix}.launch_python: {python} does not run ({err}); "
                                  f"{fix}") from None
    if code == 3:
        raise TeacherSettingError(f"{field}: vLLM is not installed in {python}; {fix}")
    if code != 0:
        raise TeacherSettingError(f"{prefix}.launch_python: {python} is not a working Python "
                                  f"(exit {code}); {fix}")


@contextlib.contextmanager
def launched_server(settings, folder, prefix: str, *, max_model_len: int, max_logprobs: int,
                    dtype: str, served_name: str = "", keep_log_as=None, extra_args=(),
                    extra_env=None):
    """A vLLM server of the HF `folder`, up; yields local_server.LocalServer. Its log is moved
    to `keep_log_as` when the server stops if that folder exists (the run's output_dir), else
    removed."""
    python = launch_python(settings)
    print(f"{prefix}.launch: starting vLLM ({python}) for {folder}", file=sys.stderr, flush=True)
    started, server = time.perf_counter(), None
    try:
        with local_vllm_server(folder, served_name=served_name or settings.model or prefix,
                               max_model_len=max_model_len, max_logprobs=max_logprobs,
                               dtype=dtype, python=python, keep_log_as=keep_log_as,
                               extra_args=extra_args, extra_env=extra_env) as server:
            print(f"{prefix}.launch: serving at {server.url} (pid {server.pid}, up in "
                  f"{time.perf_counter() - started:.0f} s, log {server.log_path})",
                  file=sys.stderr, flush=True)
            yield server
    finally:
        if server is not None:
            print(f"{prefix}.launch: stopped the server at {server.url}", file=sys.stderr,
                  flush=True)
