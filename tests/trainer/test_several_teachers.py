"""Several named teachers in one run (`teachers:`, issue 25 item 3).

Each prompt picks its teacher by its `teacher` field (else data.default_teacher); each teacher
has its own tokenizer, overlap map and alignment, and its own metrics (`<name>/...`). Checked
against independent facts, not against the code under test:
- two entries that are the same model, with greedy rollouts, train exactly as the single-teacher
  run on the same prompts (one update sums every sample ÷ all tokens, whatever the routing);
- a teacher that IS the student (same weights, same tokenizer) gives reverse KL 0 and coverage
  1.0 on its own samples before the first update, while the cross-tokenizer teacher beside it
  does not: each sample meets the teacher its row names;
- every bad `teachers:` setting and a row naming an unknown teacher are one line, before any
  model loads (exit 2 from the command line, nothing written)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import subprocess_env
from ctopd_jax.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CROSS = ROOT / "configs" / "tiny_cpu.yaml"
SMALL = {"steps": 2, "rollout": {"rollout_batch_size": 8, "generate_max_len": 16},
         "optimizer": {"train_batch_size": 8, "micro_batch_size": 4},
         "logging": {"progress": False, "tensorboard": False},
         "checkpoint": {"save": False, "export_hf": False}, "evaluation": {"dataset": ""}}


def prompts_file(tmp_path: Path, teachers: list[str | None]) -> Path:
    """The demo's training prompts, row i naming teachers[i % len] (None: no field)."""
    from ctopd_jax.data.prompts import resolve_named_source

    rows = [json.loads(line) for line in resolve_named_source("demo:train").read_text().splitlines()[:64]]
    for i, row in enumerate(rows):
        if teachers[i % len(teachers)] is not None:
            row["teacher"] = teachers[i % len(teachers)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config_file(tmp_path: Path, name: str, data: Path, teachers=None, **sections) -> Path:
    tree = yaml.safe_load(CROSS.read_text())
    for key, value in {**SMALL, **sections}.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    tree["output_dir"] = str(tmp_path / name)
    tree["data"]["path"], tree["data"]["shuffle"] = str(data), False
    if teachers is not None:
        tree["teachers"] = teachers
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(path: Path, *overrides: str):
    from ctopd_jax.preflight import preflight
    from ctopd_jax.loop.trainer import Trainer

    config = load_config(path, list(overrides))
    trainer = Trainer(config, preflight=preflight(config))
    trainer.train()
    return trainer


@pytest.mark.slow
def test_two_names_for_one_teacher_train_as_the_single_teacher_run(tmp_path):
    # None: the default teacher (a). Each teacher has half the rows and takes 4 of each batch
    # of 8 (data/prompts.py): unshuffled, batch k holds the file's rows 8k..8k+7, as in the
    # single-teacher run (a's four first, then b's).
    data = prompts_file(tmp_path, ["a", "b", None, "b"])
    greedy = {"rollout": {**SMALL["rollout"], "temperature": 0.0}}
    one = train(config_file(tmp_path, "one", data, **greedy))
    two = train(config_file(tmp_path, "two", data, [{"name": "a", "checkpoint": "demo:teacher"},
                                                    {"name": "b", "checkpoint": "demo:teacher"}], **greedy))
    want, got = rows_of(tmp_path / "one"), rows_of(tmp_path / "two")
    for key in ("loss", "strict_loss", "grad_norm", "student_response_tokens", "strict_pairs"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=2e-4, err_msg=key)
    for row in got:   # 8 prompts per batch, 4 for each teacher
        assert row["a/samples"] == row["b/samples"] == 4
        parts = sum(row[f"{t}/loss"] * row[f"{t}/student_response_tokens"] for t in "ab")
        np.testing.assert_allclose(parts, row["loss"] * row["student_response_tokens"], rtol=1e-5)
    import jax
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)


