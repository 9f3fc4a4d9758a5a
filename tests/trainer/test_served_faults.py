"""A served teacher that misbehaves mid-run, under a real training run (`python -m
ctopd_jax.train` on configs/tiny_cpu_same.yaml, 3 steps, a checkpoint after each), against the
vLLM stand-in that answers from the local char teacher (LocalModelVllmServer), told to fault at
step 2's scoring request.

Which faults are transient (retried within teacher.retries, each try within teacher.timeout_s)
and which are not:
- retried, and the run then ends as the undisturbed run of this module (every metric but the
  timings, and the checksums of every checkpoint, equal):
  - a restart: the server stops listening while step 2's request is held unanswered (vLLM on
    SIGTERM), refuses connections for 1.5 s, then listens again on the same port; the client's
    health probe sees it gone, and the retries reach it once it is back;
  - a slow answer (2.5 s, past the 1 s health probe, within timeout_s): waited for, not retried;
  - an answer that is not JSON (a truncated body, then a proxy's HTML page, both with 200);
- not retried: JSON of the wrong shape (fewer log-probs than tokens): the server understood the
  request, and the same request gets the same answer.
A fault that outlasts the retries (answers that are never JSON) and one that is not retried stop
the run: exit 2, one error line on stderr naming teacher.url, the step that failed and the last
checkpoint (the step a resume continues from); the checkpoint before the fault stays the
undisturbed run's, and `--resume` against the healthy server ends as the undisturbed run with one
metrics row per step.

Served rollouts fail the same way (tests/rollout/test_served_rollout_faults.py, at the client
level); here one run on served rollouts (tests/rollout/_rollout_stand_in.py) whose server answers
fewer log-probs than tokens at step 2 checks that the trainer names the step to resume from.

Budget: nine runs of 4-10 s and the faults' waits, 74 s on 2 cores (measured; the first run
compiling into a fresh XLA cache).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from ctopd_jax.common.metrics import run_values
from test_served_teacher_training import (CHAR_TEACHER, SAME, LocalModelScores,
                                          LocalModelVllmServer)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from _rollout_stand_in import RolloutStandIn  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
FAULT_STEP = 2
STARTUP_PROBES = 2   # the start-up check's top-k probe and vocabulary probe, before step 1
RETRIES = 4          # backoff 0.2, 0.4, 0.8, 1.6 s: 3 s in all, twice the restart's 1.5 s


def run_overrides(out: Path) -> list[str]:
    return [f"output_dir={out}", f"steps={STEPS}", "rollout.rollout_batch_size=8",
            "rollout.generate_max_len=16", "optimizer.train_batch_size=8",
            "optimizer.micro_batch_size=4", "logging.progress=false",
            "logging.tensorboard=false", "checkpoint.every=1", "checkpoint.keep=5",
            "checkpoint.async_save=false", "checkpoint.export_hf=false", "evaluation.dataset=''"]


def served_teacher(url: str) -> list[str]:
    return ["teacher.engine=vllm_server", f"teacher.url={url}", "teacher.model=char-teacher",
            "teacher.timeout_s=10", f"teacher.retries={RETRIES}", "teacher.backoff_s=0.2"]


def served_rollouts(url: str) -> list[str]:
    return ["rollout.engine=vllm_server", f"rollout.url={url}", "rollout.timeout_s=10",
            f"rollout.retries={RETRIES}", "rollout.backoff_s=0.2"]


def train(out: Path, server: list[str], compile_cache: str, resume: bool = False):
    """`python -m ctopd_jax.train` of the tiny run with `server`'s overrides."""
    command = [sys.executable, "-m", "ctopd_jax.train", "--config", str(SAME)]
    for override in run_overrides(out) + server:
        command += ["--set", override]
    return subprocess.run(command + (["--resume"] if resume else []), capture_output=True,
                          text=True, cwd=out.parent, timeout=300,
                          env=subprocess_env(compile_cache, devices=1))


def learning_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the timings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [run_values(row) for row in rows]


def checkpoint_checksums(run_dir: Path) -> dict[int, dict]:
    """Per checkpoint step, the checksums of its parameters, optimizer state and RNG."""
    folder = run_dir / "checkpoints"
    return {int(step.name): json.loads((step / "meta" / "metadata").read_text())["checksums"]
            for step in folder.iterdir() if step.name.isdigit()}


def at_step(step: int, *faults: str) -> list[str]:
    """The script that answers the start-up probes and the steps before `step`, then faults."""
    return ["ok"] * (STARTUP_PROBES + step - 1) + list(faults)


@pytest.fixture(scope="module")
def server():
    stand_in = LocalModelVllmServer("vllm", LocalModelScores(CHAR_TEACHER, 20),
                                    model="char-teacher", max_model_len=256, max_logprobs=20)
    yield stand_in
    stand_in.close()


@pytest.fixture
def teacher(server):
    """The module's stand-in, with no fault left over from another test."""
    server.script[:] = []
    yield server
    server.script[:] = []


