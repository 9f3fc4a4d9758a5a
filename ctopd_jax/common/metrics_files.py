"""The log files of a run on disk (metrics.jsonl, samples.jsonl): kept whole across fresh
starts, resumes and kills at any moment.

Decisions (metrics.py's doc says what the rows hold):
- Nothing is ever truncated or overwritten. A fresh start over a non-empty log renames it to
  metrics.1.jsonl (the next free number); a resume from step N keeps the rows of steps <= N
  and moves the rest (and damaged lines: a kill in the middle of a write) to
  metrics.after_step_N.jsonl (.2, ... when taken). Each file is written beside its name and
  renamed into place, so a kill leaves the old file or the new one, never half of one.
- A row reaches the log after its step's checkpoint was started, and an asynchronous
  checkpoint may be committed before the row is written: a kill in between would leave a
  resume from step N without the row of N. So the checkpoint's meta carries the lines the
  step is about to log (`MetricsLogger.lines`), and a resume writes them when the log lacks
  them (`complete_step`). They are the row as it stood before the checkpoint: its `time_*`
  seconds are those measured until then (no `time_checkpoint`).
- Within a step the samples lines are written before the metrics row, so a present row means
  its samples are whole.
"""
from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _free_name(path: Path, stem_suffix: str) -> Path:
    """<stem><stem_suffix>.jsonl, or with .2, .3 ... when taken."""
    candidate = path.with_name(f"{path.stem}{stem_suffix}{path.suffix}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}{stem_suffix}.{n}{path.suffix}")
    return candidate


def _write_whole(path: Path, lines: list[str]) -> None:
    """`path` with these lines, written beside it and renamed into place (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


def rotate_log(path: Path) -> Path | None:
    """Rename a non-empty log to metrics.1.jsonl, metrics.2.jsonl ... (the first free number);
    returns the new path (None when there was nothing to keep)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while (target := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(target)
    return target


def row_step(line: str) -> int | None:
    """The `step` of a log line; None for a damaged line."""
    try:
        row = json.loads(line)
        return int(row["step"]) if isinstance(row, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def set_aside_after(path: Path, step: int) -> Path | None:
    """Move the rows with step > `step` (and damaged lines) to <stem>.after_step_<step>.jsonl;
    the rows up to `step` stay. Returns the set-aside file, None when nothing moved. A kill
    in between leaves the log whole (the next resume sets the same rows aside again)."""
    kept, moved = [], []
    for line in _lines(path):
        step_of = row_step(line)
        (kept if step_of is not None and step_of <= step else moved).append(line)
    if not moved:
        return None
    aside = _free_name(path, f".after_step_{step}")
    _write_whole(aside, moved)
    _write_whole(path, kept)
    return aside


def complete_step(run_dir: Path, step: int, lines: dict | None) -> bool:
    """After a resume from `step` (the logs already cut at it): append the lines the checkpoint
    of `step` carried (`{"metrics": row, "samples": [...]}`) when metrics.jsonl lacks the row
    of `step`, the samples after those already there. True when something was written."""
    if not lines or not lines.get("metrics"):
        return False
    metrics = Path(run_dir) / METRICS_FILE
    if any(row_step(line) == step for line in _lines(metrics)):
        return False
    samples = Path(run_dir) / SAMPLES_FILE
    have = sum(row_step(line) == step for line in _lines(samples))
    missing = list(lines.get("samples") or ())[have:]
    if missing:
        with samples.open("a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in missing))
    with metrics.open("a", encoding="utf-8") as handle:
        handle.write(lines["metrics"] + "\n")
    return True


def last_elapsed(path: Path) -> float:
    """`elapsed_s` of the log's last readable row (0.0 without one)."""
    for line in reversed(_lines(path)):
        try:
            return float(json.loads(line).get("elapsed_s", 0.0))
        except (ValueError, AttributeError, TypeError):
            continue
    return 0.0
