"""`rollout.weight_sync: nccl | ipc` without a GPU: the push path chosen, the settings refused in
one line, and the requests of each push in order with the tensors broadcast beside them (the data
plane stubbed; the answers as vLLM 0.32's router and SGLang's documented io structs give them).
The paths themselves have not run: no GPU here (docs/served_rollouts.md)."""
from __future__ import annotations

import base64
import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from ctopd_jax.config import RolloutSection
from ctopd_jax.rollout import weight_transfer
from ctopd_jax.rollout.weight_transfer import Transfer, check, choose
from ctopd_jax.teacher_service import sglang_protocol, vllm_protocol
from ctopd_jax.teacher_service.scores import ProtocolError

# what vLLM 0.32's four routes answer (vllm/entrypoints/rl/online/api_router.py)
VLLM_ANSWERS = {vllm_protocol.TRANSFER_INIT_PATH: {"message": "Weight transfer initialized"},
                vllm_protocol.TRANSFER_START_PATH: {"message": "Weight update started"},
                vllm_protocol.TRANSFER_UPDATE_PATH: {"message": "Weights updated"},
                vllm_protocol.TRANSFER_FINISH_PATH: {"message": "Weight update finished"}}
TENSORS = [("model.embed_tokens.weight", np.arange(12, dtype=np.float32).reshape(4, 3)),
           ("lm_head.weight", np.ones((4, 3), ml_dtypes.bfloat16))]


class Stubbed(Transfer):
    """The NCCL group stubbed: what would be broadcast is recorded, in order."""

    def _unique_id(self):
        return bytes(range(128))

    def _join_group(self):
        self.sent = []
        return "group"

    def _broadcast(self, array):
        self.sent.append(array)


def recorder(answers):
    calls = []

    def post(route, payload):
        calls.append((route, json.loads(json.dumps(payload))))   # what goes on the wire
        return answers(route) if callable(answers) else answers.get(route)
    return post, calls


def test_auto_is_the_adapter_for_a_lora_student_and_the_disk_otherwise():
    assert choose("auto", lora=True) == "adapter" and choose("auto", lora=False) == "disk"
    assert choose("nccl", lora=True) == "nccl" and choose("disk", lora=True) == "disk"


GPU = RolloutSection(engine="vllm_server", url="http://a:1", weight_sync="nccl")


@pytest.mark.parametrize("rollout,backend,found,line", [
    (GPU, "cpu", True, "rollout.weight_sync: nccl moves the weights between GPUs, but the trainer "
                       "runs on cpu"),
    (GPU, "gpu", False, "rollout.weight_sync: nccl with vllm_server needs cupy in the trainer's "
                        "Python (pip install cupy-cuda12x)"),
    (dataclasses.replace(GPU, weight_sync="ipc"), "gpu", False, "needs torch"),
    (dataclasses.replace(GPU, weight_sync="ipc", url=("http://a:1", "http://b:2")), "gpu", True,
     "rollout.weight_sync: ipc shares the trainer's GPU memory with one server"),
    (dataclasses.replace(GPU, engine="sglang_server"), "gpu", True,
     "rollout.transfer_address: sglang_server's nccl push meets the server"),
])
def test_a_gpu_path_that_cannot_work_is_one_line(monkeypatch, rollout, backend, found, line):
    monkeypatch.setattr(weight_transfer.importlib.util, "find_spec",
                        lambda name: object() if found else None)
    with pytest.raises(ValueError) as err:
        check(rollout, backend)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_path_that_can_work_passes(monkeypatch):
    monkeypatch.setattr(weight_transfer.importlib.util, "find_spec", lambda name: object())
    check(GPU, "gpu")
    check(dataclasses.replace(GPU, engine="sglang_server", transfer_address="10.0.0.5:29600"), "gpu")
    check(dataclasses.replace(GPU, weight_sync="disk"), "cpu")


def test_a_vllm_nccl_push_initialises_once_then_start_update_finish_with_the_tensors_beside():
    post, calls = recorder(VLLM_ANSWERS)
    transfer = Stubbed("vllm_server", "nccl", vllm_protocol, world_size=3)
    transfer.open(post)
    assert calls == [("/init_weight_transfer_engine", {"init_info": {
        "nccl_unique_id_b64": base64.b64encode(bytes(range(128))).decode(), "rank_offset": 1,
        "world_size": 3, "packed": False}})]
    assert base64.b64decode(calls[0][1]["init_info"]["nccl_unique_id_b64"]) == bytes(range(128))
    for version in (1, 2):
        calls.clear()
        transfer.sent = []
        size = transfer.push(TENSORS, post)
        assert [route for route, _ in calls] == ["/start_weight_update", "/update_weights",
                                                 "/finish_weight_update"]
        assert calls[1][1] == {"update_info": {
            "names": ["model.embed_tokens.weight", "lm_head.weight"],
            "dtype_names": ["float32", "bfloat16"], "shapes": [[4, 3], [4, 3]]}}
        assert calls[2][1] == {"weight_version": str(version)}
        assert [a.dtype.name for a in transfer.sent] == ["float32", "bfloat16"]   # in names order
        assert size == 12 * 4 + 12 * 2
    assert vllm_protocol.transfer_server_args("nccl") == ["--weight-transfer-config",
                                                          '{"backend": "nccl"}']


def test_an_sglang_nccl_push_and_a_refused_update():
    post, calls = recorder({sglang_protocol.GROUP_INIT_PATH: {"success": True, "message": ""},
                            sglang_protocol.DISTRIBUTED_UPDATE_PATH: {"success": True,
                                                                      "message": "Succeeded"}})
    transfer = Stubbed("sglang_server", "nccl", sglang_protocol, world_size=2,
                       transfer_address="10.0.0.5:29600")
    transfer.open(post)
    assert calls == [("/init_weights_update_group", {
        "master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1, "world_size": 2,
        "group_name": "ctopd_weight_push", "backend": "nccl"})]
    calls.clear()
    transfer.push(TENSORS, post)
    assert calls == [("/update_weights_from_distributed", {
        "names": ["model.embed_tokens.weight", "lm_head.weight"],
        "dtypes": ["float32", "bfloat16"], "shapes": [[4, 3], [4, 3]],
        "group_name": "ctopd_weight_push", "flush_cache": True})]
    assert len(transfer.sent) == 2
    refused, _ = recorder({sglang_protocol.DISTRIBUTED_UPDATE_PATH: {
        "success": False, "message": "Failed to update parameter online: shape mismatch"}})
    with pytest.raises(ProtocolError, match="refused the weight update: Failed to update"):
        transfer.push(TENSORS, refused)
    assert sglang_protocol.tensor_update_request(["abc"]) == {"serialized_named_tensors": ["abc"],
                                                              "flush_cache": True}