@pytest.mark.slow
def test_each_sample_meets_the_teacher_its_row_names(tmp_path):
    # the file in two blocks, 32 rows each: the stream still gives each teacher half of each batch
    data = prompts_file(tmp_path, ["cross"] * 32 + ["self"] * 32)
    run = config_file(tmp_path, "mixed", data,
                      [{"name": "cross", "checkpoint": "demo:teacher"},
                       {"name": "self", "checkpoint": "demo:student"}],   # the student's own weights
                      algorithm={"name": "strict", "kd_loss_fn": "rkl"})
    trainer = train(run, "steps=1")
    first = rows_of(tmp_path / "mixed")[0]
    assert first["self/samples"] == first["cross/samples"] == 4
    assert first["self/coverage_student"] == 1.0 and first["self/coverage_teacher"] == 1.0
    assert abs(first["self/strict_loss"]) < 1e-5     # KL(student || itself) before any update
    assert first["cross/strict_loss"] > 1e-2
    # one overlap map per pair: the student's vocabulary (901) with itself, the demo teacher's (800)
    assert trainer.teachers["self"].overlap.summary()["V_T"] == trainer.s_tok.vocab_size == 901
    assert trainer.teachers["cross"].overlap.summary()["V_T"] == 800


@pytest.mark.parametrize("teachers,extra,message", [
    ([{"name": "a", "checkpoint": "demo:teacher"}, {"name": "a", "checkpoint": "demo:teacher"}], (),
     "teachers[1].name: 'a' is used twice; give each teacher its own name"),
    ([{"name": "a", "checkpoint": "demo:teacher"}], ("data.default_teacher=z",),
     "data.default_teacher: 'z' is not one of the teachers (a)"),
    ([{"name": "a", "checkpoint": ""}], (), "teachers[a].checkpoint: is empty"),
    ([{"name": "a", "checkpoint": "demo:teacher", "engine": "vllm_server"}], (),
     "teachers[a].url: is empty; teachers[a].engine: vllm_server needs the server's address"),
    ([{"name": "a", "checkpoint": "demo:teacher"}], ("teacher.engine=vllm_server", "teacher.url=http://h:1"),
     "teacher: is set beside teachers:"),
    ([{"name": "a", "checkpoint": "demo:teacher"}, {"name": "b", "checkpoint": "demo:teacher"}],
     ("optimizer.train_batch_size=4",), "optimizer.train_batch_size: 4, but with teachers: one update"),
    ([{"name": "a", "checkpoint": "demo:teacher"}, {"name": "b", "checkpoint": "nowhere:teacher"}], (),
     "teachers[b] (as model.teacher / teacher:): "),
])
def test_bad_teachers_settings_are_one_line(tmp_path, teachers, extra, message):
    from ctopd_jax.config import ConfigError
    from ctopd_jax.preflight import PreflightError, preflight

    path = config_file(tmp_path, "bad", prompts_file(tmp_path, ["a"]), teachers)
    with pytest.raises((ConfigError, PreflightError)) as info:
        preflight(load_config(path, list(extra)))
    line = str(info.value)
    assert "\n" not in line and message in line, line
    assert not (tmp_path / "bad").exists()


def test_a_batch_smaller_than_the_teachers_named_is_one_line(tmp_path):
    from ctopd_jax.preflight import PreflightError, preflight

    path = config_file(tmp_path, "bad", prompts_file(tmp_path, ["a", "b"]),
                       [{"name": "a", "checkpoint": "demo:teacher"}, {"name": "b", "checkpoint": "demo:teacher"}])
    with pytest.raises(PreflightError) as info:
        preflight(load_config(path, ["rollout.rollout_batch_size=1", "optimizer.train_batch_size=1",
                                     "optimizer.micro_batch_size=1"]))
    assert str(info.value) == ("rollout.rollout_batch_size: 1 is smaller than the 2 teachers the "
                               "prompts name; raise it to at least 2")


