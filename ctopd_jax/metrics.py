"""Training metrics: a JSONL log, TensorBoard scalars, a tqdm progress bar and a step timer.

Decisions:
- One JSON object per logged step in `<run_dir>/metrics.jsonl` with every scalar of that step
  (loss, lr, grad_norm, coverage_student / coverage_teacher per batch and cumulative,
  byte_mismatch_samples, logprob_gap, response_length, time_* seconds, tokens_per_s, ...).
  Non-scalar extras (e.g. a few byte-mismatch sample texts) go to `<run_dir>/samples.jsonl`.
- On resume the JSONL log is truncated to the steps before the restored checkpoint's step, so
  a killed-and-resumed run leaves the same log as an uninterrupted one.
- Only process 0 writes; other processes get a silent logger.
"""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TIME_KEYS = ("rollout", "align", "teacher", "student", "sync", "checkpoint")


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


class StepTimer:
    """Wall-clock seconds per phase of one iteration: `with timer("rollout"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        out = {f"time_{k}": v for k, v in self.seconds.items()}
        out["time_total"] = sum(self.seconds.values())
        return out


def truncate_log(path: Path, before_step: int) -> None:
    """Keep only records with step < before_step (for an exact resume)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) < before_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, jsonl: bool = True,
                 tensorboard: bool = True, progress: bool = True, is_writer: bool = True):
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self._jsonl = None
        self._samples = None
        self._tb = None
        self._bar = None
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            truncate_log(self.run_dir / METRICS_FILE, start_step + 1)
            truncate_log(self.run_dir / SAMPLES_FILE, start_step + 1)
            self._jsonl = (self.run_dir / METRICS_FILE).open("a")
            self._samples = (self.run_dir / SAMPLES_FILE).open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any], samples: Iterable[Mapping[str, Any]] = ()) -> dict:
        record = {"step": int(step)}
        for key, value in metrics.items():
            number = _scalar(value)
            if number is not None:
                record[key] = number
        if not self.is_writer:
            return record
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
            self._jsonl.flush()
            for sample in samples:
                self._samples.write(json.dumps({"step": int(step), **sample}, ensure_ascii=False) + "\n")
            self._samples.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)
            self._tb.flush()
        if self._bar is not None:
            post = {k: f"{record[k]:.4g}" for k in ("loss", "coverage_student", "tokens_per_s") if k in record}
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        return record

    def write(self, message: str) -> None:
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        for handle in (self._jsonl, self._samples):
            if handle is not None:
                handle.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics log; pass a run directory written by ctopd_jax.train")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
