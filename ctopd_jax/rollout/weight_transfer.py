"""Full-weight pushes without a file, for rollout servers on GPUs (`rollout.weight_sync: nccl |
ipc`). Built after vLLM's and SGLang's documented routes (the request bodies live in
teacher_service/vllm_protocol.py and sglang_protocol.py); NOT RUN: no GPU was available where
they were written, so `auto` never picks them (docs/served_rollouts.md).

| path | engine | data plane (trainer side) | the trainer needs |
|---|---|---|---|
| nccl | vLLM | one NCCL broadcast per tensor from rank 0; the id minted here, sent as `nccl_unique_id_b64` (vLLM's torch-free trainer path) | cupy (its NCCL binding) |
| nccl | SGLang | torch.distributed NCCL group over a TCP rendezvous at `rollout.transfer_address`, one broadcast per tensor | torch |
| ipc | vLLM | CUDA IPC handles of the tensors (torch's reduce_tensor over DLPack views), pickled | torch |
| ipc | SGLang | SGLang's own serialized IPC handles | sglang |

Each tensor is gathered from the mesh to the host (models.weights.hf_named_tensors, in the
export dtype) and staged on the trainer's first GPU: the bytes cross the interconnect once and
no disk is touched; the host hop (device -> host -> device) is the price of one code path for
sharded students. Per push, bytes = Σ tensor sizes (2 per parameter in bf16).

`choose` gives the push path and `check` refuses, in one line, what cannot work before any work.
"""
from __future__ import annotations

import base64
import importlib.util
import pickle
import threading
from typing import Callable, Iterable

import numpy as np

PATHS = ("auto", "disk", "adapter", "nccl", "ipc")
# what each GPU path needs in the trainer's Python, and how to get it
NEEDS = {("vllm_server", "nccl"): ("cupy", "pip install cupy-cuda12x"),
         ("vllm_server", "ipc"): ("torch", "pip install torch"),
         ("sglang_server", "nccl"): ("torch", "pip install torch"),
         ("sglang_server", "ipc"): ("sglang", "pip install sglang")}


def choose(setting: str, lora: bool) -> str:
    """The push path: `auto` is the adapter for a LoRA student and the disk otherwise (on every
    platform: the GPU paths are opted into until they have run on a GPU)."""
    if setting == "auto":
        return "adapter" if lora else "disk"
    return setting


def check(rollout, backend: str) -> None:
    """One ValueError line when `rollout.weight_sync` cannot work here (config validation)."""
    path, engine = rollout.weight_sync, rollout.engine
    if path not in PATHS:
        raise ValueError(f"rollout.weight_sync: {path!r} is not one of {', '.join(PATHS)}")
    if path not in ("nccl", "ipc") or engine not in ("vllm_server", "sglang_server"):
        return
    if backend != "gpu":
        raise ValueError(f"rollout.weight_sync: {path} moves the weights between GPUs, but the "
                         f"trainer runs on {backend}; set rollout.weight_sync: disk (or auto)")
    module, install = NEEDS[engine, path]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"rollout.weight_sync: {path} with {engine} needs {module} in the "
                         f"trainer's Python ({install}); install it or set rollout.weight_sync: disk")
    urls = (rollout.url,) if isinstance(rollout.url, str) else tuple(rollout.url)
    if path == "ipc" and len(urls) > 1:
        raise ValueError("rollout.weight_sync: ipc shares the trainer's GPU memory with one server "
                         f"on the same GPU, but rollout.url lists {len(urls)}; use nccl or disk")
    if engine == "sglang_server" and path == "nccl" and not rollout.transfer_address:
        raise ValueError("rollout.transfer_address: sglang_server's nccl push meets the server at "
                         "a host:port the trainer listens on; set it (e.g. 10.0.0.5:29600)")


def export_dtype_name(array: np.ndarray) -> str:
    """The torch dtype name both engines read (`getattr(torch, name)`)."""
    return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name