def test_several_teachers_refuse_an_objective_built_for_one(tmp_path):
    from ctopd_jax.preflight import PreflightError, check_objective

    path = config_file(tmp_path, "opd2", prompts_file(tmp_path, ["a"]),
                       [{"name": "a", "checkpoint": "demo:teacher"}, {"name": "b", "checkpoint": "demo:teacher"}])
    with pytest.raises(PreflightError, match=r"^teachers: algorithm\.name=opd2 needs the teacher's base model"):
        check_objective(load_config(path, ["algorithm.name=opd2"]))


def test_a_row_naming_an_unknown_teacher_is_one_line_exit_2(tmp_path, compile_cache):
    data = prompts_file(tmp_path, ["a", "b", "physics"])
    path = config_file(tmp_path, "run", data, [{"name": "a", "checkpoint": "demo:teacher"},
                                               {"name": "b", "checkpoint": "demo:teacher"}])
    proc = subprocess.run([sys.executable, "-m", "ctopd_jax.train", "--config", str(path)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=subprocess_env(compile_cache, devices=1), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].endswith(f"{data}:3: teacher 'physics' is not one of the teachers (a, b); add it "
                             "under teachers: or fix the row"), lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_served_teacher_beside_a_local_one_trains_as_two_local_ones(tmp_path):
    """`teachers:` mixes engines: the same demo teacher, once on the mesh and once behind a vLLM
    stand-in answering from it, gives the all-local run's losses (same routing, same seeds)."""
    from test_served_teacher_training import DEMO_TEACHER, _local_model_server

    servers = _local_model_server(DEMO_TEACHER, "demo-teacher")
    server = next(servers)
    try:
        data = prompts_file(tmp_path, ["near", "far"])
        near = {"name": "near", "checkpoint": "demo:teacher"}
        local = train(config_file(tmp_path, "local", data, [near, {"name": "far", "checkpoint": str(DEMO_TEACHER)}]),
                      "algorithm.name=mp_opd")
        served = train(config_file(tmp_path, "served", data, [near, {
            "name": "far", "checkpoint": str(DEMO_TEACHER), "engine": "vllm_server", "url": server.url}]),
            "algorithm.name=mp_opd")
    finally:
        servers.close()
    assert served.teachers["far"].model is None and served.teachers["near"].model is not None
    want, got = rows_of(tmp_path / "local"), rows_of(tmp_path / "served")
    for key in ("loss", "mp_opd_loss", "grad_norm", "far/mp_opd_loss", "near/mp_opd_loss"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-4,
                                   atol=1e-6, err_msg=key)
    assert min(abs(r["far/mp_opd_loss"]) for r in want) > 1e-5


@pytest.mark.slow
def test_a_resumed_run_of_several_teachers_equals_an_uninterrupted_one(tmp_path):
    """Each teacher's cumulative coverage is part of the checkpoint: step 2 of a run resumed
    from step 1 equals step 2 of an uninterrupted run, per-teacher metrics included."""
    from ctopd_jax.loop.trainer import Trainer

    data = prompts_file(tmp_path, ["a", "b"])
    teachers = [{"name": "a", "checkpoint": "demo:teacher"}, {"name": "b", "checkpoint": "demo:student"}]
    saving = {"checkpoint": {"save": True, "every": 1, "async_save": False, "export_hf": False}}
    train(config_file(tmp_path, "whole", data, teachers, **saving))
    first = load_config(config_file(tmp_path, "cut", data, teachers, **saving), ["steps=1"])
    Trainer(first).train()
    Trainer(load_config(tmp_path / "cut.yaml")).train(resume=True)
    want, got = rows_of(tmp_path / "whole")[-1], rows_of(tmp_path / "cut")[-1]
    assert got["step"] == want["step"] == 2
    for key in ("loss", "grad_norm", "a/coverage_student_cum", "b/coverage_teacher_cum", "a/loss", "b/loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
