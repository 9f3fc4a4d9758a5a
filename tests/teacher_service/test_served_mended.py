"""The served teacher as a new user meets it: stopping, dropped connections, time-outs, start-up
lines, logs, `--set teachers[NAME]`, the README's local equivalent, the demo's summary.

The launcher's lifecycle runs against a stand-in `vllm` package (a module that answers
GET /v1/models and keeps a child process in its group, as vLLM's engine process is), so it costs
no vLLM start; the real server's tests are in test_served_vllm.py (`make test-vllm`).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from _fake_teacher_server import FakeTeacherServer, ToyTeacher
from ctopd_jax.config import ConfigError, load_config
from ctopd_jax.teacher_service import (ServedTeacher, TeacherServerCheckError,
                                       TeacherServiceError, TeacherServiceSettings)
from ctopd_jax.teacher_service.local_server import LocalServerError, local_vllm_server

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 60

STAND_IN = '''
import argparse, http.server, json, subprocess, sys
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
args, _ = parser.parse_known_args()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("engine pid", engine.pid, flush=True)
open(sys.argv[0] + f".{args.port}.engine", "w").write(str(engine.pid))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        raw = json.dumps({"data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
'''


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    """A `vllm` package whose api_server answers /v1/models and keeps an 'engine' child."""
    module = tmp_path / "pkgs" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module, module.parent, module.parent.parent):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'pkgs'}{os.pathsep}"
                                     f"{os.environ.get('PYTHONPATH', '')}")
    return module / "api_server.py"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")


def engine_pid(script: Path, url: str) -> int:
    path = Path(f"{script}.{url.rsplit(':', 1)[1]}.engine")
    for _ in range(100):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in wrote no engine pid")


def test_the_whole_group_stops_when_the_main_process_was_killed_from_outside(stand_in_vllm,
                                                                             tmp_path):
    with local_vllm_server(tmp_path, start_timeout_s=60) as server:
        engine = engine_pid(stand_in_vllm, server.url)
        os.kill(server.pid, signal.SIGKILL)      # killed from outside: the engine stays behind
        time.sleep(0.3)
        assert alive(engine)
    deadline = time.monotonic() + 10
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(engine)


def test_the_temporary_log_goes_with_the_server_or_under_the_run(stand_in_vllm, tmp_path):
    with local_vllm_server(tmp_path, start_timeout_s=60) as server:
        log = server.log_path
        assert log.exists() and log.parent == Path(tempfile.gettempdir())
    assert not log.exists()
    run = tmp_path / "run"
    run.mkdir()
    with local_vllm_server(tmp_path, start_timeout_s=60,
                           keep_log_as=run / "teacher_server.log") as server:
        log = server.log_path
    assert not log.exists()
    assert "engine pid" in (run / "teacher_server.log").read_text()


def test_a_failed_start_names_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))   # no vllm to import: exits at once
    with pytest.raises(LocalServerError, match=r"exited with 1 before answering: .*\(log: "
                                               r"(\S+)\)$") as info:
        with local_vllm_server(tmp_path, python=sys.executable, start_timeout_s=30):
            pass
    log = Path(re.search(r"\(log: (\S+)\)$", str(info.value)).group(1))
    assert "vllm" in log.read_text()      # kept for the user to read: the message names it
    log.unlink()


# ------------------------------------------------------------------ dropped / timed out

def client(url: str, **fields) -> ServedTeacher:
    return ServedTeacher(TeacherServiceSettings(engine="vllm_server", url=url, **fields),
                         sleep=lambda s: None)


def test_a_server_gone_mid_request_is_detected_at_once_not_after_timeout_s():
    fake = FakeTeacherServer("vllm", ToyTeacher(VOCAB))
    fake.gate = threading.Event()          # the request is accepted, then never answered
    teacher = client(fake.url, timeout_s=60, retries=0)
    threading.Timer(0.5, lambda: (fake.server.shutdown(), fake.server.server_close())).start()
    started = time.monotonic()
    try:
        with pytest.raises(TeacherServiceError) as info:
            teacher.score([[1, 2, 3]], [1])
    finally:
        fake.gate.set()
    assert time.monotonic() - started < 5.0
    line = str(info.value)
    assert "stopped answering mid-request" in line and "GET /health" in line
    assert "time-out" not in line and "\n" not in line


def test_a_time_out_says_it_was_a_time_out():
    fake = FakeTeacherServer("vllm", ToyTeacher(VOCAB))
    try:
        fake.script = ["stall"]
        with pytest.raises(TeacherServiceError) as info:
            client(fake.url, timeout_s=0.3, retries=0).score([[1, 2, 3]], [1])
    finally:
        fake.close()
    line = str(info.value)
    assert "time-out: no answer within 0.3 s" in line and "raise teacher.timeout_s" in line


def test_a_start_up_500_is_not_blamed_on_the_engine_nor_speaks_of_resuming():
    fake = FakeTeacherServer("vllm", ToyTeacher(VOCAB))
    try:
        fake.route = lambda method, path, body: (500, {"error": {"message": "engine crashed"}})
        with pytest.raises(TeacherServerCheckError) as info:
            client(fake.url, retries=0).start(VOCAB)
        line = str(info.value)
        assert "HTTP 500" in line and "check its log" in line
        assert "teacher.engine" not in line and "resume" not in line
        del fake.route
        fake.script = ["503"]                # the probe fails: still no run to resume
        with pytest.raises(TeacherServerCheckError) as info:
            client(fake.url, retries=0).start(VOCAB)
        assert "probe request failed" in str(info.value) and "resume" not in str(info.value)
    finally:
        fake.close()


# ------------------------------------------------------------------ config and docs

def test_set_reaches_a_named_teachers_entry(tmp_path):
    tree = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    tree["teachers"] = [{"name": "math", "checkpoint": "demo:teacher"},
                        {"name": "code", "checkpoint": "demo:teacher"}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    config = load_config(path, ["teachers[code].engine=vllm_server",
                                "teachers[code].url=http://127.0.0.1:8000",
                                "teachers[code].top_k=4"])
    code = {t.name: t for t in config.teachers}["code"]
    assert (code.engine, code.url, code.top_k) == ("vllm_server", "http://127.0.0.1:8000", 4)
    assert {t.name: t for t in config.teachers}["math"].engine == "local"
    with pytest.raises(ConfigError, match=r"^--set teachers\[art\]\.top_k: no teachers: entry "
                                          r"is named 'art'; the file's entries are math, code$"):
        load_config(path, ["teachers[art].top_k=4"])
    with pytest.raises(ConfigError, match=r"teachers\[code\].top_k: 0 is outside"):
        load_config(path, ["teachers[code].top_k=0"])


def test_the_readmes_local_equivalent_of_the_served_config_loads():
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines()
                if "configs/tiny_cpu_served.yaml" in l and "teacher.engine=local" in l)
    words = shlex.split(line)
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    config = load_config(ROOT / "configs" / "tiny_cpu_served.yaml", sets)
    assert config.teacher.engine == "local" and not config.teacher.launch
    assert config.algorithm.name == "mp_opd"


def test_the_documented_cpu_command_sets_the_kv_cache_space():
    text = (ROOT / "docs" / "served_teacher.md").read_text()
    commands = re.findall(r"^(\S*VLLM_CPU_KVCACHE_SPACE=\d+ python -m vllm\S*)", text, re.M)
    assert commands, "docs/served_teacher.md gives no CPU `vllm serve` command with the KV cache"


@pytest.mark.parametrize("algorithm,target", [("topk_strict", True), ("mp_opd", False)])
def test_the_demo_prints_the_50_percent_target_beside_the_strict_demo_only(capsys, algorithm,
                                                                            target):
    from ctopd_jax.demo.__main__ import print_summary

    print_summary({"teacher_accuracy": 0.9, "student_accuracy_before": 0.1,
                    "student_accuracy_after": 0.6, "gap_closed": 0.625, "coverage_student": None,
                    "coverage_teacher": None, "train_seconds": 1, "total_seconds": 2, "steps": 1,
                    "checkpoints": "c", "hf_student": "h", "plots": [], "run_dir": "r",
                    "eval_dirs": {"teacher": "e/teacher"}, "algorithm": algorithm})
    out = capsys.readouterr().out
    assert "62% of the gap closed" in out
    assert ("target >= 50%" in out) is target
