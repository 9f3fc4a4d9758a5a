"""A pool of symbolic-comparison worker processes with a hard per-task time bound.

Each task gets ``timeout_s`` seconds of CPU time (rounded up to whole seconds: the kernel's
``RLIMIT_CPU`` granularity), enforced by the kernel inside the worker (SIGXCPU terminates it),
plus a wall-clock backstop in the parent (``wall_timeout_s``, default max(30, 10 x timeout_s))
after which the parent kills the worker with SIGKILL. Either way the task's outcome is
"timeout" and the worker is replaced on next use. This bounds every sample's grading whatever
sympy does, including work inside one C call (huge integer powers), which ``signal.alarm``
could not interrupt. CPU time rather than wall time is the primary bound so that verdicts do
not depend on machine load (a busy CI box must not turn slow-but-valid comparisons into
"timeout"); the worker's start-up (imports) is excluded by a ready handshake.
"""
from __future__ import annotations

import collections
import json
import os
import math
import select
import signal
import subprocess
import sys
import time

DEFAULT_MEMORY_BYTES = 2 << 30


class _Worker:
    def __init__(self, memory_bytes: int, cpu_seconds: int, startup_timeout_s: float = 120.0):
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        # The worker imports ctopd_jax by name: make the package importable from any cwd.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ctopd_jax.grading_worker", str(memory_bytes), str(cpu_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        self.buffer = b""
        self.task: int | None = None
        self.deadline = 0.0
        self.startup_timeout_s = startup_timeout_s
        self._ready: bool | None = None

    @property
    def ready(self) -> bool:
        """Whether the worker finished its imports (waits for it the first time)."""
        if self._ready is None:
            self._ready = self._wait_ready(self.startup_timeout_s)
        return self._ready

    def _wait_ready(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            lines = self.read_results()
            if lines is None:
                return False
            if any(line.get("ready") for line in lines):
                return True
        return False

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, task_id: int, pred: str, gold: str, timeout_s: float) -> None:
        line = json.dumps({"id": task_id, "pred": pred, "gold": gold}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        self.task = task_id
        self.deadline = time.monotonic() + timeout_s

    def read_results(self) -> list[dict] | None:
        """Complete result lines available now; None if the worker died."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def cpu_limited(self) -> bool:
        """True if the worker died of its CPU limit (SIGXCPU, or SIGKILL at the hard limit)."""
        code = self.proc.poll()
        return code is not None and -code in (signal.SIGXCPU, signal.SIGKILL)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class SymbolicPool:
    """Run ``compare(pred, gold, symbolic_equal)`` in worker processes, each task bounded.

    Outcomes: "equal", "different", "timeout" (killed at the deadline), "error" (sympy raised,
    ran out of memory, or the worker died). Workers start lazily (about a second each: the
    sympy import) and are reused across calls.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 5.0,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, wall_timeout_s: float | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.n_workers = workers
        self.timeout_s = timeout_s
        self.cpu_seconds = max(1, math.ceil(timeout_s))
        self.wall_timeout_s = wall_timeout_s or max(30.0, 10.0 * timeout_s)
        self.memory_bytes = memory_bytes
        self._workers: list[_Worker | None] = [None] * workers
        self.timeouts = 0

    def _worker(self, slot: int) -> _Worker:
        w = self._workers[slot]
        if w is None or w.proc.poll() is not None:
            w = self._workers[slot] = _Worker(self.memory_bytes, self.cpu_seconds)
        return w

    def run(self, pairs: list[tuple[str, str]]) -> list[str]:
        outcomes: list[str | None] = [None] * len(pairs)
        pending = collections.deque(range(len(pairs)))
        busy: dict[int, int] = {}  # worker slot -> task index
        # Start the workers this call needs together: their imports then overlap.
        for slot in range(min(self.n_workers, len(pairs))):
            self._worker(slot)
        while pending or busy:
            for slot in range(self.n_workers):
                if slot not in busy and pending:
                    index = pending.popleft()
                    worker = self._worker(slot)
                    if not worker.ready:  # could not start (e.g. broken environment)
                        worker.kill()
                        self._workers[slot] = None
                        outcomes[index] = "error"
                        continue
                    try:
                        worker.send(index, *pairs[index], self.wall_timeout_s)
                        busy[slot] = index
                    except (BrokenPipeError, OSError):
                        worker.kill()
                        self._workers[slot] = None
                        outcomes[index] = "error"
            if not busy:
                continue
            now = time.monotonic()
            wait = max(0.0, min(self._workers[s].deadline for s in busy) - now)
            by_fd = {self._workers[s].fd: s for s in busy}
            ready, _, _ = select.select(list(by_fd), [], [], wait)
            for fd in ready:
                slot = by_fd[fd]
                worker = self._workers[slot]
                results = worker.read_results()
                if results is None:  # died: its CPU limit, or e.g. the OOM killer
                    worker.proc.wait()
                    timed_out = worker.cpu_limited()
                    outcomes[busy.pop(slot)] = "timeout" if timed_out else "error"
                    self.timeouts += timed_out
                    worker.kill()
                    self._workers[slot] = None
                    continue
                for result in results:
                    outcomes[result["id"]] = result["result"]
                    busy.pop(slot, None)
            now = time.monotonic()
            for slot in [s for s in busy if self._workers[s].deadline <= now]:
                outcomes[busy.pop(slot)] = "timeout"
                self.timeouts += 1
                self._workers[slot].kill()
                self._workers[slot] = None
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None

    def __enter__(self) -> "SymbolicPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