class Transfer:
    """One server's GPU push: `open(post)` once, then `push(named tensors) -> bytes`.
    `post(route, payload)` is the engine's request to that server (its retries, its errors)."""

    def __init__(self, engine: str, path: str, protocol, world_size: int = 2,
                 transfer_address: str = ""):
        self.engine, self.path, self.protocol = engine, path, protocol
        self.world_size, self.address = world_size, transfer_address
        self._version, self._comm, self._keep = 0, None, []

    # -- setting up ---------------------------------------------------------------------------
    def open(self, post: Callable[[str, dict], object]) -> None:
        if self.path == "ipc":
            if self.engine == "vllm_server":
                post(self.protocol.TRANSFER_INIT_PATH, self.protocol.transfer_init_request("ipc"))
            return
        # the server's workers join while the trainer joins as rank 0: both block until all have
        joiner = threading.Thread(target=post, args=self._init_request())
        joiner.start()
        self._comm = self._join_group()
        joiner.join()

    def _init_request(self) -> tuple[str, dict]:
        if self.engine == "vllm_server":
            return (self.protocol.TRANSFER_INIT_PATH, self.protocol.transfer_init_request(
                "nccl", self.world_size, base64.b64encode(self._unique_id()).decode()))
        host, port = self.address.rsplit(":", 1)
        return (self.protocol.GROUP_INIT_PATH,
                self.protocol.group_init_request(host, int(port), self.world_size))

    def _unique_id(self) -> bytes:
        """The NCCL unique id (128 bytes) this trainer mints as rank 0."""
        from cupy.cuda import nccl   # optional, GPU only (check() made sure it imports)

        self._uid = nccl.get_unique_id()
        return bytes(b % 256 for b in self._uid)

    def _join_group(self):
        if self.engine == "vllm_server":
            import cupy   # optional, GPU only
            from cupy.cuda import nccl   # optional, GPU only

            comm = nccl.NcclCommunicator(self.world_size, self._uid, 0)
            one = cupy.zeros(1, cupy.float32)   # vLLM's workers open with a one-element all-reduce
            comm.allReduce(one.data.ptr, one.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cupy.cuda.Stream.null.ptr)
            return comm
        import torch.distributed as dist   # optional, GPU only

        dist.init_process_group("nccl", init_method=f"tcp://{self.address}",
                                world_size=self.world_size, rank=0)
        return dist

    # -- one push -----------------------------------------------------------------------------
    def push(self, named: Iterable[tuple[str, np.ndarray]], post) -> int:
        named = list(named)
        names = [n for n, _ in named]
        dtypes = [export_dtype_name(a) for _, a in named]
        shapes = [list(a.shape) for _, a in named]
        self._version += 1
        p = self.protocol
        if self.engine == "vllm_server":
            post(p.TRANSFER_START_PATH, {})
            if self.path == "ipc":
                post(p.TRANSFER_UPDATE_PATH, p.transfer_update_request(
                    names, dtypes, shapes, self._ipc_handles([a for _, a in named])))
            else:
                self._broadcast_beside(post, p.TRANSFER_UPDATE_PATH,
                                       p.transfer_update_request(names, dtypes, shapes), named)
            post(p.TRANSFER_FINISH_PATH, p.transfer_finish_request(str(self._version)))
        elif self.path == "ipc":
            from sglang.srt.utils import MultiprocessingSerializer   # optional, GPU only

            tensors = [(n, t) for n, t in zip(names, self._on_gpu([a for _, a in named]))]
            p.check_update_answer(post(p.TENSOR_UPDATE_PATH, p.tensor_update_request(
                [MultiprocessingSerializer.serialize(tensors, output_str=True)])))
        else:
            answer = self._broadcast_beside(post, p.DISTRIBUTED_UPDATE_PATH,
                                            p.distributed_update_request(names, dtypes, shapes),
                                            named)
            p.check_update_answer(answer)
        return sum(a.nbytes for _, a in named)

    def _broadcast_beside(self, post, route, payload, named):
        """The update request tells the server what comes; the tensors follow on the group."""
        answer = {}
        request = threading.Thread(target=lambda: answer.setdefault("a", post(route, payload)))
        request.start()
        for _, array in named:
            self._broadcast(array)
        request.join()
        return answer.get("a")

    def _broadcast(self, array: np.ndarray) -> None:
        if self.engine == "vllm_server":
            import cupy   # optional, GPU only
            from cupy.cuda import nccl   # optional, GPU only

            staged = cupy.asarray(array.view(np.uint16) if array.dtype.name == "bfloat16" else array)
            kind = {"bfloat16": nccl.NCCL_BFLOAT16, "float16": nccl.NCCL_FLOAT16,
                    "float32": nccl.NCCL_FLOAT32}[array.dtype.name]
            self._comm.bcast(staged.data.ptr, array.size, kind, 0, cupy.cuda.Stream.null.ptr)
            cupy.cuda.Stream.null.synchronize()
            return
        (tensor,) = self._on_gpu([array])
        self._comm.broadcast(tensor, src=0)

    def _on_gpu(self, arrays):
        import torch   # optional, GPU only

        out = []
        for a in arrays:
            host = torch.from_numpy(a.view(np.int16) if a.dtype.name == "bfloat16" else a)
            t = host.cuda()
            out.append(t.view(torch.bfloat16) if a.dtype.name == "bfloat16" else t)
        return out

    def _ipc_handles(self, arrays) -> str:
        """vLLM's ipc_handles: per tensor {GPU uuid: torch's rebuild args}, pickled, base64. The
        tensors stay referenced until the next push (the server copies them meanwhile)."""
        import torch   # optional, GPU only
        from torch.multiprocessing.reductions import reduce_tensor   # optional, GPU only

        self._keep = self._on_gpu(arrays)
        uuid = str(torch.cuda.get_device_properties(self._keep[0].device).uuid)
        handles = [{uuid: reduce_tensor(t)[1]} for t in self._keep]
        return base64.b64encode(pickle.dumps(handles)).decode()
