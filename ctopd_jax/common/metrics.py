"""Training metrics: a JSONL log, TensorBoard scalars, a tqdm progress bar and a step timer.

Decisions:
- One JSON object per logged step in `<run_dir>/metrics.jsonl` with every scalar of that step
  (loss, lr, grad_norm, coverage_student / coverage_teacher per batch and cumulative,
  byte_mismatch_samples, logprob_gap, response_length, time_* seconds (StepTimer: the phases,
  time_other and time_wall), tokens_per_s, ...).
  Non-scalar extras (e.g. a few byte-mismatch sample texts) go to `<run_dir>/samples.jsonl`.
- Every row also gets `wall_time` (unix seconds), `elapsed_s` (seconds of training so far,
  continued across resumes from the last kept row), `host_rss_bytes` (the process's resident
  memory as the row is made, at the step's end, where /proc says it) and, where the device
  reports it, `peak_device_memory_bytes` (the largest `peak_bytes_in_use` over this process's
  devices). These and the time_* seconds are the row's readings of the clock and the machine
  (`MACHINE_READINGS`); two runs of the same steps share every other value (`run_values`).
- Nothing is ever truncated or overwritten, and a kill at any moment loses no row: a fresh
  start renames an existing log to metrics.1.jsonl, a resume from step N sets the rows after N
  aside in metrics.after_step_N.jsonl, and the row of a checkpointed step also rides in its
  checkpoint (metrics_files.py says how and why).
- Progress: a tqdm bar when the stream is a terminal; otherwise (redirected to a file, CI) one
  plain line per logged step. Messages (`write`) always get lines of their own, never inside
  the bar.
- Only process 0 writes; other processes get a silent logger.
- Weights & Biases (`logging.wandb`): the same rows as metrics.jsonl (`wandb.log(row, step=)`)
  and the run config, one wandb run per training run.  Its id is kept in
  `<run_dir>/wandb_run_id`: a resume (start_step > 0) continues that run, a fresh start makes
  a new one.  wandb keeps its files under $WANDB_DIR when set, else in the run directory.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import queue
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
from tqdm import tqdm

from ctopd_jax.common import heap
from ctopd_jax.common.kill_points import kill_point
from ctopd_jax.common.metrics_files import (METRICS_FILE, SAMPLES_FILE, complete_step, last_elapsed,
                                            rotate_log, set_aside_after)
TIME_KEYS = ("rollout", "align", "teacher", "student", "sync", "checkpoint")
NOT_SCALARS_FOR_TENSORBOARD = ("wall_time",)


class MetricsError(ValueError):
    """A run directory or metrics log that cannot be read; the message names the path."""


def _scalar(value: Any) -> float | int | None:
    try:
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        return float(value)
    except (TypeError, ValueError):
        return None


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiled = {"seconds": 0.0, "listening": False}


def compile_seconds() -> float:
    """XLA compile seconds of this process so far (from jax.monitoring; counted from the first
    call, which registers the listener)."""
    if not _compiled["listening"]:
        def listen(event, duration, **_):
            if event == _COMPILE_EVENT:
                _compiled["seconds"] += duration
        jax.monitoring.register_event_duration_secs_listener(listen)
        _compiled["listening"] = True
    return _compiled["seconds"]


class StepTimer:
    """Seconds per phase of one iteration that add up to its wall time: `time_<phase>` per
    phase, `time_other` for what falls in none, `time_wall` from the timer's creation to
    `as_metrics`, and the XLA compile seconds spent inside (`time_compile`, part of the phases).

    Host phases: `with timer("rollout"): ...`. Device phases: the host hands the dispatched
    work's output to `device(phase, output, since)`; a watcher thread waits for it, so the phase
    ends when its device work ends (the loop never waits). Programs run one after another: each
    starts at its dispatch or at the previous one's end, whichever is later. Device-busy time is
    the device phase's; a host phase keeps only its time outside device work (host work hidden
    under it costs nothing), so the phases and `time_other` partition the wall time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._began = time.perf_counter()
        self._compile_start = compile_seconds()
        self._host: list[tuple[str, float, float]] = []
        self._pending, self._watcher = queue.Queue(), None   # the watcher starts with device work
        self._device: list[tuple[str, float, float]] = []   # (phase, dispatched, finished)

    @contextmanager
    def __call__(self, phase: str):
        kill_point(f"phase:{phase}")
        start = time.perf_counter()
        try:
            yield start
        finally:
            self._host.append((phase, start, time.perf_counter()))

    def device(self, phase: str, output, since: float) -> None:
        """Device work of `phase` dispatched at `since`, done when `output` (a returned array
        nothing donates) is ready."""
        kill_point(f"device:{phase}")   # the phase's work dispatched, not yet done
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True)
            self._watcher.start()
        self._pending.put((phase, since, output))

    def _watch(self) -> None:
        while (item := self._pending.get()) is not None:
            phase, since, output = item
            jax.block_until_ready(output)
            self._device.append((phase, since, time.perf_counter()))

    def _settle(self) -> None:
        """Wait for the watched device work and turn every interval into `seconds`."""
        if self._watcher is not None:
            self._pending.put(None)
            self._watcher.join()
            self._watcher = None
        busy, end = [], float("-inf")
        self.seconds = {}
        for phase, since, finished in self._device:
            start = max(since, end)
            end = max(finished, start)
            busy.append((start, end))
            self.seconds[phase] = self.seconds.get(phase, 0.0) + end - start
        ends = [b for _, b in busy]   # busy intervals are disjoint and in order
        for phase, start, stop in self._host:
            covered, i = 0.0, bisect.bisect_right(ends, start)
            while i < len(busy) and busy[i][0] < stop:
                covered += max(0.0, min(stop, busy[i][1]) - max(start, busy[i][0]))
                i += 1
            self.seconds[phase] = self.seconds.get(phase, 0.0) + (stop - start) - covered

    def as_metrics(self) -> dict[str, float]:
        self._settle()
        out = {f"time_{k}": v for k, v in self.seconds.items()}
        out["time_total"] = sum(self.seconds.values())
        out["time_wall"] = time.perf_counter() - self._began
        out["time_other"] = out["time_wall"] - out["time_total"]
        out["time_compile"] = compile_seconds() - self._compile_start
        return out


