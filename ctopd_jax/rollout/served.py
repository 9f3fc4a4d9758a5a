"""The student's rollouts from a server of their own (`rollout.engine: vllm_server | sglang_server`).

    engine = ServedRolloutEngine(model, eos_ids, pad_id, rollout, sync_dir=..., dtype="float32")
    result = engine.generate(prompts, params)   # token ids in, token ids + log-probs back
    engine.update_weights(model)                # push, then check the server's log-probs
    engine.close()                              # stops a launched server

Prompts go as token ids, one request per prompt (its `n` samples in it, seeded per prompt as the
in-process engine seeds: `seed * 1_000_003 + prompt id`), spread round-robin over `rollout.url`
(one server or several sharing the prompts), `rollout.max_concurrency` requests in flight per
server, with the served teacher's transport (time-outs, retries with backoff, a dead server
detected through /health at once). The requests and answers are the teacher's protocol modules'
(teacher_service/vllm_protocol.py, sglang_protocol.py): one place per engine's wire format.

Weights after every update (`rollout.weight_sync`):
- `adapter` (a LoRA student; `auto` picks it for one): the PEFT adapter (models.lora.save_adapter)
  into a fresh folder of `sync_dir`, loaded by the engine's adapter route under a new name
  (vLLM /v1/load_lora_adapter, SGLang /load_lora_adapter); the previous one unloaded and removed.
  Bytes: the adapter file.
- `disk` (full weights; `auto` for a full student): config.json + safetensors written to a fresh
  folder of `sync_dir`, then the engine's reload-from-disk (vLLM /collective_rpc reload_weights
  with weights_path, then /reset_prefix_cache; SGLang /update_weights_from_disk). Works
  everywhere the server can read `sync_dir` (the same machine, or a shared file system). Bytes:
  the safetensors written, read back by every server.
- Not built here, for GPUs (no GPU to test them on): vLLM's weight transfer engine
  (/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
  NCCL to other GPUs or CUDA IPC on the same one: no file, the tensors move device to device at
  interconnect speed, ~2 bytes per parameter in bf16) and SGLang's update_weights_from_distributed
  (NCCL) / update_weights_from_tensor (same GPU). The disk path costs a write and a read of the
  whole model per update (measured on CPU in benchmarks/RESULTS.md).

After each push the server scores `rollout.logprob_check_rows` rows (the latest rollout's
samples, or a fixed probe before the first) and their log-probs are compared with the JAX
student's (`logprob_gap.response_logprobs`): a gap above the dtype's tolerance (float32 1e-3,
bf16/fp16 0.1) means the push did not take, and the run stops with one line. `push_metrics()`
gives the last push's seconds, bytes and gap (logged as rollout_push_s, rollout_push_bytes,
logprob_gap).

`launch: true` starts the server (vLLM only, one url) from `rollout.launch_python` on the
exported student folder with the served teacher's launcher (teacher_service/launch.py), stops
it on `close()` (also at interpreter exit; a killed trainer takes it along).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from ctopd_jax.config.served import check_settings, server_urls, settings_for
from ctopd_jax.models import lora
from ctopd_jax.models.weights import export_hf_checkpoint, hf_named_tensors
from ctopd_jax.rollout import weight_transfer
from ctopd_jax.rollout.base import (RolloutConfigError, RolloutEngine, RolloutResult, SamplingParams,
                                    check_prompts, finish_sample, normalize_eos_ids)
from ctopd_jax.rollout.logprob_gap import response_logprobs
from ctopd_jax.teacher_service import sglang_protocol, vllm_protocol
from ctopd_jax.teacher_service.client import (TeacherServiceError, failure_line,
                                              mismatch_line)
from ctopd_jax.teacher_service.launch import check_launch_python, launched_server
from ctopd_jax.teacher_service.scores import ProtocolError
from ctopd_jax.teacher_service.transport import ServerError, Transport

PROTOCOLS = {"vllm_server": vllm_protocol, "sglang_server": sglang_protocol}
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
PROBE_LEN = 16


class ServedRolloutError(TeacherServiceError):
    """A rollout server failed mid-run, or a weight push did not take: one line. (A
    TeacherServiceError, so the trainer names the step and the last checkpoint, exit 2.)"""


def check_rollout_settings(rollout) -> None:
    """One ValueError line for the first bad rollout-server field: the settings' own ranges
    (config/served.py), then the weight-push path against this machine (preflight and the
    engine)."""
    check_settings(rollout)
    gpu_path = rollout.weight_sync in ("nccl", "ipc")
    weight_transfer.check(rollout, jax.default_backend() if gpu_path else "")


class ServedRolloutEngine(RolloutEngine):
    def __init__(self, model, eos_ids, pad_id: int | None, rollout, *, dtype: str,
                 max_model_len: int, log_as=None, sleep=time.sleep):
        check_rollout_settings(rollout)
        self.rollout, self.dtype, self.max_model_len = rollout, dtype, int(max_model_len)
        self.protocol = PROTOCOLS[rollout.engine]
        self.eos_ids = normalize_eos_ids(eos_ids)
        self.pad_id = int(pad_id if pad_id is not None else (self.eos_ids or (0,))[0])
        self._vocab = model.cfg.vocab_size
        self.sync_path = weight_transfer.choose(rollout.weight_sync, lora.has_adapters(model))
        self.adapter_sync = self.sync_path == "adapter"
        if rollout.weight_sync == "adapter" and not lora.has_adapters(model):
            raise RolloutConfigError("rollout.weight_sync: adapter needs a LoRA student "
                                     "(lora.rank > 0); use auto or disk")
        self._owned = contextlib.ExitStack()
        if rollout.sync_dir:
            Path(rollout.sync_dir).mkdir(parents=True, exist_ok=True)
        self.sync_dir = Path(tempfile.mkdtemp(prefix="ctopd_rollout_weights_",
                                              dir=rollout.sync_dir or None))
        self._owned.callback(shutil.rmtree, self.sync_dir, True)
        self._log_as = log_as
        self._rank = lora.adapter_settings(model)["rank"] if lora.has_adapters(model) else 0
        self._pushes = itertools.count(1)
        self._served_name, self._folder = "", None
        self._check_rows: tuple[list[list[int]], list[list[int]]] | None = None
        self._push_metrics: dict[str, float] = {}
        try:  # a failed start stops what it started and leaves no weight folder behind
            base = self._export_full(lora.base_model(model) if self.adapter_sync else model)
            urls = (self._launch(base),) if rollout.launch else server_urls(rollout)
            self.urls = urls
            self._transports = [Transport(url.rstrip("/"), rollout.timeout_s, rollout.retries,
                                          rollout.backoff_s, sleep=sleep,
                                          health_path=self.protocol.ENDPOINTS.health)
                                for url in urls]
            self._transfers = []
            if self.sync_path in ("nccl", "ipc"):
                for i in range(len(urls)):
                    transfer = weight_transfer.Transfer(
                        rollout.engine, self.sync_path, self.protocol, rollout.server_gpus + 1,
                        rollout.transfer_address)
                    transfer.open(self._poster(i))
                    self._transfers.append(transfer)
            self.update_weights(model, folder=None if self.adapter_sync else base)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, model: Any, folder: Path | None = None) -> None:
        """Push the student's weights to every server, then check their log-probs."""
        started = time.perf_counter()
        if self.adapter_sync:
            size = self._push_adapter(model)
        elif self._transfers:   # GPU servers: no file (rollout/weight_transfer.py)
            try:
                size = sum(t.push(hf_named_tensors(model, dtype=self.dtype), self._poster(i))
                           for i, t in enumerate(self._transfers))
            except ProtocolError as err:
                raise ServedRolloutError(f"rollout.url: the {self.sync_path} weight push did not "
                                         f"take ({err}); set rollout.weight_sync: disk") from None
        else:
            folder = folder or self._export_full(model)
            size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            path, payload = self.protocol.reload_request(str(folder.resolve()))
            self._each("weight push", path, payload, False)   # vLLM: an empty 200
            if self.protocol.RESET_CACHE_PATH:
                self._each("weight push", self.protocol.RESET_CACHE_PATH, {}, False)
            self._replace_folder(folder)
        pushed = time.perf_counter() - started
        gap = self._check_logprobs(model)
        self._push_metrics = {"rollout_push_s": pushed, "rollout_push_bytes": float(size),
                             "logprob_gap": gap}

    def push_metrics(self) -> dict[str, float]:
        return dict(self._push_metrics)

    def _export_full(self, model) -> Path:
        folder = self.sync_dir / f"weights-{next(self._pushes)}"
        export_hf_checkpoint(lora.merged(model), model.cfg, folder, dtype=self.dtype,
                             extra_config={"eos_token_id": list(self.eos_ids) or None,
                                           "pad_token_id": self.pad_id})
        return folder

    def _replace_folder(self, folder: Path) -> None:
        """Keep the folder the servers loaded last (a restarted server reads it); drop the one
        before, except the folder a launched server was started on."""
        if self._folder is not None and self._folder != getattr(self, "_launch_folder", None):
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = folder

    def _push_adapter(self, model) -> int:
        name = f"student-{next(self._pushes)}"
        folder = lora.save_adapter(model, self.sync_dir / "adapters" / name)
        self._each("adapter push", self.protocol.LOAD_ADAPTER_PATH,
                   self.protocol.adapter_request(name, str(Path(folder).resolve())), False)
        previous, self._served_name = self._served_name, name
        if previous:
            self._each("adapter push", self.protocol.UNLOAD_ADAPTER_PATH, {"lora_name": previous},
                       False)
            shutil.rmtree(self.sync_dir / "adapters" / previous, ignore_errors=True)
        return (Path(folder) / lora.ADAPTER_WEIGHTS).stat().st_size

    def _check_logprobs(self, model) -> float:
        """max |server − JAX| log-prob over the check rows; one line when above tolerance."""
        prompts, responses = self._check_rows or self._probe()
        expected = response_logprobs(model, prompts, responses, pad_id=self.pad_id)
        batch = [(list(p) + list(r), len(p)) for p, r in zip(prompts, responses)]
        payload = self.protocol.score_request(batch, 0, self._served_name)
        answers = self._each("log-prob check", self.protocol.ENDPOINTS.score, payload)
        gap = 0.0
        for url, answer in zip(self.urls, answers):
            try:
                scored = self.protocol.parse_scores(answer, batch, 0)
            except ProtocolError as err:
                raise ServedRolloutError(f"rollout.url {url}: the log-prob check's answer does "
                                         f"not parse ({err}); check rollout.engine") from None
            server_gap = max(float(np.max(np.abs(s.token_logprobs - e)))
                             for s, e in zip(scored, expected))
            tolerance = TOLERANCE.get(self.dtype, 0.1)
            if not server_gap <= tolerance:
                raise ServedRolloutError(
                    f"rollout.url {url}: the weight push did not take: the server's log-probs "
                    f"differ from the student's by up to {server_gap:.3g} (> {tolerance:g} for "
                    f"{self.dtype}) on {len(batch)} rows; check that the server can read "
                    f"{self.sync_dir} and serves the student's architecture")
            gap = max(gap, server_gap)
        return gap

    def _probe(self):
        ids = [(7 * i + 3) % self._vocab for i in range(PROBE_LEN)]
        return [ids[: PROBE_LEN // 2]], [ids[PROBE_LEN // 2:]]

    # -- requests -----------------------------------------------------------------------------
    def _post(self, index: int, what: str, path: str, payload: dict, answer_is_json=True):
        url = self.urls[index]
        try:
            return self._transports[index].post(path, payload, answer_is_json)
        except ServerError as err:
            raise ServedRolloutError(failure_line(f"rollout.url {url}", "rollout",
                                                  self.rollout.retries, err, what)) from None

    def _poster(self, index: int):
        """post(route, payload) to server `index`, as a weight push."""
        return lambda path, payload: self._post(index, "weight push", path, payload)

    def _each(self, what: str, path: str, payload: dict, answer_is_json=True) -> list:
        return [self._post(i, what, path, payload, answer_is_json) for i in range(len(self.urls))]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutResult:
        if not isinstance(params, SamplingParams):
            raise RolloutConfigError("generate: params must be a rollout.SamplingParams")
        prompts = check_prompts(prompts, self._vocab, max_new_tokens=params.max_new_tokens,
                                positions=(self.max_model_len, "the rollout server's max_model_len"))
        first = params.first_sample_id // params.n
        # a failed request fails the batch: the prompts not sent yet stay unsent (each would
        # otherwise go through its own retries against a server known to fail)
        failed = threading.Event()

        def one(i: int):
            if failed.is_set():
                return None
            payload = self.protocol.generate_request(
                [prompts[i]], params, self._served_name, self.eos_ids,
                (params.seed * 1_000_003 + first + i) % (1 << 63))
            server = i % len(self.urls)
            try:
                answer = self._post(server, "rollout", self.protocol.GENERATE_PATH, payload)
                return self.protocol.parse_generation(answer, 1, params.n)
            except ProtocolError as err:
                failed.set()
                raise ServedRolloutError(mismatch_line(f"rollout.url {self.urls[server]}",
                                                       "rollout", self.rollout.engine,
                                                       err)) from None
            except BaseException:
                failed.set()
                raise

        workers = min(len(prompts), self.rollout.max_concurrency * len(self.urls))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            samples = list(pool.map(one, range(len(prompts))))
        result = RolloutResult([], [], [], [], [])
        for i, (prompt, rows) in enumerate(zip(prompts, samples)):
            for tokens, logprobs in rows:
                tokens, logprobs, reason = finish_sample(tokens, logprobs, self.eos_ids,
                                                         params.max_new_tokens, params.stop_on_eos)
                result.prompt_ids.append(prompt)
                result.token_ids.append(tokens)
                result.logprobs.append(logprobs)
                result.finish_reasons.append(reason)
                result.prompt_index.append(i)
        rows = [j for j in range(len(result)) if result.token_ids[j]]
        rows = rows[: self.rollout.logprob_check_rows]
        if rows:
            self._check_rows = ([result.prompt_ids[j] for j in rows],
                                [result.token_ids[j] for j in rows])
        return result

    # -- lifecycle ----------------------------------------------------------------------------
    def _launch(self, folder: Path) -> str:
        settings = settings_for(self.rollout, "")
        check_launch_python(settings, "rollout")
        # prompts are ids; sampling settings are the request's alone (no generation_config.json
        # defaults), as the in-process engine does
        extra = ["--skip-tokenizer-init", "--generation-config", "vllm"]
        if self.adapter_sync:
            rank = next(r for r in (8, 16, 32, 64, 128, 256, 512) if r >= self._rank)
            extra += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(rank)]
        env = dict(self.protocol.SERVER_ENV)
        if self.sync_path in ("nccl", "ipc"):
            extra += self.protocol.transfer_server_args(self.sync_path)
            env.update(self.protocol.TRANSFER_ENV[self.sync_path])
        self._launch_folder = folder
        server = self._owned.enter_context(launched_server(
            settings, folder, "rollout", max_model_len=self.max_model_len, max_logprobs=1,
            dtype=self.dtype, served_name="student",
            keep_log_as=self._log_as, extra_args=extra,
            extra_env=env))
        return server.url

    def close(self) -> None:
        """Stop a launched server, remove the weight folders (idempotent)."""
        self._owned.close()
