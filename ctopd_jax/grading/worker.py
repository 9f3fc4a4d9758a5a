"""Symbolic-comparison worker: ``python -m ctopd_jax.grading.worker MEMORY_BYTES``.

Reads one JSON task per line on stdin (``{"id": n, "pred": ..., "gold": ...}``) and writes
``{"id": n, "result": "equal" | "different" | "error"}`` per line on stdout. It is a plain
subprocess rather than a multiprocessing child so that it never re-imports the parent's main
module (which would pull jax into a process that runs under an address-space limit), and so
the parent can kill it at a deadline whatever it is doing.
"""
from __future__ import annotations

import json
import resource
import sys


def main() -> None:
    memory_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    from ctopd_jax.grading.equivalence import compare
    from ctopd_jax.grading.symbolic import symbolic_equal

    if memory_bytes > 0:
        # A runaway power like 10**10**10 then fails fast with MemoryError instead of
        # swapping the machine until the parent's deadline kills it.
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    sys.setrecursionlimit(5000)
    for line in sys.stdin:
        task = json.loads(line)
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