class StartupClock:
    """One stderr line as each start-up phase begins (`[start-up   12.3 s] teacher`), so a run
    that is slow or killed before its first iteration shows where the time went."""

    def __init__(self, enabled: bool = True):
        self.start, self.enabled = time.perf_counter(), enabled

    def __call__(self, phase: str) -> None:
        if self.enabled:
            print(f"[start-up {time.perf_counter() - self.start:7.1f} s] {phase}", file=sys.stderr,
                  flush=True)


# what a row reads off the clock or the machine (and every time_* key): a resumed run and one
# never stopped differ there, and must not anywhere else
MACHINE_READINGS = ("wall_time", "elapsed_s", "tokens_per_s", "host_rss_bytes",
                    "peak_device_memory_bytes")


def run_values(row: Mapping[str, Any]) -> dict:
    """The row without its readings of the clock and the machine: what two runs of the same
    steps share."""
    return {k: v for k, v in row.items() if not k.startswith("time_") and k not in MACHINE_READINGS}


def peak_device_memory() -> int | None:
    """The largest peak_bytes_in_use over this process's devices (None when not reported)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    peaks = []
    try:
        for device in jax.local_devices():
            stats = device.memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                peaks.append(int(stats["peak_bytes_in_use"]))
    except Exception:  # backends without memory stats raise various errors
        return None
    return max(peaks) if peaks else None


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, jsonl: bool = True,
                 tensorboard: bool = True, progress: bool = True, is_writer: bool = True,
                 stream=None, config=None, restored_lines=None):
        """`restored_lines`: the lines the checkpoint of `start_step` carried (`lines`), written
        when the log lacks that step's row."""
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.is_writer = is_writer
        self.stream = stream if stream is not None else sys.stderr
        self.moved: list[Path] = []       # logs rotated or rows set aside at start
        self.restored_row: int | None = None   # the step whose row came from its checkpoint
        self._jsonl = None
        self._samples = None
        self._tb = None
        self._bar = None
        self._wandb = None
        self._lines = False
        self._started = time.time()
        self._elapsed_before = 0.0
        self._rss_level = None         # the last row's host_rss_bytes (heap.settled_resident_bytes)
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            for name in (METRICS_FILE, SAMPLES_FILE):
                path = self.run_dir / name
                moved = set_aside_after(path, start_step) if start_step else rotate_log(path)
                if moved is not None:
                    self.moved.append(moved)
            if start_step and complete_step(self.run_dir, start_step, restored_lines):
                self.restored_row = start_step
            if start_step:
                self._elapsed_before = last_elapsed(self.run_dir / METRICS_FILE)
            self._jsonl = (self.run_dir / METRICS_FILE).open("a", encoding="utf-8")
            self._samples = (self.run_dir / SAMPLES_FILE).open("a", encoding="utf-8")
        if tensorboard:
            # a heavy import (protobuf), only when logging.tensorboard is on
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
            if getattr(self.stream, "isatty", lambda: False)():
                self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                                 dynamic_ncols=True, file=self.stream)
            else:
                self._lines = True
        if config is not None and config.logging.wandb:
            self._wandb = _start_wandb(self.run_dir, config, start_step)
        for path in self.moved:
            self.write(f"metrics: kept the earlier rows in {path}")
        if self.restored_row is not None:
            self.write(f"metrics: the row of step {self.restored_row} came from its checkpoint (the "
                       "run stopped before writing it)")

    def record(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """The row of `step`: every scalar of `metrics`, the clock and the device's peak."""
        record = {"step": int(step)}
        for key, value in metrics.items():
            number = _scalar(value)
            if number is not None:
                record[key] = number
        now = time.time()
        record.setdefault("wall_time", now)
        record.setdefault("elapsed_s", self._elapsed_before + now - self._started)
        self._rss_level = heap.settled_resident_bytes(self._rss_level)
        for key, reading in (("host_rss_bytes", self._rss_level),
                             ("peak_device_memory_bytes", peak_device_memory())):
            if reading is not None:
                record.setdefault(key, reading)
        return record

    @staticmethod
    def _sample_line(step: int, sample: Mapping[str, Any]) -> str:
        return json.dumps({"step": int(step), **sample}, ensure_ascii=False)

    def lines(self, step: int, metrics: Mapping[str, Any], samples=()) -> dict | None:
        """The lines `log` would write for `step` now, for its checkpoint to carry
        (metrics_files.complete_step); None when this process writes no log."""
        if not (self.is_writer and self._jsonl is not None):
            return None
        return {"metrics": json.dumps(self.record(step, metrics), sort_keys=True),
                "samples": [self._sample_line(step, s) for s in samples]}

    def log(self, step: int, metrics: Mapping[str, Any], samples: Iterable[Mapping[str, Any]] = ()) -> dict:
        record = self.record(step, metrics)
        if not self.is_writer:
            return record
        if self._jsonl is not None:
            for sample in samples:   # first: a row on disk means its samples are whole
                self._samples.write(self._sample_line(step, sample) + "\n")
            self._samples.flush()
            text = json.dumps(record, sort_keys=True) + "\n"
            self._jsonl.write(text[:len(text) // 2])
            kill_point("metrics_write", before=self._jsonl.flush)   # a torn row on disk
            self._jsonl.write(text[len(text) // 2:])
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and key not in NOT_SCALARS_FOR_TENSORBOARD and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        keys = ("loss", "coverage_student", "tokens_per_s")
        if self._bar is not None:
            post = {k: f"{record[k]:.4g}" for k in keys if k in record}
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        elif self._lines:
            shown = "  ".join(f"{k} {record[k]:.4g}" for k in keys if k in record)
            print(f"step {step}/{self.total_steps}  {shown}  elapsed {record['elapsed_s']:.1f}s",
                  file=self.stream, flush=True)
        return record

    def write(self, message: str) -> None:
        """One line of its own (above the bar when there is one)."""
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        for handle in (self._jsonl, self._samples):
            if handle is not None:
                handle.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


WANDB_ID_FILE = "wandb_run_id"


def _start_wandb(run_dir: Path, config, start_step: int):
    """The wandb run of this training run (resumed runs continue the id kept in run_dir)."""
    try:
        import wandb   # optional dependency (logging.wandb: true)
    except ImportError:
        raise MetricsError("logging.wandb: true needs the wandb package: pip install wandb") from None
    lg = config.logging
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if start_step and id_file.is_file() else ""
    run_id = run_id or uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    directory = Path(os.environ.get("WANDB_DIR") or run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=lg.wandb_project, entity=lg.wandb_entity or None,
                      name=config.run_name, id=run_id, resume="allow", dir=str(directory),
                      mode=lg.wandb_mode, config=config.to_dict())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of <run_dir>/metrics.jsonl; a damaged last line (a kill mid-write) is skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MetricsError(f"{run_dir}: no such run directory; pass the output_dir of a run")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no metrics log; pass a run directory written by "
                           "ctopd_jax.train (logging.jsonl must be true)")
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise MetricsError(f"{path}:{n}: not a JSON row; fix or remove the line") from None
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows
