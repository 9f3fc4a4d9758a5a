"""Symbolic-comparison worker: ``python -m ctopd_jax.grading_worker MEMORY_BYTES CPU_SECONDS``.

Writes ``{"ready": true}`` once its imports are done, then reads one JSON task per line on
stdin (``{"id": n, "pred": ..., "gold": ...}``) and writes
``{"id": n, "result": "equal" | "different" | "error"}`` per line on stdout.

Time bound: before each task the soft ``RLIMIT_CPU`` is set to the CPU time used so far plus
CPU_SECONDS; the kernel then terminates the worker with SIGXCPU if one comparison uses more.
CPU time, unlike wall time, does not depend on how loaded the machine is, so a verdict does not
flip to "timeout" because other jobs share the cores (the parent keeps a wall-clock backstop).
It is a plain
subprocess rather than a multiprocessing child so that it never re-imports the parent's main
module (which would pull jax into a process that runs under an address-space limit), and so
the parent can kill it at a deadline whatever it is doing.
"""
from __future__ import annotations

import json
import math
import resource
import sys

from ctopd_jax.grading.equivalence import compare
from ctopd_jax.grading.symbolic import symbolic_equal


def main() -> None:
    memory_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    cpu_seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if memory_bytes > 0:
        # A runaway power like 10**10**10 then fails fast with MemoryError instead of
        # swapping the machine until the parent's deadline kills it.
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    sys.setrecursionlimit(5000)
    symbolic_equal("x+1", "1+x")  # warm sympy's caches before the first timed task
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        task = json.loads(line)
        if cpu_seconds > 0:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft = math.ceil(usage.ru_utime + usage.ru_stime) + cpu_seconds
            resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY
                                                     else min(soft, hard), hard))
        try:
            verdict = compare(task["pred"], task["gold"], symbolic_equal)
            result = "equal" if verdict else "different"
        except (MemoryError, RecursionError, OverflowError, ValueError, TypeError,
                ZeroDivisionError, AttributeError, NotImplementedError, KeyError, IndexError):
            result = "error"
        except Exception:  # noqa: BLE001 - sympy raises many kinds; any of them means "no"
            result = "error"
        sys.stdout.write(json.dumps({"id": task["id"], "result": result}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
