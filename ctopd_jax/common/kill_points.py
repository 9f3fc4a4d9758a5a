"""Named moments at which a test may SIGKILL the process, to show that a run killed at any
moment resumes exactly (scripts/chaos.py, tests/trainer/test_chaos.py).

    kill_point("checkpoint_write")     # nothing happens unless CTOPD_JAX_KILL_AT names it

`CTOPD_JAX_KILL_AT=<point>:<n>` makes the n-th passage (counted from 1 in this process) through
`<point>` send SIGKILL to the process itself: no handler runs, no Python buffer is flushed, no
`finally` block, exactly as the OOM killer or a lost node. What the process had handed to the
operating system stays on disk, as it would there. One line on stderr (written straight to the
file descriptor) names the point first, so a harness can log which phase each kill hit.

The points (where the code passes them):
- `phase:<name>` as a host phase of an iteration begins (metrics.StepTimer: rollout, align,
  teacher, student, sync, checkpoint, eval, ...), `device:<name>` right after a phase's device
  work was dispatched (the update being computed);
- `checkpoint_write` once Orbax's asynchronous write of a step is in flight;
- `metrics_write` in the middle of a metrics.jsonl row (half the line handed to the OS);
- `hf_export` when the exported student's weights are written, not yet in place;
- `report_write` between two files of an evaluation report moved into place;
- `gguf_convert` after each tensor a GGUF conversion dequantized (models/gguf_convert.py).

Unset (every real run) a point costs one dictionary lookup.
"""
from __future__ import annotations

import os
import signal

ENV = "CTOPD_JAX_KILL_AT"
_passed: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(ENV, "")
    name, _, count = spec.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else None


def kill_point(name: str, before=None) -> None:
    """SIGKILL this process when `CTOPD_JAX_KILL_AT` names this passage through `name`;
    `before()` runs first (e.g. a flush that puts a half-written line on disk)."""
    if ENV not in os.environ:
        return
    target = _target()
    if target is None or target[0] != name:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == target[1]:
        if before is not None:
            before()
        os.write(2, f"kill point {name}:{target[1]}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
