"""`teacher.launch: true`: the run serves its own teacher with vLLM, then stops the server.

    check_launch_python(settings)                       # cheap, with preflight's package checks
    with launched_teacher(settings, folder, teacher_cfg, dtype) as server:
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
from ctopd_jax.teacher_service.settings import TeacherSettingError

HAS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
VLLM_VENV_FIX = ("make .venv-vllm/.installed and set teacher.launch_python=.venv-vllm/bin/python, "
                 "or start a server yourself and set teacher.url")


def launch_python(settings) -> str:
    """The interpreter that runs the server: teacher.launch_python (a path, or a name on PATH),
    else this one."""
    python = settings.launch_python or sys.executable
    return shutil.which(python) or python


def check_launch_python(settings) -> None:
    """One line (TeacherSettingError) unless teacher.launch_python runs and has vLLM."""
    python = launch_python(settings)
    field = "teacher.launch_python" if settings.launch_python else "teacher.launch"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise TeacherSettingError(f"teacher.launch_python: {python!r} is not an executable; "
                                  f"{VLLM_VENV_FIX}")
    try:
        code = subprocess.run([python, "-c", HAS_VLLM], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TeacherSettingError(f"teacher.launch_python: {python} does not run ({err}); "
                                  f"{VLLM_VENV_FIX}") from None
    if code == 3:
        raise TeacherSettingError(f"{field}: vLLM is not installed in {python}; {VLLM_VENV_FIX}")
    if code != 0:
        raise TeacherSettingError(f"teacher.launch_python: {python} is not a working Python "
                                  f"(exit {code}); {VLLM_VENV_FIX}")


@contextlib.contextmanager
def launched_teacher(settings, folder, teacher_cfg, dtype: str, keep_log_as=None):
    """A vLLM server of the teacher's HF `folder`, up; yields local_server.LocalServer. Its log
    is moved to `keep_log_as` when the server stops if that folder exists (the run's
    output_dir), else removed."""
    python = launch_python(settings)
    print(f"teacher.launch: starting vLLM ({python}) for {folder}", file=sys.stderr, flush=True)
    started, server = time.perf_counter(), None
    try:
        with local_vllm_server(folder, served_name=settings.model or "teacher",
                               max_model_len=teacher_cfg.max_position_embeddings,
                               max_logprobs=settings.top_k, dtype=dtype, python=python,
                               keep_log_as=keep_log_as) as server:
            print(f"teacher.launch: serving at {server.url} (pid {server.pid}, up in "
                  f"{time.perf_counter() - started:.0f} s, log {server.log_path})",
                  file=sys.stderr, flush=True)
            yield server
    finally:
        if server is not None:
            print(f"teacher.launch: stopped the server at {server.url}", file=sys.stderr, flush=True)