@pytest.fixture(scope="module")
def undisturbed(server, compile_cache, tmp_path_factory):
    """The run every fault is compared with: (run folder, scoring requests it made)."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    server.script[:] = []
    before = len(server.scoring_requests)
    proc = train(out, served_teacher(server.url), compile_cache)
    assert proc.returncode == 0, proc.stderr
    rows = learning_rows(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert sorted(checkpoint_checksums(out)) == list(range(1, STEPS + 1))
    return out, len(server.scoring_requests) - before


def fault_requests(server, before: int) -> list[tuple[str, dict]]:
    """(action, payload) of each scoring request since `before` that got a fault."""
    return [(action, body) for action, body in zip(server.actions[before:],
                                                   server.scoring_requests[before:])
            if action != "ok"]


def assert_ends_as_undisturbed(run_dir: Path, undisturbed_dir: Path):
    assert learning_rows(run_dir) == learning_rows(undisturbed_dir)
    assert checkpoint_checksums(run_dir) == checkpoint_checksums(undisturbed_dir)


def error_line(stderr: str) -> str:
    """The one error line: the last, after the start-up progress and the run's own log."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines and all(line.startswith(("[start-up ", "run ")) for line in lines[:-1]), lines
    return lines[-1]


# The transient faults, and the extra requests each costs: the retries that reach the server.
TRANSIENT = [
    pytest.param(["restart:1.5"], 1, id="restart"),
    pytest.param(["slow:2.5"], 0, id="slow"),
    pytest.param(["truncated", "html"], 2, id="not-json-twice"),
]


@pytest.mark.parametrize("faults,extra", TRANSIENT)
def test_a_transient_fault_is_waited_out_and_the_run_ends_as_undisturbed(
        tmp_path, teacher, undisturbed, compile_cache, faults, extra):
    reference, requests = undisturbed
    teacher.script[:] = at_step(FAULT_STEP, *faults)
    before, probes = len(teacher.scoring_requests), teacher.health_checks
    proc = train(tmp_path / "run", served_teacher(teacher.url), compile_cache)
    assert proc.returncode == 0, proc.stderr
    assert teacher.script == []                               # every fault was served
    hit = fault_requests(teacher, before)
    assert [action for action, _ in hit] == faults
    assert all(body["prompt_logprobs"] == 0 for _, body in hit)   # a step's, not a probe's
    assert len(teacher.scoring_requests) - before == requests + extra
    if faults[0].startswith("restart"):   # the retry came once the server listened again
        retried = before + STARTUP_PROBES + FAULT_STEP
        assert teacher.scoring_requests[retried] == teacher.scoring_requests[retried - 1]
        assert teacher.arrived[retried] >= teacher.back_at
    if faults[0].startswith("slow"):      # the client asked whether it lived, and waited
        assert teacher.health_checks - probes >= 2
    assert_ends_as_undisturbed(tmp_path / "run", reference)


# The faults that stop the run: the words of their line, and the tries they get.
STOPPING = [
    pytest.param(["html"] * (RETRIES + 1), RETRIES + 1,
                 ["POST /v1/completions: the answer is not JSON (b'<html>",
                  f"(after {RETRIES} retries); its answers are broken"], id="never-json"),
    pytest.param(["short"], 1, ["the vllm_server answer does not match the request "
                                "(prompt_logprobs has", "; not retried"], id="fewer-log-probs"),
]


@pytest.mark.parametrize("faults,tries,words", STOPPING)
def test_a_fault_that_stops_the_run_is_one_line_and_the_resumed_run_ends_as_undisturbed(
        tmp_path, teacher, undisturbed, compile_cache, faults, tries, words):
    reference, _ = undisturbed
    run = tmp_path / "run"
    teacher.script[:] = at_step(FAULT_STEP, *faults)
    before = len(teacher.scoring_requests)
    proc = train(run, served_teacher(teacher.url), compile_cache)
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert line.startswith(f"python -m ctopd_jax.train: error: step {FAULT_STEP}: teacher.url "
                           f"{teacher.url}: "), line
    for word in words:
        assert word in line, line
    assert line.endswith(f"(last checkpoint: step {FAULT_STEP - 1} in {run / 'checkpoints'}; "
                         "continue with --resume once the server answers)")
    assert len(teacher.scoring_requests) - before == STARTUP_PROBES + FAULT_STEP - 1 + tries
    # what was written before the fault is the undisturbed run's, and nothing of step 2
    assert learning_rows(run) == learning_rows(reference)[: FAULT_STEP - 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(FAULT_STEP - 1)]
    assert checkpoint_checksums(run)[FAULT_STEP - 1] == \
        checkpoint_checksums(reference)[FAULT_STEP - 1]

    teacher.script[:] = []   # the server is healthy again
    resumed = train(run, served_teacher(teacher.url), compile_cache, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {FAULT_STEP - 1}" in resumed.stderr
    assert_ends_as_undisturbed(run, reference)


def test_a_rollout_server_fault_is_one_line_naming_rollout_url_and_the_step(tmp_path,
                                                                           compile_cache):
    stand_in = RolloutStandIn(vocab=104)   # the char student's vocabulary
    run = tmp_path / "run"
    # the push's log-prob check at start-up, step 1's 8 prompts and its push's check; then
    # step 2's first prompt gets one log-prob too few (its other prompts are in flight)
    stand_in.script[:] = ["ok"] * 10 + ["short"]
    try:
        proc = train(run, served_rollouts(stand_in.url), compile_cache)
    finally:
        stand_in.close()
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert line.startswith(f"python -m ctopd_jax.train: error: step {FAULT_STEP}: rollout.url "
                           f"{stand_in.url}: the vllm_server answer does not match the request "
                           "(choice 0 has 16 token_ids but 15 logprobs.token_logprobs); not "
                           "retried"), line
    assert line.endswith(f"(last checkpoint: step {FAULT_STEP - 1} in {run / 'checkpoints'}; "
                         "continue with --resume once the server answers)")
    assert "short" in stand_in.actions and stand_in.script == []
    assert [row["step"] for row in learning_rows(run)] == [FAULT_STEP - 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(FAULT_STEP - 1)]
