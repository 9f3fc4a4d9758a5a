"""`rollout.engine: vllm_server` against a real `vllm serve` on CPU: rollouts whose log-probs are
the JAX student's, a full-weight push and an adapter push that take (the server's log-probs follow
the new weights), a push that did not take (one line), and the demo config run from the command
line with its server killed mid-run (one line naming the step and the last checkpoint; --resume
reaches the same final step), and the same config training on served rollouts overlapped with
training (`rollout.async_rollouts`, staleness 1) for three steps. Whether the demo student then
learns as with the JAX sampler (four 40-step demo runs, 15-25 minutes on 2 cores, too long for
CI) is a benchmark: `python benchmarks/served_teacher_learning.py --served rollouts
--async-rollouts --seeds 0 1` (benchmarks/RESULTS.md, "Served rollouts overlapped with training").

The trainer runs here (the main venv), the server from the vLLM venv (`CTOPD_VLLM_PYTHON`, default
.venv-vllm/bin/python). Marked `vllm` and slow (each server start takes ~50 s on 2 cores):
`make test-vllm`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from ctopd_jax.config import load_config
from ctopd_jax.models import lora
from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.rollout import SamplingParams
from ctopd_jax.rollout.logprob_gap import response_logprobs
from ctopd_jax.rollout.served import ServedRolloutEngine, ServedRolloutError
from ctopd_jax.teacher_service import vllm_protocol

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu_served_rollouts.yaml"
VLLM_PYTHON = os.environ.get("CTOPD_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
if not Path(VLLM_PYTHON).is_file():
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make .venv-vllm/.installed, or set "
                "CTOPD_VLLM_PYTHON)", allow_module_level=True)
EOS, PAD = 900, 897
PROMPTS = [[5 + i, 40 + 3 * i, 17, 300 + i, 11] for i in range(6)]
# vLLM's CPU kernels against XLA in float32: ~1e-6 measured on the demo student (the adapter
# path adds the merged-vs-adapted rounding, ~1e-4); a push that did not take is off by ~1.
GAP = 1e-3


def rollout_section(**changes):
    rollout = load_config(CONFIG).rollout
    return dataclasses.replace(rollout, launch_python=VLLM_PYTHON, **changes)


def student():
    return load_hf_checkpoint(ROOT / "ctopd_jax" / "assets" / "demo" / "student")[0]


def perturb(model, seed: int, scale: float = 0.05):
    """Every LoRA adapter, or else the lm_head, moved by random noise: other weights."""
    if lora.has_adapters(model):
        for k, (_, module, name, _) in enumerate(lora._sites(model)):
            for suffix in ("_lora_a", "_lora_b"):
                var = getattr(module, name + suffix)
                key = jax.random.fold_in(jax.random.key(seed), 2 * k + (suffix == "_lora_b"))
                var[...] = 0.3 * jax.random.normal(key, var.shape, var[...].dtype)
        return
    head = model.lm_head
    head[...] = head[...] + scale * jax.random.normal(jax.random.key(seed), head[...].shape)


def max_gap(result, model) -> float:
    want = response_logprobs(model, result.prompt_ids, result.token_ids, pad_id=PAD)
    return max(float(np.max(np.abs(np.asarray(got) - w))) for got, w in zip(result.logprobs, want))


@pytest.fixture(scope="module")
def full():
    model = student()
    engine = ServedRolloutEngine(model, EOS, PAD, rollout_section(), dtype="float32",
                                 max_model_len=100)
    yield engine, model
    engine.close()


def test_rollouts_carry_the_jax_students_log_probs(full):
    engine, model = full
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=1)
    result = engine.generate(PROMPTS, params)
    assert len(result) == 2 * len(PROMPTS) and result.prompt_index[:4] == [0, 0, 1, 1]
    gap = max_gap(result, model)
    print(f"rollout log-probs against the JAX student: max |Δ| {gap:.2e}")
    assert gap < GAP
    again = engine.generate(PROMPTS, params)            # seeded per prompt: the same samples
    assert again.token_ids == result.token_ids


def test_a_full_weight_push_takes_and_one_that_did_not_is_one_line(full, monkeypatch):
    engine, model = full
    before = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=2))
    perturb(model, 3)
    assert max_gap(before, model) > 10 * GAP            # the new weights score differently
    engine.update_weights(model)
    metrics = engine.push_metrics()
    print(f"full push: {metrics}")
    assert metrics["logprob_gap"] < GAP and metrics["rollout_push_bytes"] > 2e6
    assert max_gap(engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=2)),
                   model) < GAP
    stale = str(engine._launch_folder.resolve())        # the server reloads its first weights
    monkeypatch.setattr(vllm_protocol, "reload_request",
                        lambda folder: ("/collective_rpc", {"method": "reload_weights",
                                                            "kwargs": {"weights_path": stale}}))
    perturb(model, 4)
    with pytest.raises(ServedRolloutError) as info:
        engine.update_weights(model)
    line = str(info.value)
    print(line)
    assert "\n" not in line and line.startswith(f"rollout.url {engine.urls[0]}: the weight push "
                                                "did not take")


def test_an_adapter_push_takes():
    model = student()
    lora.attach(model, 8, 16.0, list(lora.TARGETS), seed=0)
    perturb(model, 1)
    engine = ServedRolloutEngine(model, EOS, PAD, rollout_section(), dtype="float32",
                                 max_model_len=100)
    try:
        assert engine.adapter_sync
        first = engine.push_metrics()
        perturb(model, 2)
        engine.update_weights(model)
        print(f"adapter pushes: {first}, {engine.push_metrics()}")
        assert engine.push_metrics()["logprob_gap"] < GAP
        assert engine.push_metrics()["rollout_push_bytes"] < 0.2 * 2.5e6   # the adapter only
        result = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=5))
        assert max_gap(result, model) < GAP
    finally:
        engine.close()


def cli_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)    # one CPU device: the run as a user starts it
    return env


def cli(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ctopd_jax.train", "--config", str(CONFIG),
         "--set", f"output_dir={out}", "--set", f"rollout.launch_python={VLLM_PYTHON}",
         "--set", "steps=4", "--set", "checkpoint.every=1", "--set", "logging.progress=false",
         "--set", "evaluation.dataset=", "--set", "checkpoint.export_hf=false",
         "--set", "rollout.retries=0", *extra],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def test_the_config_runs_from_the_cli_and_a_server_killed_mid_run_is_one_line_then_resume(
        tmp_path):
    out = tmp_path / "run"
    run = cli(out)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and run.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    log = (out / "rollout_server.log")
    pid = int(re.search(r"rollout\.launch: serving at \S+ \(pid (\d+)",
                        _stderr_so_far(run)).group(1))
    os.kill(pid, signal.SIGKILL)                       # vLLM's API server gone mid-run
    _, err = run.communicate(timeout=300)
    errors = [l for l in err.splitlines() if "error:" in l]
    assert len(errors) == 1, err[-3000:]                 # then the server's stop line
    line = errors[0]
    print(line)
    assert run.returncode == 2
    assert re.search(r"error: step \d+: rollout\.url http://127\.0\.0\.1:\d+: .*\(last "
                     r"checkpoint: step \d+ in .*continue with --resume", line), line
    assert log.exists()                                 # moved under the run when it stopped
    resumed = cli(out, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps[-1] == 4


_seen: dict[int, str] = {}


def _stderr_so_far(process) -> str:
    """What the run printed on stderr up to the server's start line (read line by line)."""
    text = _seen.get(process.pid, "")
    while "serving at" not in text:
        line = process.stderr.readline()
        if not line:
            break
        text += line
    _seen[process.pid] = text
    return text


def test_the_config_trains_on_served_async_rollouts_one_update_behind(tmp_path):
    """`rollout.async_rollouts` (staleness 1) from the command line: the first batch fresh, each
    later one generated by the server while the step before trained (rollout_staleness 1), every
    weight push checked (after it the server's log-probs are the JAX student's: logprob_gap, the
    push's check, < GAP), the run finishing with exit 0. The order of generations against pushes
    is tested on a fake server in tests/rollout/test_async_rollouts.py."""
    out = tmp_path / "run"
    run = cli(out, "--set", "rollout.async_rollouts=true", "--set", "steps=3")
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    print([(r["step"], r["rollout_staleness"], r["logprob_gap"], r["loss"]) for r in rows])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["logprob_gap"] < GAP for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)
