"""scripts/gpu_check.py --dry-run: every stage at tiny shapes on the CPU, one JSON per stage
that matches the documented schema, failures recorded without stopping later stages."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


def _check_schema(record: dict, schema: dict, statuses) -> None:
    assert set(record) == set(schema), sorted(set(record) ^ set(schema))
    for key, kind in schema.items():
        assert isinstance(record[key], kind), (key, record[key])
    assert record["status"] in statuses


@pytest.mark.slow
def test_dry_run_writes_one_valid_result_per_stage(tmp_path):
    gc = _module()
    proc = _run(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["stages"]) == set(gc.STAGES)
    records = {}
    for stage in gc.STAGES:
        record = json.loads((tmp_path / f"{stage}.json").read_text())
        _check_schema(record, gc.STAGE_SCHEMA, gc.STATUSES)
        assert record["stage"] == stage and record["dry_run"] is True
        assert record["status"] == summary["stages"][stage]
        records[stage] = record
    failed = {s: r["error"] for s, r in records.items() if r["status"] != "ok"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-2000:])
    assert summary["ok"] is True
    # the numbers each stage exists for are there, and are numbers
    env = records["env"]["results"]
    assert env["copy"]["gbps"] > 0 and env["matmul"]["tflops"] > 0
    e2e = records["e2e"]["results"]
    rows = e2e["train"]["iterations"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["time_rollout"] > 0 and row["time_student"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["coverage_student"] <= 1
    assert rows[0]["time_compile"] > 0                       # the first iteration compiles
    assert [p["phase"] for p in e2e["train"]["startup"]][-1] == "ready"
    assert e2e["planner"]["total_bytes"] > 0
    strict = records["strict_kernels"]["results"]
    for key in ("full/xla", "full/pallas", "top16/xla", "top16/pallas"):
        assert strict[key]["run_s"] > 0 and strict[key]["compile_s"] >= 0, (key, strict[key])
    # interpret-mode Pallas on CPU computes the same float32 function as the XLA path
    assert strict["full/pallas"]["grad_rel_error"] < 1e-4
    assert strict["top16/pallas"]["grad_rel_error"] < 1e-4
    assert {k: r["backend"] for k, r in strict["table"].items()} == {
        "strict_full": "cpu", "strict_topk": "cpu"}
    compare = records["e2e_pallas"]["results"]["compare"]   # pallas e2e against xla's
    assert compare["same_rollouts_iteration_1"] and compare["loss_rel_error_iteration_1"] < 1e-4
    assert all(t > 0 for t in compare["steady_student_s"].values())
    attention = records["attention"]["results"]
    assert attention["cudnn"]["status"] == "not available"  # no GPU in a dry run
    assert attention["blockwise"]["out_rel_error"] < 2e-2    # bf16 against float32
    memory = records["compile_memory"]["results"]
    for part in ("teacher_scoring", "student_step", "sampler"):
        assert memory[part]["temp"] > 0, part
    assert records["train_step"]["results"]["step"]["tokens_per_s"] > 0
    for count in (4, 8):
        sampled = records["sampler"]["results"][f"generate_{count}"]
        assert sampled["generated_tokens"] == count * 16 and sampled["step_gbps"] > 0
    assert records["pallas_tests"]["results"]["pytest"]["returncode"] == 0


@pytest.mark.slow
def test_a_stage_killed_at_its_limit_records_the_part_it_was_in(tmp_path):
    gc = _module()
    # e2e's training part never ends; a 30 s stage limit kills it (and what it started)
    proc = _run(tmp_path, "--only", "e2e", env_extra={gc.HANG_ENV: "e2e/train",
                                                      "CTOPD_GPU_CHECK_DRY_TIMEOUT_S": "30"})
    assert proc.returncode == 1
    record = json.loads((tmp_path / "e2e.json").read_text())
    _check_schema(record, gc.STAGE_SCHEMA, gc.STATUSES)
    assert record["status"] == "timeout" and record["part"] == "train"
    assert "killed after its 30 s limit in part 'train'" in record["error"]
    assert record["results"]["planner"]["total_bytes"] > 0        # what was done stays
    assert "[e2e" in record["log_tail"] and "train ..." in record["log_tail"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.slow
def test_a_failing_stage_is_recorded_and_later_stages_still_run(tmp_path):
    gc = _module()
    proc = _run(tmp_path, "--only", "env,attention", env_extra={gc.FAIL_ENV: "env"})
    assert proc.returncode == 1
    env = json.loads((tmp_path / "env.json").read_text())
    _check_schema(env, gc.STAGE_SCHEMA, gc.STATUSES)
    assert env["status"] == "failed" and gc.FAIL_ENV in env["error"] and env["part"] is None
    assert "RuntimeError" in env["log_tail"]
    attention = json.loads((tmp_path / "attention.json").read_text())
    assert attention["status"] == "ok"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {**summary, "stages": {"env": "failed", "attention": "ok"}, "ok": False}


def test_unknown_stage_is_a_usage_error(tmp_path):
    proc = _run(tmp_path, "--only", "env,warp_drive")
    assert proc.returncode == 2
    assert "warp_drive" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_on_request_stage_runs_only_when_named_and_says_when_its_models_are_absent(tmp_path):
    gc = _module()
    assert "same_tokenizer" not in gc.STAGES and gc.ON_REQUEST["same_tokenizer"] <= gc.TOTAL_BUDGET_S
    blocked = tmp_path / "not_a_folder"     # the model cache cannot be created: fetch refuses
    blocked.write_text("")
    proc = _run(tmp_path / "out", "--only", "same_tokenizer", env_extra={"CTOPD_JAX_CACHE": str(blocked)})
    assert proc.returncode == 1
    record = json.loads((tmp_path / "out" / "same_tokenizer.json").read_text())
    _check_schema(record, gc.STAGE_SCHEMA, gc.STATUSES)
    assert record["status"] == "failed" and "could not be fetched" in record["error"]
    assert record["results"]["fetch qwen2.5-coder-1.5b"]["status"] == "failed"
    assert "compare" not in record["results"]


def test_stage_limits_fit_the_eight_minute_budget():
    gc = _module()
    assert sum(gc.STAGES.values()) <= gc.TOTAL_BUDGET_S <= 8 * 60
